"""One mechanism on every rank (validators/rank_agreement.py), on 2 CPU processes (gloo).

Each rank clips and samples its own shard while the noise and the ledger are one rank's: a rank with its own C, its
own loader batch size (q), its own training population or its own partition into users breaks the guarantee the
ledger reports. Each is refused on every rank alike (each rank's own error is recorded: none is left waiting in a
collective), and a run whose ranks agree trains (tests/test_ddp.py).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data
from sharded_helpers import ShardedTransformer, token_data
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from lightning_dp import DPShardedStrategy, DPStrategy, Users
from lightning_dp.validators import rank_agreement
from lightning_dp.validators.step_checks import StepChecks

WORLD = 2
TIMEOUT = timedelta(seconds=15)  # a rank left waiting in a collective fails the test fast instead of hanging
REFUSED = "The ranks do not run the same mechanism"


def _recorded(out_dir: Path, base: type = DPStrategy, wait_s: float = 20.0) -> type:
    """``base`` (DPStrategy) whose loader setup and ``training_step`` write the error they raise to
    ``<out_dir>/rank<r>.err``; rank 0 waits for the other ranks' files before it raises, so the launcher does not end
    a rank about to raise too (a rank stuck in a collective never writes one)."""

    def recording(method: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as err:
                Path(out_dir, f"rank{self.global_rank}.err").write_text(f"{type(err).__name__}\n{err}")
                deadline = time.monotonic() + wait_s
                while self.global_rank == 0 and time.monotonic() < deadline \
                        and len(list(Path(out_dir).glob("rank*.err"))) < WORLD:
                    time.sleep(0.1)
                raise

        return run

    return type("Recorded", (base,), {"process_dataloader": recording(base.process_dataloader),
                                      "training_step": recording(base.training_step)})


class ClipOnRankOne(pl.Callback):
    """Rank 1 alone clips at 100 (set in ``setup``, before the loader, or in ``on_train_start``, after it)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        if self.hook == "setup" and trainer.global_rank == 1:
            trainer.strategy.private_step.max_grad_norm = 100.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.hook == "train_start" and trainer.global_rank == 1:
            trainer.strategy.private_step.max_grad_norm = 100.0


DATA = classification_data(120)


class PerRankLoader(SeededClassifier):
    """The loader's batch size, population or user ids chosen per rank (``mode``), or alike (``"same"``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def train_dataloader(self) -> DataLoader:
        rank = self.global_rank
        if self.mode == "batch":  # "what fits on this device"
            return DataLoader(DATA, batch_size=10 + 2 * rank)
        if self.mode in ("subset", "same_subset"):  # a train/held-out split drawn per rank, or alike
            seed = 3 + (rank if self.mode == "subset" else 0)
            order = torch.randperm(len(DATA), generator=torch.Generator().manual_seed(seed))[:90].tolist()
            return DataLoader(DATA, batch_size=10, sampler=SubsetRandomSampler(order))
        if self.mode == "users":  # users of 3 records, grouped differently per rank (same number of users)
            dataset = Grouped(*DATA.tensors)
            dataset.user_ids = [((i + rank) % len(DATA)) // 3 for i in range(len(DATA))]
            return DataLoader(dataset, batch_size=10)
        return DataLoader(DATA, batch_size=10)


class Grouped(TensorDataset):
    """A TensorDataset with a ``user_ids`` attribute (set per rank by :class:`PerRankLoader`)."""

    user_ids: list[int]


def _fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[Any] = (), steps: int = 3,
         base: type = DPStrategy, **kwargs) -> DPStrategy:
    strategy = _recorded(tmp_path, base)(start_method="fork", timeout=TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0, **kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(model)
    return strategy


def _recording_agreement(out_dir: Path, wait_s: float = 20.0) -> Any:
    """``StepChecks.on_every_rank`` writing the refusal it raises to ``<out_dir>/rank<r>.err`` (as :func:`_recorded`):
    the σ/C terms ride on every one of its all-reduces, so a disagreement may surface in a callback's check (the
    decision windows' at a step's start) rather than in the strategy's own methods. Patched before the fork."""
    original = StepChecks.on_every_rank

    def on_every_rank(self: Any, check: Any, what: str) -> None:
        try:
            original(self, check, what)
        except Exception as err:
            rank = self.distribution.rank
            Path(out_dir, f"rank{rank}.err").write_text(f"{type(err).__name__}\n{err}")
            deadline = time.monotonic() + wait_s
            while rank == 0 and time.monotonic() < deadline and len(list(Path(out_dir).glob("rank*.err"))) < WORLD:
                time.sleep(0.1)
            raise

    return mock.patch.object(StepChecks, "on_every_rank", on_every_rank)


