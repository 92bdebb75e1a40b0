"""A refused noise under DDP raises on every rank, promptly (release_reduce.py), on 2 CPU processes (gloo).

Rank 0 adds the noise to its clipped sums before every rank sums them; when its noise check refuses the release
(sealed_noise.py: the mechanism's draw replaced on that rank alone), the refusal rides on the sum as a
flag and every rank raises — rank 0 its own, the others :class:`NoiseMissingError` naming it; before, rank 0 raised
alone and rank 1 waited in the sum until the process group's timeout. The same run without the patch trains
(tests/test_ddp.py)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data, errors_recorded
from torch.utils.data import DataLoader

from lightning_dp import DPStrategy
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.release_reduce import reduce_after_noise
from lightning_dp.validators.noise_added import NoiseMissingError

WORLD = 2
TIMEOUT = timedelta(seconds=20)  # a rank left waiting in the sum fails the test by this timeout instead of hanging
DATA = classification_data(120)


def _zeros(self: GaussianNoise, plan: Any, std: float) -> Any:
    """The mechanism's draws made zeros."""
    return (torch.zeros(draw.size, dtype=draw.dtype) for draw, _ in plan)


class EmptiedOnRankZero(pl.Callback):
    """Replaces the mechanism's draw on rank 0 only, as training starts (after the probe's checks)."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.on and trainer.global_rank == 0:
            GaussianNoise._drawn_now = _zeros  # (a forked worker's own class: the test's is untouched)


class Loaded(SeededClassifier):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(DATA, batch_size=10)


def _fit(tmp_path: Path, emptied: bool) -> DPStrategy:
    recorded = errors_recorded(DPStrategy, tmp_path, methods=("optimizer_step",), exact_type=True)
    strategy = recorded(start_method="fork", timeout=TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[EmptiedOnRankZero(emptied)])
    trainer.fit(Loaded())
    return strategy


def test_noise_emptied_on_the_noising_rank_is_refused_on_every_rank_promptly(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match="missing from the release|changed after lightning_dp was imported"):
        _fit(tmp_path, emptied=True)
    errors = {r: (tmp_path / f"rank{r}.err").read_text() if (tmp_path / f"rank{r}.err").exists() else None
              for r in range(WORLD)}
    assert errors[0] is not None and errors[0].startswith("NoisePathReplacedError"), errors[0]  # rank 0's own
    assert errors[1] is not None and errors[1].startswith("NoiseMissingError"), errors[1]  # rank 1's naming it
    assert "GaussianNoise._drawn_now" in errors[0] and "on a rank that adds it" in errors[1]
    written = [(tmp_path / f"rank{r}.err").stat().st_mtime for r in range(WORLD)]
    assert abs(written[1] - written[0]) < 5  # rank 1 at once, not when rank 0's process ended (it waits 15 s)
    assert time.monotonic() - start < TIMEOUT.total_seconds()  # not the process group's timeout


def test_the_same_run_with_its_noise_trains_on_every_rank(tmp_path: Path) -> None:
    assert _fit(tmp_path, emptied=False).ledger.steps == 2
    assert not list(tmp_path.glob("rank*.err"))


def test_the_refusing_rank_sends_no_sums_and_its_peer_raises_from_the_flag() -> None:
    """Without processes: the refusing rank's sums go to the sum zeroed, with the flag 1; a rank whose noise passed
    raises when the sum carries another rank's flag."""
    sent: list[torch.Tensor] = []

    def refused() -> None:
        raise NoiseMissingError("The noise the mechanism was asked to add is missing from the release (tensor 0)")

    sums = [torch.ones(3), torch.full((2, 2), 5.0)]
    with pytest.raises(NoiseMissingError, match=r"\(tensor 0\)"):
        reduce_after_noise(refused, lambda ts: sent.extend(t.clone() for t in ts), sums)
    assert [t.tolist() for t in sent] == [[0.0] * 3, [[0.0] * 2] * 2, [1.0]]

    def peer_flagged(ts: list[torch.Tensor]) -> None:
        ts[-1] += 1  # rank 0's flag, summed in

    with pytest.raises(NoiseMissingError, match="on a rank that adds it"):
        reduce_after_noise(lambda: None, peer_flagged, [torch.ones(3)])
    clean = [torch.ones(3)]
    reduce_after_noise(lambda: None, lambda ts: None, clean)  # no rank refused: the sums as they were
    assert clean[0].tolist() == [1.0] * 3
