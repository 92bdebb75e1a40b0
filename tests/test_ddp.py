"""DPStrategy on 2 CPU processes (gloo): the same guarantee and the same update as on one.

docs/algorithms.md, "The mechanism": ĝ = (Σ_i clip_C(g_i) + σ C z) / B with B the *global*
expected batch. Under DDP every rank clips its own Poisson shard, rank 0 alone adds σ C z,
and one all-reduce sums the ranks' sums (issue 6). Processes are forked by Lightning's
launcher; each rank writes what it saw with :class:`ddp_helpers.RankRecorder`.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import (
    DesyncNonZeroRanks,
    RankRecorder,
    SeededClassifier,
    SpectralClassifier,
    ZeroGradModule,
    ZeroNoise,
    classification_data,
    flat_params,
    load_records,
    loader,
)
from pytorch_lightning.callbacks import ModelCheckpoint
from scipy import stats
from torch.utils.data import TensorDataset

from lightning_dp import AdaptiveClipping, AutomaticClipping, DPStrategy, Users
from lightning_dp.privacy.noise import GaussianNoise

WORLD = 2
# A rank stuck in a collective its peer never joins raises after this instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def _trainer(strategy: DPStrategy, devices: int, out_dir: Path | None = None, **kwargs) -> pl.Trainer:
    callbacks = kwargs.pop("callbacks", [])
    if out_dir is not None:
        callbacks.append(RankRecorder(out_dir))
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, callbacks=callbacks, **defaults)


OBSERVER = ["RankRecorder"]
"""The tests' observer keeps each rank's batch sizes and updates from the batch hooks: declared public."""


def _ddp_strategy(**kwargs) -> DPStrategy:
    return DPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT, public_state=OBSERVER, **kwargs)


def _assert_ranks_agree(records: list[dict]) -> None:
    first = records[0]
    for other in records[1:]:
        assert torch.equal(other["start"], first["start"]), "replicas started from different parameters"
        assert torch.equal(other["end"], first["end"]), "replicas diverged"
        assert other["ledger"] == first["ledger"]
        for key in ("sample_rate", "expected_batch_size", "num_samples", "noise_multiplier", "global_step"):
            assert other[key] == first[key], key


def test_noise_is_added_once_with_the_global_batch(tmp_path):
    """Zero gradients: the update is −σCz/B. Noise on both ranks would give std ×2 (same seed)
    or ×√2 (independent seeds); noise on none gives 0. The seed is the same on both ranks."""
    sigma, C, per_rank_batch, n = 0.7, 2.0, 20, 400
    data = TensorDataset(torch.randn(n, 100))
    model = ZeroGradModule()
    strategy = _ddp_strategy(noise_multiplier=sigma, max_grad_norm=C, noise=GaussianNoise(seed=3), sampler_seed=0)
    _trainer(strategy, WORLD, tmp_path, max_steps=1).fit(model, loader(data, per_rank_batch))

    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    update = (records[0]["end"] - records[0]["start"]).double()
    global_b = WORLD * per_rank_batch
    assert records[0]["expected_batch_size"] == global_b
    assert records[0]["sample_rate"] == pytest.approx(global_b / n)
    std = sigma * C / global_b
    chi2 = float((update / std).pow(2).sum())
    d = update.numel()
    message = f"update std {update.std():.5f} ≠ σC/B {std:.5f}"
    assert stats.chi2.ppf(1e-6, d) < chi2 < stats.chi2.isf(1e-6, d), message

    # One process, the same noise seed, the same global B: the very same update.
    single = ZeroGradModule()
    single.load_state_dict({k: v for k, v in zip(single.state_dict(), _split_like(single, records[0]["start"]))})
    reference = DPStrategy(noise_multiplier=sigma, max_grad_norm=C, noise=GaussianNoise(seed=3), sampler_seed=0,
                           public_state=OBSERVER)
    _trainer(reference, 1, max_steps=1).fit(single, loader(data, global_b))
    torch.testing.assert_close(flat_params(single) - records[0]["start"], update.float(), rtol=0, atol=1e-6)


def _split_like(module: torch.nn.Module, flat: torch.Tensor) -> list[torch.Tensor]:
    sizes = [p.numel() for p in module.parameters()]
    return [chunk.view_as(p) for chunk, p in zip(flat.split(sizes), module.parameters())]


def test_noiseless_update_equals_the_single_process_update(tmp_path):
    """q = 1 (every example in every batch), zero noise: 2 × batch b equals 1 × batch 2b,
    and replicas start from rank 0's parameters."""
    n, per_rank_batch, steps, C = 24, 12, 3, 0.5
    data = classification_data(n)
    model = SeededClassifier(seed=1)
    strategy = _ddp_strategy(noise_multiplier=1.0, max_grad_norm=C, noise=ZeroNoise())
    trainer = _trainer(strategy, WORLD, tmp_path, max_steps=steps, callbacks=[DesyncNonZeroRanks()])
    trainer.fit(model, loader(data, per_rank_batch))
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)  # rank 1 was perturbed before setup: the broadcast re-synced it
    assert [r["batch_sizes"] for r in records] == [[per_rank_batch] * steps] * WORLD
    assert records[0]["sample_rate"] == 1.0

    single = SeededClassifier(seed=1)
    torch.testing.assert_close(flat_params(single), records[0]["start"], rtol=0, atol=0)
    assert max(_example_grad_norms(single, data)) > C, "clipping should be active"
    reference = DPStrategy(noise_multiplier=1.0, max_grad_norm=C, noise=ZeroNoise(), public_state=OBSERVER)
    _trainer(reference, 1, max_steps=steps).fit(single, loader(data, WORLD * per_rank_batch))
    assert not torch.equal(flat_params(single), records[0]["start"]), "the update must not be trivial"
    torch.testing.assert_close(records[0]["end"], flat_params(single), rtol=0, atol=1e-6)


