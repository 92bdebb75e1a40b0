"""What a method made in a closure keeps (fingerprints/state_walker.class_attributes, ``method_cells``): the contents
of its closure's cells are compared as ``class attribute Class.f.__closure__``. The entry used to be the method's
``__defaults__`` with ``((), {})`` in place of the closure, so a dict of the maker's, written from the batch at a
batch's end and read by the next forward, was never compared and trained."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.checksums import Checksums  # noqa: E402
from lightning_dp.fingerprints.state_walker import Walker, class_attributes  # noqa: E402


def _shift_methods():
    kept = {"shift": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - kept["shift"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        kept["shift"] = float(batch[0].mean())  # a statistic of the batch, read by every later forward

    return forward, on_train_batch_end


class ClosureDict(Classifier):
    forward, on_train_batch_end = _shift_methods()


def _nonlocal_methods():
    shift = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - shift)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        nonlocal shift
        shift = float(batch[0].mean())  # the cell rebound, not a container written

    return forward, on_train_batch_end


class ClosureRebound(Classifier):
    forward, on_train_batch_end = _nonlocal_methods()


def _scaled_forward(scale: float):
    settings = {"scale": scale}  # a constant of the maker's, never written

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * settings["scale"])

    return forward


class ClosureConstant(Classifier):
    forward = _scaled_forward(0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx)  # (a `__class__` cell: the class, not data)


def _token(cls: type, key: str):
    walker = Walker(set(), set(), Checksums(), full=True)
    return [walker.named(k, v) for c, k, v in class_attributes([cls]) if k == key]


def test_the_closure_of_a_method_is_an_entry_compared_by_its_contents():
    entries = {key: value for _, key, value in class_attributes([ClosureDict])}
    assert "forward.__closure__" in entries and "forward.__defaults__" not in entries
    before = _token(ClosureDict, "forward.__closure__")
    ClosureDict.on_train_batch_end(None, None, (torch.ones(2, 4), None), 0)
    try:
        assert _token(ClosureDict, "forward.__closure__") != before
    finally:
        ClosureDict.on_train_batch_end(None, None, (torch.zeros(2, 4), None), 0)


@pytest.mark.parametrize("model", [ClosureDict, ClosureRebound])
def test_a_batch_statistic_kept_in_a_methods_closure_is_refused_before_any_release(model):
    torch.manual_seed(0)
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=r"class attribute \S*\.(forward|on_train_batch_end)"
                                                        r"\.__closure__"):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_constant_in_a_methods_closure_and_super_train():
    torch.manual_seed(0)
    entries = {key for _, key, _ in class_attributes([ClosureConstant])}
    assert "forward.__closure__" in entries and "training_step.__closure__" not in entries
    fit(ClosureConstant(), steps=3)
