"""The noise a release adds is checked where it is added (lightning_dp/validators/noise_added.py, zoo36 T27–T31):
a draw emptied or shrunk without a torch mode — a patched ``torch.Tensor.normal_``, ``torch.empty``, the noise
module's ``torch`` name, the multi-tensor add — is refused before the optimizer steps; legitimate draws of every
library mechanism pass (large signals, scale_by, empty and bfloat16 tensors, banded noise)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters  # noqa: E402

import lightning_dp.privacy.noise as noise_module  # noqa: E402
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise  # noqa: E402
from lightning_dp.privacy.csprng import SecureGaussianNoise  # noqa: E402
from lightning_dp.privacy.noise import GaussianNoise  # noqa: E402
from lightning_dp.validators.noise_added import NoiseMissingError, chi2_floor, libraries_noise  # noqa: E402

_NORMAL = torch.Tensor.normal_


def _quiet(factor: float) -> Any:
    """``Tensor.normal_`` drawing ``factor`` × the asked standard deviation when a generator is given."""
    def normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> torch.Tensor:
        if generator is None:
            return _NORMAL(self, mean, std)
        return _NORMAL(self, mean, std * factor, generator=generator) if factor else self.zero_()
    return normal_


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3 for s in [(300, 400), (8,), (1,), (0,), (40, 25), (200_000,)]]


@pytest.mark.parametrize("factor", [0.0, 1e-3])
def test_a_draw_emptied_by_a_patched_normal_is_refused(monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    monkeypatch.setattr(torch.Tensor, "normal_", _quiet(factor))
    with pytest.raises(NoiseMissingError, match="missing from the release"):
        GaussianNoise(seed=0, prefetch=False).add_noise_(_tensors(), 0.5, scale_by=1 / 64)


def test_noise_shrunk_on_a_large_tensor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "normal_", _quiet(0.8))  # a fifth of the noise gone
    with pytest.raises(NoiseMissingError, match="tensor 0, 4096 numbers read"):
        GaussianNoise(seed=0, prefetch=False).add_noise_([torch.zeros(200_000)], 1.0)


def test_a_patched_multi_tensor_add_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw right, its addition to the small tensors skipped."""
    monkeypatch.setattr(torch, "_foreach_add_", lambda tensors, others: None)
    with pytest.raises(NoiseMissingError):
        GaussianNoise(seed=0, prefetch=False).add_noise_([torch.zeros(5) for _ in range(12)], 1.0)


def test_the_noise_modules_torch_replaced_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """zoo36 T29: the module's ``torch`` name a proxy whose empty tensors draw zeros."""
    class Zeros(torch.Tensor):
        def normal_(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self.zero_()

    class Proxy:
        def __getattr__(self, name: str) -> Any:
            if name == "empty":
                return lambda *a, **k: torch.empty(*a, **k).as_subclass(Zeros)
            return getattr(torch, name)

    monkeypatch.setattr(noise_module, "torch", Proxy())
    with pytest.raises(NoiseMissingError):
        GaussianNoise(seed=0, prefetch=False).add_noise_([torch.zeros(1000)], 1.0)


def test_a_fit_with_a_patched_draw_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Classifier()
    before = parameters(model)
    monkeypatch.setattr(torch.Tensor, "normal_", _quiet(0.0))
    with pytest.raises(NoiseMissingError):
        fit(model, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(model)))  # the optimizer never stepped
    assert model.trainer.strategy.private_step.ledger.steps == 0


@pytest.mark.parametrize("make", [lambda: GaussianNoise(seed=1, prefetch=False), lambda: GaussianNoise(seed=2),
                                  lambda: SecureGaussianNoise(), lambda: BandedToeplitzNoise(3, seed=4)],
                         ids=["gaussian", "prefetched", "secure", "banded"])
def test_legitimate_draws_pass(make: Any) -> None:
    """Every library mechanism, many releases: large signals beside the noise, scale_by, empty and bfloat16 tensors."""
    mechanism = make()
    for step in range(15):
        tensors = _tensors(step) + [torch.randn(64, dtype=torch.bfloat16) * 50]
        with mechanism.step():
            mechanism.add_noise_(tensors, 0.05 if step % 2 else 3.0, scale_by=1 / 256 if step % 3 else 1.0)


def test_a_mechanism_of_yours_is_yours() -> None:
    class Zero(GaussianNoise):
        def sample(self, like: Any) -> list[torch.Tensor]:
            return [torch.zeros_like(t) for t in like]

    assert libraries_noise(GaussianNoise) and not libraries_noise(Zero)
    t = torch.ones(10)
    Zero(seed=0).add_noise_([t], 1.0)  # a scripted noise of a test: not checked
    assert torch.equal(t, torch.ones(10))


def test_the_floor_bounds_the_chance_of_a_false_refusal() -> None:
    """P(χ²_n ≤ floor) ≤ 1e-12 (Chernoff), and the floor sits well above zero for n ≥ 8."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 8, 100, 4096):
        floor = chi2_floor(n)
        draws = torch.randn(20_000, n, generator=g, dtype=torch.float64).pow(2).sum(1)
        assert (draws <= floor).sum() == 0 and 0 <= floor < n
    assert chi2_floor(8) > 1e-3 and chi2_floor(4096) > 0.8 * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_below_the_values_float_resolution_is_not_refused(dtype: torch.dtype) -> None:
    """A fresh-clone CI's false refusal: σ = 1e-6 on a bias's two summed gradients near 16 (one float32 ulp is
    1.9e-6) read back as zeros about one release in six; the rounding's bound is credited, the draws pass."""
    mechanism = GaussianNoise(seed=3, prefetch=False)
    for step in range(300):
        with mechanism.step():
            mechanism.add_noise_([torch.full((2,), 16.0, dtype=dtype), torch.full((5,), -9.0, dtype=dtype)], 1e-6)


def test_noise_missing_where_the_resolution_would_show_it_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rounding's credit is a few ulps of the values: noise about 80 ulps wide shrunk to a tenth is refused."""
    monkeypatch.setattr(torch.Tensor, "normal_", _quiet(0.1))
    with pytest.raises(NoiseMissingError):
        GaussianNoise(seed=0, prefetch=False).add_noise_([torch.full((64,), 1.0)], 1e-5)
