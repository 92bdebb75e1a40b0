"""User-level DP and adaptive clipping on 2 CPU processes (gloo), issue #39: users are sharded across ranks whole,
the update equals one process's, and the adaptive bound (its count all-reduced) is the same on every rank."""

from __future__ import annotations

from datetime import timedelta

import pytorch_lightning as pl
import torch
from ddp_helpers import RankRecorder, SeededClassifier, ZeroNoise, classification_data, flat_params, load_records, loader

from lightning_dp import AdaptiveClipping, DPStrategy, Users

WORLD = 2
OBSERVER = ["RankRecorder"]


def _trainer(strategy, devices, out_dir=None, **kwargs) -> pl.Trainer:
    callbacks = [RankRecorder(out_dir)] if out_dir is not None else []
    return pl.Trainer(strategy=strategy, callbacks=callbacks, accelerator="cpu", devices=devices, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **kwargs)


def _users(n: int) -> list[int]:
    return [i // 3 for i in range(n)]  # users of 3 records


def test_users_under_ddp_give_the_single_process_update(tmp_path):
    """q = 1, zero noise: each rank clips its own users, and the update is one process's."""
    n, steps, C = 24, 2, 0.3
    data = classification_data(n)
    strategy = DPStrategy(start_method="fork", timeout=timedelta(seconds=30), public_state=OBSERVER,
                          noise_multiplier=1.0, max_grad_norm=C, noise=ZeroNoise(),
                          privacy_unit=Users(_users(n), users_per_batch=8))
    _trainer(strategy, WORLD, tmp_path, max_steps=steps).fit(SeededClassifier(seed=1), loader(data, 5))
    records = load_records(tmp_path, WORLD)
    assert torch.equal(records[0]["end"], records[1]["end"])
    assert [sum(r["batch_sizes"]) for r in records] == [12 * steps, 12 * steps]  # 4 whole users per rank per step
    single = SeededClassifier(seed=1)
    reference = DPStrategy(noise_multiplier=1.0, max_grad_norm=C, noise=ZeroNoise(), public_state=OBSERVER,
                           privacy_unit=Users(_users(n), users_per_batch=8))
    _trainer(reference, 1, max_steps=steps).fit(single, loader(data, 5))
    torch.testing.assert_close(records[0]["end"], flat_params(single), rtol=0, atol=1e-6)


def test_the_adaptive_bound_is_the_same_on_every_rank(tmp_path):
    n = 48
    data = classification_data(n)
    strategy = DPStrategy(start_method="fork", timeout=timedelta(seconds=30), public_state=OBSERVER,
                          noise_multiplier=1.0, clipping=AdaptiveClipping(initial_norm=5.0), sampler_seed=0,
                          privacy_unit=Users(_users(n), users_per_batch=8))
    _trainer(strategy, WORLD, tmp_path, max_steps=4).fit(SeededClassifier(seed=1), loader(data, 5))
    records = load_records(tmp_path, WORLD)
    assert records[0]["max_grad_norm"] == records[1]["max_grad_norm"] != 5.0  # one all-reduced count per step
    assert torch.equal(records[0]["end"], records[1]["end"])
