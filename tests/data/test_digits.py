"""DigitsDataModule's validation split: a loader when asked for, otherwise none (and no warning)."""

from __future__ import annotations

import warnings

import pytest
from conftest import quiet_trainer

from lightning_dp.audit.canaries import CanaryDataModule
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN
from lightning_dp.strategy import DPStrategy

pytest.importorskip("sklearn")


def test_validation_split_sizes():
    data = DigitsDataModule(val_fraction=0.1)
    data.setup("fit")
    assert len(data.val_set) + len(data.train_set) == 1437 and len(data.val_set) == 144
    assert len(data.val_dataloader().dataset) == 144
    assert CanaryDataModule(data, canaries=None).val_dataloader() is not None


def test_no_split_means_no_validation_and_no_empty_loader_warning():
    data = DigitsDataModule(val_fraction=0.0)
    assert data.val_dataloader is None
    assert CanaryDataModule(data, canaries=None).val_dataloader is None
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DigitsCNN(), datamodule=data)
    assert not [w for w in caught if "across ranks is zero" in str(w.message)]
    assert trainer.global_step == 2 and not trainer.enable_validation