def test_a_spectral_norm_under_ddp_equals_the_single_process_run(tmp_path):
    """Zero noise, q = 1: a spectral-normalised classifier's 2-process run equals the 1-process run, every rank
    dividing by the same σ(W) (u, v advanced once per update from the same released weights on every rank)."""
    data = classification_data(24)
    strategy = _ddp_strategy(noise_multiplier=1.0, max_grad_norm=0.5, noise=ZeroNoise())
    _trainer(strategy, WORLD, tmp_path, max_steps=3).fit(SpectralClassifier(seed=1), loader(data, 12))
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    single = SpectralClassifier(seed=1)
    reference = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, noise=ZeroNoise(), public_state=OBSERVER)
    _trainer(reference, 1, max_steps=3).fit(single, loader(data, 24))
    assert not torch.equal(flat_params(single), records[0]["start"]), "the update must not be trivial"
    torch.testing.assert_close(records[0]["end"], flat_params(single), rtol=0, atol=1e-6)


def _example_grad_norms(model: pl.LightningModule, data: TensorDataset) -> list[float]:
    norms = []
    for x, y in data:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[None]), y[None]).backward()
        norms.append(float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()))
    model.zero_grad()
    return norms


def test_empty_local_batches_do_not_hang(tmp_path):
    """Tiny q: a rank is often empty while its peer is not. The user's step logs with
    sync_dist=True (a collective inside training_step), so every rank must still run it;
    whatever an empty rank runs contributes nothing (noise off: all-empty steps do not move)."""
    steps = 25
    model = SeededClassifier(seed=2, log_sync=True)
    strategy = _ddp_strategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=7, noise=ZeroNoise())
    start = time.monotonic()
    _trainer(strategy, WORLD, tmp_path, max_steps=steps).fit(model, loader(classification_data(1000), 1))
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT.total_seconds()
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    sizes = torch.tensor([r["batch_sizes"] for r in records])
    empty_ranks = (sizes == 0).sum(0)
    assert (empty_ranks == 1).any() and (empty_ranks == WORLD).any(), "the seed should give both kinds of step"
    moved = records[0]["updates"].abs().amax(1) > 0
    assert torch.equal(moved, empty_ranks < WORLD), (moved, sizes)
    assert records[0]["ledger_steps"] == steps
    assert torch.isfinite(records[0]["end"]).all()


