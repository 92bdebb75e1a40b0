"""Composition across fits (issue 34, class 6): the ledger travels with the module, never goes backwards,
and tuners that train on the private data are refused."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint
from pytorch_lightning.tuner import Tuner
from torch import nn

import lightning_dp._strategy_glue as strategy_module  # the strategies' shared hooks log from here
from lightning_dp import DPStrategy, PrivacyBudget, PrivacyConfigurationError
from lightning_dp.accounting import epsilon, ledger_epsilon

DELTA = 1e-5
Q = 0.1  # batch 10 of 100 examples: 10 steps per epoch


def _fit(module, steps, strategy=None, **kwargs):
    strategy = strategy or DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_steps=steps, **kwargs)
    trainer.fit(module, make_loader(n=100, batch_size=10))
    return trainer


@pytest.fixture
def said(monkeypatch):
    lines: list[str] = []  # the strategy's log lines (other tests may silence Lightning's loggers)
    monkeypatch.setattr(strategy_module, "rank_zero_info", lambda message, *a, **k: lines.append(message))
    return lines


def test_a_second_trainer_continues_the_modules_ledger(said):
    module = TinyClassifier()
    _fit(module, 10)
    budget = PrivacyBudget(delta=DELTA)
    second = _fit(module, 10, callbacks=[budget])
    assert second.strategy.ledger.steps == 20  # was 10: the second fit started again from ε = 0
    assert budget.epsilon == pytest.approx(epsilon(1.0, Q, 20, DELTA), rel=1e-9)
    assert sum("already made 10 private release(s)" in line for line in said) == 1


def test_a_target_counts_what_earlier_fits_spent():
    module = TinyClassifier()
    _fit(module, 10, strategy=DPStrategy(noise_multiplier=2.0))  # no target: spends ε = 0.94
    strategy = DPStrategy(target_epsilon=3.0, target_delta=DELTA, max_grad_norm=1.0)
    _fit(module, 20, strategy=strategy)
    assert strategy.ledger.steps == 30
    spent = ledger_epsilon(strategy.ledger, DELTA)
    assert 0.99 * 3.0 < spent <= 3.0  # σ calibrated for the 20 new steps after the 10 spent (was ε = 3.6)


def test_a_second_fit_at_the_same_target_is_refused_before_any_release():
    """The first fit spent its target; the same target again leaves only near-pure noise (σ ≈ 1,700)."""
    module = TinyClassifier()
    _fit(module, 10, strategy=DPStrategy(target_epsilon=2.0, target_delta=DELTA))
    again = DPStrategy(target_epsilon=2.0, target_delta=DELTA)
    with pytest.raises(PrivacyConfigurationError, match="near-pure noise") as error:
        _fit(module, 10, strategy=again)
    assert "target_epsilon=<larger>" in str(error.value) and "on_budget_short='recalibrate'" in str(error.value)
    assert again.ledger.steps == 10  # the first fit's, nothing more


def test_a_module_past_a_lower_target_is_refused_whatever_on_budget_short_says():
    module = TinyClassifier()
    _fit(module, 10, strategy=DPStrategy(target_epsilon=2.0, target_delta=DELTA))
    lower = DPStrategy(target_epsilon=1.0, target_delta=DELTA, on_budget_short="recalibrate")
    with pytest.raises(PrivacyConfigurationError, match="budget is spent"):
        _fit(module, 10, strategy=lower)
    assert lower.ledger.steps == 10


def _two_epochs_with_checkpoints(module, tmp_path):
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2,
                            enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")])
    trainer.fit(module, make_loader(n=100, batch_size=10))
    return trainer, str(tmp_path / "epoch=0.ckpt")


def test_restoring_an_earlier_checkpoint_in_a_new_trainer_keeps_the_longer_record(tmp_path, said):
    module = TinyClassifier()
    _, first_epoch = _two_epochs_with_checkpoints(module, tmp_path)  # 20 releases; the checkpoint holds 10
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=strategy, max_epochs=2).fit(module, make_loader(n=100, batch_size=10),
                                                       ckpt_path=first_epoch)
    assert strategy.ledger.steps == 30  # 20 made on this module, then 10 more from the restored step 10
    assert sum("the longer record is kept" in line for line in said) == 1


def test_restoring_an_earlier_checkpoint_in_the_same_trainer_never_goes_backwards(tmp_path, said):
    module = TinyClassifier()
    trainer, first_epoch = _two_epochs_with_checkpoints(module, tmp_path)
    trainer.fit(module, make_loader(n=100, batch_size=10), ckpt_path=first_epoch)
    assert trainer.strategy.ledger.steps == 30  # was 20: the restore replaced the ledger by the checkpoint's 10
    assert sum("the longer is kept" in line for line in said) == 1


class _Wrapper(pl.LightningModule):
    """A new model around an already trained one (fine-tuning a privately trained backbone)."""

    def __init__(self, inner: TinyClassifier) -> None:
        super().__init__()
        self.inner, self.head = inner, nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.inner(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_built_around_a_trained_module_continues_its_record():
    inner = TinyClassifier()
    _fit(inner, 5)
    outer = _fit(_Wrapper(inner), 5)
    assert outer.strategy.ledger.steps == 10
    assert _fit(inner, 5).strategy.ledger.steps == 15  # and the part alone sees the wrapper's releases


def _lr_find(module, loader, trainer):
    Tuner(trainer).lr_find(module, train_dataloaders=loader, num_training=5)


def _scale_batch_size(module, loader, trainer):
    Tuner(trainer).scale_batch_size(module, train_dataloaders=loader)


def _callback(kind):
    def run(module, loader, trainer):
        trainer.callbacks.append(kind())
        trainer.fit(module, loader)
    return run


@pytest.mark.parametrize("tune", [_lr_find, _callback(LearningRateFinder), _callback(BatchSizeFinder)],
                         ids=["Tuner.lr_find", "LearningRateFinder", "BatchSizeFinder"])
def test_tuners_on_the_private_data_are_refused_before_any_release(tune, tmp_path):
    module, strategy = TinyClassifier(), DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_steps=5, default_root_dir=tmp_path)
    with pytest.raises(PrivacyConfigurationError, match="Tune on public data") as error:
        tune(module, make_loader(n=100, batch_size=10), trainer)
    assert "un-noised losses" in str(error.value)
    assert strategy.ledger.steps == 0


def test_tuner_scale_batch_size_is_refused_by_lightning_before_any_release(tmp_path):
    """Pins Lightning's own refusal (``Tuner.scale_batch_size`` with any DDP-family strategy, before ``fit``):
    passes on the code before this change too; it fails if an upgrade lifts the refusal, and then the
    BatchSizeFinder the Tuner adds meets the refusal tested above."""
    module, strategy = TinyClassifier(), DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_steps=5, default_root_dir=tmp_path)
    with pytest.raises((ValueError, PrivacyConfigurationError)):
        _scale_batch_size(module, make_loader(n=100, batch_size=10), trainer)
    assert strategy.ledger.steps == 0


def test_the_unified_packages_lr_finder_is_refused_too(tmp_path):
    """``import lightning as L``: the refusal checks lightning.pytorch's LearningRateFinder, not only
    pytorch_lightning's (lightning_dp.unified re-runs the glue against the unified namespace)."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.tuner import Tuner as UnifiedTuner

    from lightning_dp.unified import DPStrategy as UnifiedDPStrategy

    class Unified(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.lr = nn.Linear(4, 2), 0.1

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    strategy = UnifiedDPStrategy(noise_multiplier=1.0)
    trainer = L.Trainer(strategy=strategy, max_steps=5, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(Exception, match="Tune on public data"):
        UnifiedTuner(trainer).lr_find(Unified(), train_dataloaders=make_loader(n=100, batch_size=10), num_training=5)
    assert strategy.ledger.steps == 0
