"""An epoch ended by ``on_train_batch_start`` returning -1 (validators/epoch_ends.py; rule 3 of
docs/release_boundary.md): decided from the batch — even before any release — it is refused as it is returned
(zoo35 R17, X17, X17b); an end at a public place trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

ENDED = "on_train_batch_start returned -1"


class EndsEpochs(Classifier):
    """Ends an epoch at its first batch when the batch's positive rate is above 0.3 (``"data"``, in the first epoch
    only: ``"data-first-epoch"``), or at its third batch whatever it holds (``"place"``)."""

    def __init__(self, rule: str) -> None:
        super().__init__()
        self.rule = rule

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        if self.rule == "place":
            return -1 if batch_idx == 2 else None
        if self.rule == "data-first-epoch" and self.current_epoch > 0:
            return None
        if batch_idx == 0 and float(batch[1].float().mean()) > 0.3:
            return -1
        return None


def _fit(model: Classifier) -> Any:
    trainer = quiet_trainer(strategy=strategy(), max_epochs=2)
    trainer.fit(model, loader(64, batch_size=16))
    return trainer


@pytest.mark.parametrize("rule", ["data", "data-first-epoch"])
def test_an_epoch_ended_from_the_batch_is_refused_before_anything_is_released(rule: str) -> None:
    model = EndsEpochs(rule)
    with pytest.raises(PrivacyConfigurationError, match=ENDED):
        _fit(model)
    assert model.trainer.global_step == 0


def test_an_epoch_ended_at_a_public_place_trains() -> None:
    trainer = _fit(EndsEpochs("place"))
    assert trainer.global_step == 4  # two batches in each of two epochs
