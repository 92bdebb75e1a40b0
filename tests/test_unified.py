"""The unified `lightning` package: `import lightning as L` users train privately via lightning_dp.unified."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")


class UnifiedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    x = torch.randn(100, 4)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=10)


def _trainer(strategy, callbacks=()):
    return L.Trainer(strategy=strategy, max_epochs=2, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))


def test_unified_trainer_trains_privately_with_strategy_and_callbacks():
    from lightning_dp.unified import AdamVariant, DPStrategy, PrivacyBudget

    strategy = DPStrategy(noise_multiplier=1.0)
    trainer = _trainer(strategy, [PrivacyBudget(target_epsilon=10.0, delta=1e-5), AdamVariant("bias_corrected")])
    trainer.fit(UnifiedModule(), _loader())
    assert strategy.ledger.steps == 20
    assert isinstance(strategy, L.pytorch.strategies.Strategy)
    assert float(trainer.callback_metrics["privacy/epsilon"]) > 0


def test_both_namespaces_live_side_by_side():
    import pytorch_lightning as pl

    import lightning_dp
    from lightning_dp import unified

    assert isinstance(lightning_dp.DPStrategy(noise_multiplier=1.0), pl.strategies.Strategy)
    assert not isinstance(unified.DPStrategy(noise_multiplier=1.0), pl.strategies.Strategy)
    assert unified.PrivacyBudget is not lightning_dp.PrivacyBudget
    for name in unified.__all__:  # every callback of the unified build is a lightning.pytorch one
        cls = getattr(unified, name)
        if issubclass(cls, L.Callback) or issubclass(cls, pl.Callback):
            assert issubclass(cls, L.Callback) and not issubclass(cls, pl.Callback), name
    assert "PublicPretraining" in unified.__all__


def test_the_wrong_namespace_error_names_the_import_that_fixes_it():
    import lightning_dp

    with pytest.raises(ValueError, match="lightning_dp.unified.DPStrategy"):
        _trainer(lightning_dp.DPStrategy(noise_multiplier=1.0))
