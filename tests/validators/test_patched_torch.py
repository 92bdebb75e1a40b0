"""A refusal names the torch operations the process replaced (lightning_dp/validators/patched_torch.py): zoo36 T30's
patched ``Tensor.clamp`` was refused as an engine's wrong clipping, T28's ``aten::normal_`` kernel as a dataset that
ignores its index — the cause is now read first, under the message. A process that replaced nothing adds no note."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp.errors import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.patched_torch import note_replaced_operations, replaced_operations  # noqa: E402


def test_nothing_is_replaced_in_a_plain_process() -> None:
    assert replaced_operations() == []
    error = PrivacyConfigurationError("refused")
    note_replaced_operations(error)
    assert not getattr(error, "__notes__", [])


def test_a_patched_tensor_method_torch_function_and_module_name_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    clamp = torch.Tensor.clamp
    monkeypatch.setattr(torch.Tensor, "clamp", lambda self, *a, **k: self)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.zeros(*a))
    import lightning_dp.privacy.noise as noise_module
    monkeypatch.setattr(noise_module, "torch", object())
    found = " | ".join(replaced_operations())
    assert "torch.Tensor.clamp" in found and "torch.randn" in found and "lightning_dp.privacy.noise" in found
    assert clamp is not torch.Tensor.clamp


def test_a_kernel_registered_through_torch_library_is_named() -> None:
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("normal_", lambda self, mean=0.0, std=1.0, *, generator=None: self.normal_(mean, std), "CPU")
        assert any("aten::normal_" in r for r in replaced_operations())
    finally:
        lib._destroy()
    assert not any("aten::normal_" in r for r in replaced_operations())


def test_a_fit_refused_under_a_patched_clamp_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """zoo36 T30: clipping's cap removed by a pass-through ``Tensor.clamp(max=...)``; the refusal's note names it."""
    clamp = torch.Tensor.clamp

    def loose(self: torch.Tensor, min: Any = None, max: Any = None) -> torch.Tensor:
        return self * 1.0 if max is not None and min is None else clamp(self, min=min, max=max)

    monkeypatch.setattr(torch.Tensor, "clamp", loose)
    model = Classifier()
    with pytest.raises(PrivacyConfigurationError) as refused:
        fit(model, steps=2, max_grad_norm=1e-3)
    notes = " ".join(getattr(refused.value, "__notes__", []))
    assert "replaced torch operations" in notes and "torch.Tensor.clamp (by " in notes and "loose" in notes