def test_main_process_sees_the_ledger_after_fit(tmp_path):
    """With fork/spawn training runs in children: the ledger must come back to the caller."""
    strategy = _ddp_strategy(noise_multiplier=1.3, max_grad_norm=1.0)
    _trainer(strategy, WORLD, max_steps=4).fit(SeededClassifier(), loader(classification_data(200), 10))
    assert strategy.ledger.steps == 4
    assert [(e.noise_multiplier, e.sample_rate) for e in strategy.ledger] == [(1.3, pytest.approx(0.1))]
    assert strategy.sample_rate == pytest.approx(0.1)
    assert strategy.expected_batch_size == 20


def test_a_second_fork_fit_of_the_same_module_continues_its_ledger(tmp_path):
    """Training runs in children: the caller's module must still carry their releases into the next fit
    (issue 34, class 6; ``PrivacyStateLauncher.launch`` adopts the record in the caller)."""
    module, data = SeededClassifier(), classification_data(200)
    _trainer(_ddp_strategy(noise_multiplier=1.3, max_grad_norm=1.0), WORLD, max_steps=4).fit(module, loader(data, 10))
    second = _ddp_strategy(noise_multiplier=1.3, max_grad_norm=1.0)
    _trainer(second, WORLD, tmp_path, max_steps=4).fit(module, loader(data, 10))
    assert second.ledger.steps == 8
    assert load_records(tmp_path, WORLD)[0]["ledger"]["entries"][0][2] == 8  # the ranks charged the whole record


def test_checkpoint_saved_under_ddp_resumes_the_ledger(tmp_path):
    data = classification_data(200)
    ckpt_dir, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", every_n_train_steps=3, save_top_k=-1)
    strategy = _ddp_strategy(noise_multiplier=1.1, max_grad_norm=1.0)
    _trainer(strategy, WORLD, first, max_steps=3, callbacks=[saver], enable_checkpointing=True).fit(
        SeededClassifier(), loader(data, 10)
    )
    (path,) = list(ckpt_dir.glob("*.ckpt"))
    assert torch.load(path, weights_only=False)["lightning_dp"]["ledger"] == load_records(first, WORLD)[0]["ledger"]

    resumed = _ddp_strategy(noise_multiplier=1.1, max_grad_norm=1.0)  # fresh ledger: must be restored
    _trainer(resumed, WORLD, second, max_steps=7).fit(SeededClassifier(), loader(data, 10), ckpt_path=str(path))
    records = load_records(second, WORLD)
    _assert_ranks_agree(records)
    assert records[0]["ledger_steps"] == 7 and records[0]["global_step"] == 7
    assert resumed.ledger.steps == 7


@pytest.mark.slow
def test_digits_on_two_processes_matches_one_process_at_the_same_epsilon(tmp_path):
    """Same σ, q and steps (so the same ε): test accuracy within a few points."""
    from lightning_dp.data import DigitsDataModule
    from lightning_dp.models import DigitsCNN

    epochs, global_batch = 15, 64

    def run(devices: int, strategy: DPStrategy) -> tuple[float, DPStrategy]:
        torch.manual_seed(0)
        model, data = DigitsCNN(), DigitsDataModule(batch_size=global_batch // devices)
        _trainer(strategy, devices, max_epochs=epochs).fit(model, datamodule=data)
        data.setup("test")  # under fork/spawn the workers, not this process, set the data up
        x, y = data.test_set.tensors
        with torch.no_grad():
            return (model(x).argmax(1) == y).float().mean().item(), strategy

    seeds = dict(sampler_seed=0, noise=GaussianNoise(seed=0))  # reproducible; spread over seeds ≈ ±2 points
    acc2, ddp = run(WORLD, _ddp_strategy(noise_multiplier=1.0, max_grad_norm=1.0, **seeds))
    acc1, one = run(1, DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, public_state=OBSERVER, **seeds))
    assert ddp.ledger.state_dict()["entries"] == one.ledger.state_dict()["entries"]  # two runs: their run ids differ
    print(f"digits test accuracy: 1 process {acc1:.3f}, 2 processes {acc2:.3f}")
    assert min(acc1, acc2) > 0.8 and abs(acc2 - acc1) < 0.06, (acc1, acc2)


