"""Evaluation of the training records outside a fit (lightning_dp/validators/evaluated_records.py): validate, test or
predict under a private strategy on a loader over the training population of a fit the strategy or the module made
is un-noised output of the private data (zoo20 h1: the next fit's learning rate chosen from it); held-out data, a
disjoint split of the same dataset and a declared report evaluate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError


class Evaluated(TinyClassifier):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1], reduction="none")


def _data(seed: int = 0, n: int = 96) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long())


def _fitted(dataset=None, **strategy):
    module = Evaluated()
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **strategy), max_steps=2)
    trainer.fit(module, DataLoader(dataset if dataset is not None else _data(), batch_size=16))
    return module, trainer


def _evaluate(trainer, module, stage: str, dataset) -> None:
    loader = DataLoader(dataset, batch_size=16)
    if stage == "predict":
        trainer.predict(module, loader)
    else:
        getattr(trainer, stage)(module, loader, verbose=False)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_the_training_records_evaluated_after_the_fit_are_refused(stage):
    """Same trainer, a copy of the training tensors in other memory (what h1 did)."""
    module, trainer = _fitted()
    with pytest.raises(PrivacyConfigurationError, match=rf"trainer.{stage}\(...\).*Evaluate on held-out data.*"
                                                        rf"public_state=\['trainer.{stage}'\]"):
        _evaluate(trainer, module, stage, _data())


def test_a_new_private_trainer_on_the_fitted_module_is_refused_too():
    data = _data()
    module, _ = _fitted(data)
    fresh = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0))
    with pytest.raises(PrivacyConfigurationError, match="training records of a private fit"):
        _evaluate(fresh, module, "validate", torch.utils.data.Subset(data, range(40)))


def test_held_out_data_a_disjoint_split_and_a_declared_report_evaluate():
    """The neighbours: held-out records (same trainer and a new one), the other part of a random_split of the
    training dataset, the training records under public_state=['trainer.validate'], and a module never trained
    privately; the next fit then trains."""
    train, held = random_split(_data(n=160), [96, 64], generator=torch.Generator().manual_seed(0))
    module, trainer = _fitted(train)
    for stage in ("validate", "test", "predict"):
        _evaluate(trainer, module, stage, _data(seed=1))
        _evaluate(trainer, module, stage, held)
    fresh = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0))
    _evaluate(fresh, module, "predict", held)
    _evaluate(fresh, Evaluated(), "validate", train)  # a module no private fit trained
    declared, declared_trainer = _fitted(public_state=["trainer.validate"])
    _evaluate(declared_trainer, declared, "validate", _data())
    again = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2)
    again.fit(module, DataLoader(train, batch_size=16))
    assert again.strategy.ledger.steps >= 2
