"""Data a step adds to an object of another library reached through the user's state (validators/kept_state.py;
fingerprints/state_walker.added_attributes): the training DataLoader held as a global of the user's code, the sampler
it holds, a loader kept as a module attribute — ``LOADER.center = batch[0].mean(0)`` read back by the next forward is
kept state, refused before any release. The library's own attributes are not read (a loader's iterator changes every
epoch), and what does not depend on the data (a batch counter, a constant set before the fit) still trains."""

from __future__ import annotations

from typing import Any

import sys
from pathlib import Path

import pytest
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

LOADER = DataLoader(data(64), batch_size=16)
"""The training loader, a module-level global of the user's code (as a script's ``DL = DataLoader(...)``)."""


def _owner(where: str) -> Any:
    return LOADER.sampler if where == "sampler" else LOADER


class CentresByTheLastBatch(Classifier):
    """Keeps the last batch's mean on the loader (or on its sampler) under ``name`` and centres the next inputs by it."""

    where, name = "loader", "center"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        center = getattr(_owner(self.where), self.name, None)
        return self.net(x - center if center is not None else x)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        setattr(_owner(self.where), self.name, batch[0].mean(0).detach().clone())


def _clean() -> None:
    for obj in (LOADER, LOADER.sampler):
        for key in ("center", "_center", "seen", "shift"):
            vars(obj).pop(key, None)


@pytest.mark.parametrize("where, name", [("loader", "center"), ("loader", "_center"), ("sampler", "center")])
def test_a_batch_statistic_kept_on_the_users_loader_is_refused_before_any_release(where, name):
    _clean()
    model = type("Centres", (CentresByTheLastBatch,), {"where": where, "name": name})()
    before = parameters(model)
    try:
        with pytest.raises(PrivacyConfigurationError, match=f"global {__name__}.LOADER"):
            quiet_trainer(strategy=strategy(), max_steps=3).fit(model, LOADER)
        assert unchanged(before, model)
    finally:
        _clean()


class CountsBatches(Classifier):
    """A batch counter and a constant shift kept on the loader: neither depends on the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - LOADER.shift)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        LOADER.seen = getattr(LOADER, "seen", 0) + 1


def test_a_counter_and_a_constant_kept_on_the_users_loader_train():
    _clean()
    LOADER.shift = torch.full((4,), 0.5)  # public: set before the fit, never written
    try:
        model = CountsBatches()
        before = parameters(model)
        quiet_trainer(strategy=strategy(), max_steps=3).fit(model, LOADER)
        assert LOADER.seen == 3  # the replays' increments put back: only the real steps counted
        assert not unchanged(before, model)
    finally:
        _clean()