def test_sign_vote_each_worker_adds_its_own_noise(tmp_path):
    """Zero gradients, DP-SignSGD on 2 ranks: each rank sends sign(σCz_m) with its own z_m, so
    the vote sign(s_0 + s_1) is 0 for half the coordinates. Noise on rank 0 only would never
    give 0 (sign(s_0 + 0)); the same noise on both ranks would never give 0 either."""
    from ddp_helpers import ZeroGradSignModule

    data = TensorDataset(torch.randn(80, 100))
    strategy = _ddp_strategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    _trainer(strategy, WORLD, tmp_path, max_steps=1).fit(ZeroGradSignModule(), loader(data, 10))
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    update = records[0]["end"] - records[0]["start"]
    steps = update / 0.5  # -lr · vote with lr = 0.5
    assert torch.allclose(steps, steps.round(), atol=1e-5) and steps.abs().max() <= 1
    zero_share = (steps.round() == 0).double().mean().item()
    n = update.numel()
    assert abs(zero_share - 0.5) < 5 * (0.25 / n) ** 0.5
    assert records[0]["ledger"]["entries"][0][:3] == [1.0, 0.25, 1]


def test_privacy_budget_stops_every_rank_at_the_same_boundary_step(tmp_path):
    """Each rank runs its own PrivacyBudget on the same ledger: all must stop after the last
    step within the target (a rank that stopped alone would leave its peer in a collective)."""
    from lightning_dp import PrivacyBudget
    from lightning_dp.accounting import epsilon

    n, per_rank_batch, sigma, delta, k = 200, 10, 1.0, 1e-5, 5
    q = WORLD * per_rank_batch / n
    target = 0.5 * (epsilon(sigma, q, k, delta) + epsilon(sigma, q, k + 1, delta))
    strategy = _ddp_strategy(noise_multiplier=sigma, max_grad_norm=1.0)
    trainer = _trainer(strategy, WORLD, tmp_path, max_steps=50,
                       callbacks=[PrivacyBudget(target_epsilon=target, delta=delta)])
    trainer.fit(SeededClassifier(), loader(classification_data(n), per_rank_batch))
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    assert [r["global_step"] for r in records] == [k] * WORLD
    assert strategy.ledger.steps == k


class _AdamClassifier(SeededClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_second_moment_monitor_logs_once_from_rank_zero(tmp_path):
    """The monitor (private and opt-in non-private logs) under 2 processes: the run completes
    (the diagnostics' all-reduce does not hang) and every due step is written exactly once."""
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_dp import SecondMomentMonitor

    strategy = _ddp_strategy(noise_multiplier=1.0, max_grad_norm=1.0)
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="run")
    monitor = SecondMomentMonitor(every_n_steps=2, diagnostics="non_private")
    # (its NotPrivateWarning is raised in the forked workers, not here)
    _trainer(strategy, WORLD, tmp_path, max_steps=4, logger=logger, callbacks=[monitor]).fit(
        _AdamClassifier(), loader(classification_data(200), 10)
    )
    _assert_ranks_agree(load_records(tmp_path, WORLD))
    (run_dir,) = list((tmp_path / "tb" / "run").iterdir())
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in ("vt/v/all/median", "nonprivate/vt/v/all/median", "nonprivate/clip_fraction"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 4], tag


