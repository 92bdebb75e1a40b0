"""A user's callback with hooks that see no batch trains under FSDP2 (2 CPU processes).

The judge of those hooks (setup, on_fit_start, on_train_start, on_train_epoch_start) replays them with the engine set
aside (validators/step_checks.engine_aside); re-attaching the engine to the sharded model there mapped it to the
parameters FSDP2 held at that moment and the first release failed in the engine ("mixed torch.Tensor and DTensor"):
every such callback crashed a DPShardedStrategy fit. Under FSDP2 the engine now stays attached through the replays."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
from sharded_helpers import ShardedTransformer, loader, token_data

from lightning_dp import DPShardedStrategy


class Quiet(pl.Callback):
    """Hooks that see no batch and keep nothing."""

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.stage = stage

    def on_fit_start(self, *args: Any) -> None:
        pass

    def on_train_start(self, *args: Any) -> None:
        pass

    def on_train_epoch_start(self, *args: Any) -> None:
        pass


def test_a_callback_with_hooks_that_see_no_batch_trains_sharded() -> None:
    strategy = DPShardedStrategy(start_method="fork", timeout=timedelta(seconds=30), noise_multiplier=1.0,
                                 max_grad_norm=0.05, sampler_seed=3)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Quiet()])
    trainer.fit(ShardedTransformer(), loader(token_data(48, 17, 5), 6))
    assert strategy.ledger.steps == 2
