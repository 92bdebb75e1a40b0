"""A refused noise raises on every rank, promptly, where each rank noises its own part (release_reduce.raise_together),
on 2 CPU processes: FSDP2 (each rank noises the rows it owns after the reduce-scatter, sharding/privatizer.py) and
DP-SignSGD's vote (each worker noises its own sum before the vote, sign_sgd/privatizer.py).

When one rank's noise is refused (lightning_dp/sealed_noise.py: its mechanism's draw replaced on that rank alone) the
refusal's flag is summed across the ranks and every rank raises — before, the refusing rank raised alone and its peer
waited in the next collective until the process group's timeout. The same runs with their noise train
(tests/test_sharded_strategy.py, tests/test_ddp.py). Under DDP's noised mean: tests/test_ddp_noise_missing.py."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data, errors_recorded
from sharded_helpers import ShardedTransformer, loader, token_data
from torch.utils.data import DataLoader

from lightning_dp import DPShardedStrategy, DPStrategy
from lightning_dp.privacy.noise import GaussianNoise

WORLD = 2
TIMEOUT = timedelta(seconds=20)  # a rank left waiting in a collective fails the test by this timeout, not a hang


def _zeros(self: GaussianNoise, plan: Any, std: float) -> Any:
    """The mechanism's draws made zeros."""
    return (torch.zeros(draw.size, dtype=draw.dtype) for draw, _ in plan)


class EmptiedOnRankOne(pl.Callback):
    """Replaces the mechanism's draw on rank 1 only, as training starts (after the first step's checks)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 1:
            GaussianNoise._drawn_now = _zeros  # (a forked worker's own class: the test's is untouched)


class EmptiedOnShardOne(GaussianNoise):
    """Replaces the mechanism's draw on rank 1 only, when the sharded release splits the noise per rank (a callback
    would do under DDP; under FSDP2 one with ``on_train_start`` meets another problem: the closing note's)."""

    def for_rank(self, rank: int) -> GaussianNoise:
        if rank == 1:
            GaussianNoise._drawn_now = _zeros  # (a forked worker's own class: the test's is untouched)
        return super().for_rank(rank)


class Voting(SeededClassifier):
    """The seeded classifier trained with DP-SignSGD (the strategy's sign-vote mode)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_dp.optim import DPSignSGD

        return DPSignSGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(classification_data(120), batch_size=10)


def _fit(strategy_cls: type, out: Path, module: pl.LightningModule, *loaders: DataLoader,
         callbacks: tuple[pl.Callback, ...] = (), **settings: Any) -> None:
    recorded = errors_recorded(strategy_cls, out, methods=("optimizer_step",), exact_type=True)
    strategy = recorded(start_method="fork", timeout=TIMEOUT, noise_multiplier=1.0, max_grad_norm=0.05,
                        sampler_seed=3, **settings)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=list(callbacks))
    start = time.monotonic()
    with pytest.raises(Exception, match="missing from the release|changed after lightning_dp was imported"):
        trainer.fit(module, *loaders)
    errors = {r: (out / f"rank{r}.err").read_text() if (out / f"rank{r}.err").exists() else None for r in range(WORLD)}
    assert errors[1] is not None and errors[1].startswith("NoisePathReplacedError"), errors[1]  # rank 1's own
    assert errors[0] is not None and errors[0].startswith("NoiseMissingError"), errors[0]  # rank 0 told by the flag
    assert "GaussianNoise._drawn_now" in errors[1] and "on a rank that adds it" in errors[0]
    assert time.monotonic() - start < TIMEOUT.total_seconds()  # not the process group's timeout


@pytest.mark.usefixtures("without_data_ledger")
def test_sharded_noise_refused_on_one_rank_raises_on_every_rank_promptly(tmp_path: Path) -> None:
    _fit(DPShardedStrategy, tmp_path, ShardedTransformer(), loader(token_data(48, 17, 5), 6),
         noise=EmptiedOnShardOne(prefetch=False))


def test_a_workers_noise_refused_before_the_vote_raises_on_every_worker_promptly(tmp_path: Path) -> None:
    _fit(DPStrategy, tmp_path, Voting(), callbacks=(EmptiedOnRankOne(),))