class _DiagnosticsRecorder(pl.Callback):
    """Saves, per rank, the strategy's non-private per-example norms after every step."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.norms = out_dir, []

    def setup(self, trainer, pl_module, stage):
        trainer.strategy.enable_non_private_diagnostics()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        diag = trainer.strategy.non_private_diagnostics
        self.norms.append((diag.norms.clone(), diag.batch_size, diag.clip_fraction))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.norms, self.out_dir / f"diag{trainer.global_rank}.pt")


def test_non_private_norms_are_every_ranks_examples(tmp_path):
    """The diagnostics' per-example norms (monitor quantiles, clip fraction) cover both ranks'
    Poisson shards: the same on every rank, as many as the two local batches together."""
    strategy = DPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT, noise_multiplier=1.0, max_grad_norm=0.5,
                          sampler_seed=1, public_state=[*OBSERVER, "_DiagnosticsRecorder"])
    _trainer(strategy, WORLD, tmp_path, max_steps=3, callbacks=[_DiagnosticsRecorder(tmp_path)]).fit(
        _AdamClassifier(), loader(classification_data(200), 10)
    )
    records = load_records(tmp_path, WORLD)
    seen = [torch.load(tmp_path / f"diag{rank}.pt") for rank in range(WORLD)]
    for step in range(3):
        local = [r["batch_sizes"][step] for r in records]
        norms, size, fraction = seen[0][step]
        assert size == norms.numel() == sum(local)
        assert torch.equal(seen[1][step][0], norms) and seen[1][step][1:] == (size, fraction)
        assert fraction == pytest.approx(float((norms > 0.5).float().mean()))



class PerRankSplit(pl.LightningDataModule):
    """Splits the data in setup(), on every rank, from a generator seeded with the rank (``seed + rank``)."""

    def __init__(self, subsample: bool) -> None:
        super().__init__()
        self.subsample = subsample

    def setup(self, stage: str) -> None:
        x, y = classification_data(200).tensors
        order = torch.randperm(200, generator=torch.Generator().manual_seed(7 + self.trainer.global_rank))
        keep = order[: 100 + 50 * self.trainer.global_rank] if self.subsample else order
        self.train_set = TensorDataset(x[keep], y[keep])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=16)


@pytest.mark.parametrize("subsample", [False, True], ids=["shuffled per rank", "subsampled per rank"])
def test_training_datasets_that_differ_between_ranks_are_refused(subsample):
    """One population for every rank, or the draw puts one record at two ranks' different indices and N, q
    disagree: refused on every rank (record_checks/records.check_same_on_every_rank) before any release."""
    trainer = _trainer(_ddp_strategy(noise_multiplier=1.0, sampler_seed=0), WORLD, max_steps=2)
    model = SeededClassifier()
    with pytest.raises(Exception, match="differ between the ranks"):
        trainer.fit(model, datamodule=PerRankSplit(subsample))


SHORT_TIMEOUT = timedelta(seconds=10)  # a rank left waiting in a collective fails the test fast instead of hanging


def test_rank_zero_only_stamp_beside_a_broadcast_trains(tmp_path):
    """FP-D4: a wall-clock stamp kept on rank 0 only beside a broadcast at batch end. The first step's replays and
    the decision windows decide alike on every rank how many times the hooks run again: the broadcasts stay paired,
    the fit trains (no gloo timeout)."""
    from ddp_helpers import Rank0StampBroadcast

    start = time.monotonic()
    strategy = DPStrategy(start_method="fork", timeout=SHORT_TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0)
    trainer = _trainer(strategy, WORLD, max_steps=3, callbacks=[Rank0StampBroadcast()])
    trainer.fit(SeededClassifier(), loader(classification_data(64), 16))
    assert strategy.ledger.steps == 3
    assert time.monotonic() - start < 40


def test_a_refusal_on_one_rank_is_raised_on_every_rank(tmp_path):
    """A batch-end write from the batch on rank 0 only (an EMA of the loss), beside a broadcast: rank 0's replays
    refuse it, and rank 1, whose own replays saw nothing, raises too (on_every_rank) rather than going on to replay
    the hooks and wait in their broadcast."""
    from ddp_helpers import Rank0LossEmaBroadcast, errors_recorded

    start = time.monotonic()
    strategy = errors_recorded(DPStrategy, tmp_path)(start_method="fork", timeout=SHORT_TIMEOUT, noise_multiplier=1.0,
                                                     max_grad_norm=1.0, sampler_seed=0)
    trainer = _trainer(strategy, WORLD, max_steps=3, callbacks=[Rank0LossEmaBroadcast()])
    with pytest.raises(Exception):
        trainer.fit(SeededClassifier(), loader(classification_data(64), 16))
    errors = {r: (tmp_path / f"rank{r}.err").read_text() if (tmp_path / f"rank{r}.err").exists() else None
              for r in range(WORLD)}
    assert all(e is not None and e.startswith("PrivacyConfigurationError") for e in errors.values()), errors
    assert "Rank0LossEmaBroadcast.ema" in errors[0]
    assert time.monotonic() - start < 40


def test_an_end_of_fit_write_on_one_rank_is_refused_without_a_hang(tmp_path):
    """The end of the fit under DDP (validators/end_of_fit.py): training-set means kept in ``on_fit_end`` on rank 0
    only, beside a broadcast. Every rank runs the hooks again as often (the replays' broadcasts stay paired) and the
    write is refused; the fit does not wait out the collective timeout."""
    from ddp_helpers import Rank0MeansAtFitEnd

    start = time.monotonic()
    strategy = DPStrategy(start_method="fork", timeout=SHORT_TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0)
    trainer = _trainer(strategy, WORLD, max_steps=2, callbacks=[Rank0MeansAtFitEnd()])
    # the launcher reports one rank's error: rank 0's names the write, rank 1's says another rank's check found it
    refused = (r"(?s)(PrivacyConfigurationError|StateWrittenError): .*(Rank0MeansAtFitEnd\.means|another rank's "
               r"examples found state written after training ended)")
    with pytest.raises(Exception, match=refused):
        trainer.fit(SeededClassifier(), loader(classification_data(64), 16))
    assert time.monotonic() - start < 40


def test_a_checkpoint_entry_from_the_data_on_one_rank_is_refused_without_a_hang(tmp_path):
    """A checkpoint under DDP (validators/checkpoint_replays.py): the training set's means put into the checkpoint on
    rank 0 only, beside a broadcast. The user's checkpoint hooks run again on every rank alike and the entry is
    refused before anything is written."""
    from ddp_helpers import Rank0MeansInCheckpoint

    start = time.monotonic()
    strategy = DPStrategy(start_method="fork", timeout=SHORT_TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)
    trainer = _trainer(strategy, WORLD, max_steps=2, callbacks=[Rank0MeansInCheckpoint(), saver],
                       enable_checkpointing=True)
    refused = (r"(?s)PrivacyConfigurationError: .*(feature_means|another rank's "
               r"examples found a checkpoint entry computed from the training data)")
    with pytest.raises(Exception, match=refused):
        trainer.fit(SeededClassifier(), loader(classification_data(64), 16))
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))  # nothing written
    assert time.monotonic() - start < 40


SPAWNABLE = {
    "default": dict(noise_multiplier=1.0, max_grad_norm=1.0),
    "target epsilon, banded": dict(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, noise="banded", bands=2,
                                   on_budget_short="recalibrate"),
    "adaptive clipping, users": dict(noise_multiplier=1.0, clipping=AdaptiveClipping(1.0),
                                     privacy_unit=Users(list(range(12)), users_per_batch=4)),
    "automatic clipping, fixed batch": dict(noise_multiplier=1.0, clipping=AutomaticClipping(), fixed_batch_size=8,
                                            per_sample="vmap", verify="every_step", secure_mode=True),
    "views, physical batches": dict(noise_multiplier=1.0, max_grad_norm=1.0, augmentation_multiplicity=2,
                                    max_physical_batch_size=4, per_sample="ghost", public_state=OBSERVER),
}


@pytest.mark.parametrize("kwargs", SPAWNABLE.values(), ids=SPAWNABLE.keys())
def test_the_strategy_pickles_for_spawn(kwargs):
    """spawn and forkserver pickle the strategy into every worker: nothing it holds before a fit (a lambda, a closure)
    may refuse, neither fresh nor once a Trainer has connected it."""
    strategy = DPStrategy(start_method="spawn", timeout=COLLECTIVE_TIMEOUT, **kwargs)
    pickle.loads(pickle.dumps(strategy))
    _trainer(strategy, WORLD)
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy.private_step.boundary.callbacks() == ()  # the glue sets what it fingerprints when the fit attaches
    assert copy.private_step.loop.public() == tuple(kwargs.get("public_state", ()))
    assert copy.private_step.loop.mechanism().keys() == strategy.private_step.loop.mechanism().keys()


def test_a_spawned_fit_trains_and_returns_the_ledger(tmp_path):
    """start_method="spawn" (docs/distributed.md): the workers train, and rank 0's ledger and weights come back to
    the caller as with fork."""
    model = SeededClassifier()
    start = flat_params(model)
    strategy = DPStrategy(start_method="spawn", timeout=COLLECTIVE_TIMEOUT, public_state=OBSERVER,
                          noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    _trainer(strategy, WORLD, tmp_path, max_steps=2).fit(model, loader(classification_data(64), 8))
    records = load_records(tmp_path, WORLD)
    _assert_ranks_agree(records)
    assert records[0]["ledger_steps"] == strategy.ledger.steps == 2
    assert not torch.equal(records[0]["end"], start)
    torch.testing.assert_close(flat_params(model), records[0]["end"])  # the trained weights, in the caller