def _refused_on_every_rank(tmp_path: Path, model: pl.LightningModule, *names: str, **kwargs) -> dict[int, str]:
    start = time.monotonic()
    with pytest.raises(Exception, match=REFUSED), _recording_agreement(tmp_path):
        _fit(tmp_path, model, **kwargs)
    errors = {r: (tmp_path / f"rank{r}.err").read_text() if (tmp_path / f"rank{r}.err").exists() else None
              for r in range(WORLD)}
    for rank, error in errors.items():
        assert error is not None and error.startswith("PrivacyConfigurationError") and REFUSED in error, (rank, error)
        for name in names:
            assert name in error, (rank, name, error)
    assert time.monotonic() - start < 60
    return errors


def test_a_clipping_bound_of_one_rank_is_refused_on_every_rank(tmp_path):
    """zoo14 d1 clip: rank 1 clips at 100·C while rank 0 adds σ·C: refused when the loader is set up."""
    errors = _refused_on_every_rank(tmp_path, PerRankLoader("same"), "max_grad_norm C: rank 0 1, rank 1 100",
                                    callbacks=[ClipOnRankOne("setup")])
    assert "when the training loader was set up" in errors[1]


def test_a_clipping_bound_changed_on_one_rank_after_the_loader_is_refused_at_the_release(tmp_path):
    """C set on rank 1 after the loader's check (``on_train_start``): the release's all-reduce compares σ and C."""
    errors = _refused_on_every_rank(tmp_path, PerRankLoader("same"), "max_grad_norm C",
                                    callbacks=[ClipOnRankOne("train_start")])
    assert "compared at every release" in errors[0]


def test_a_batch_size_of_one_rank_is_refused_on_every_rank(tmp_path):
    """zoo14 d1 batch: the loader's batch size chosen per rank sets q per rank; the ledger charges rank 0's."""
    _refused_on_every_rank(tmp_path, PerRankLoader("batch"), "sample rate q: rank 0 0.166667, rank 1 0.2",
                           "loader batch size (per process): rank 0 10, rank 1 12")


def test_a_population_of_one_rank_is_refused_on_every_rank(tmp_path):
    """zoo14 d1 subset: a SubsetRandomSampler split drawn per rank (same size, same dataset: the records check
    passes): records in both ranks' shards would be sampled twice per step."""
    _refused_on_every_rank(tmp_path, PerRankLoader("subset"), "training population (the sampler's indices)")


def test_a_partition_into_users_of_one_rank_is_refused_on_every_rank(tmp_path):
    """zoo14 d2: user ids computed per process (same number of users, grouped differently): one person's records
    in units of both ranks."""
    errors = _refused_on_every_rank(tmp_path, PerRankLoader("users"), "partition into users",
                                    privacy_unit=Users("user_ids", users_per_batch=4))
    assert "population size N" not in errors[0]  # 40 users on each rank: only the partition differs


def test_one_split_on_every_rank_trains(tmp_path):
    """The normal case: one SubsetRandomSampler population on every rank, sharded by the library (disjoint
    positions of it per rank): trains."""
    strategy = _fit(tmp_path, PerRankLoader("same_subset"), steps=2)
    assert strategy.ledger.steps == 2
    assert not list(tmp_path.glob("rank*.err"))


def test_release_terms_find_any_difference_and_only_a_difference():
    """W·Σh² = (Σh)² iff every rank's hash is the same (exact integers)."""
    same = [rank_agreement.release_agreement([1.0, 0.5, ("FlatClipping", ())]) for _ in range(3)]
    summed = [sum(t) for t in zip(*same)]
    assert rank_agreement.differing_release_values(summed, 3) == []
    other = same[:2] + [rank_agreement.release_agreement([1.0, 0.5000001, ("FlatClipping", ())])]
    summed = [sum(t) for t in zip(*other)]
    assert rank_agreement.differing_release_values(summed, 3) == ["max_grad_norm C"]


class LoadedTransformer(ShardedTransformer):
    """The sharded tests' small transformer with a training loader of its own."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(48, 17, 5), batch_size=4)


def test_a_clipping_bound_of_one_rank_is_refused_under_fsdp2(tmp_path):
    """zoo14 d3 clip: under DPShardedStrategy each rank noises the rows it owns at its own σ·C while the
    reduce-scattered sums carry the other rank's examples clipped at its C: refused on every rank."""
    _refused_on_every_rank(tmp_path, LoadedTransformer(), "max_grad_norm C: rank 0 1, rank 1 100",
                           callbacks=[ClipOnRankOne("setup")], base=DPShardedStrategy)
