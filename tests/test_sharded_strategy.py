"""DPShardedStrategy on 2 CPU processes (gloo, FSDP2): the same update and the same guarantee as DPStrategy.

docs/algorithms.md, "The mechanism": ĝ = (Σ_i clip_C(g_i) + σ C z) / B. Sharded, each rank clips its own
Poisson examples with whole-model norms, the clipped sums are reduce-scattered, and each rank adds
σCz to the rows it owns from its own stream (lightning_dp/sharding/privatizer.py). Processes
are forked by Lightning's launcher; each rank writes what it saw (:class:`FullParamRecorder`).
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import ZeroNoise
from scipy import stats
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group
from sharded_helpers import (
    CheckpointedTransformer,
    Conv1dLM,
    FullParamRecorder,
    LeafShardedLM,
    LoRALM,
    MetricsFile,
    RootlessLM,
    SignLM,
    RankZeroNoise,
    ShardedTransformer,
    TiedLM,
    load_records,
    loader,
    token_data,
)

from lightning_dp import AdamVariant, DPShardedStrategy, DPStrategy, PrivacyBudget, SecondMomentMonitor
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.sharding import privatizer as sharded_privatizer
from lightning_dp.privacy.noise import GaussianNoise

WORLD = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _fit(strategy, model, data, out_dir: Path | None, batch_size: int, **kwargs) -> pl.Trainer:
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    if out_dir is not None:
        out_dir.mkdir(exist_ok=True)
        callbacks.append(FullParamRecorder(out_dir))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=kwargs.pop("devices", WORLD),
                         logger=kwargs.pop("logger", False),
                         enable_checkpointing=kwargs.pop("enable_checkpointing", False), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, **kwargs)
    trainer.fit(model, loader(data, batch_size), ckpt_path=ckpt_path)
    return trainer


OBSERVER = ["FullParamRecorder"]
"""The tests' observer keeps parameters, gradients and batch sizes from the batch hooks: declared public."""


def _sharded(**kwargs) -> DPShardedStrategy:
    return DPShardedStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT, public_state=OBSERVER, **kwargs)


def _replicated(**kwargs) -> DPStrategy:
    return DPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT, public_state=OBSERVER, **kwargs)


def _relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5


def _updates(record: dict) -> list[dict[str, torch.Tensor]]:
    before = [record["start"], *record["steps"][:-1]]
    return [{k: after[k] - prev[k] for k in after} for prev, after in zip(before, record["steps"])]


def _run_both(tmp_path: Path, make_model, steps: int, callbacks=lambda: [], metrics: bool = False, batch: int = 6,
              **privacy):
    """The same model, data and Poisson batches (sampler seed per rank, q < 1, C small enough that clipping is
    active) under DPShardedStrategy and DPStrategy, 2 processes each, zero noise; returns each run's per-rank
    records (``tmp_path/<kind>``) and, with ``metrics``, writes what rank 0 logged to ``tmp_path/<kind>.metrics``."""
    model = make_model()
    data = token_data(48, model.tok.num_embeddings, 5)
    common = dict(noise_multiplier=1.0, max_grad_norm=0.05, sampler_seed=11, **privacy)
    for kind, strategy in (("sharded", _sharded(noise=RankZeroNoise(), **common)),
                           ("replicated", _replicated(noise=ZeroNoise(), **common))):
        logger = MetricsFile(tmp_path / f"{kind}.metrics") if metrics else False
        _fit(strategy, model if kind == "sharded" else make_model(), data, tmp_path / kind, batch, max_steps=steps,
             callbacks=callbacks(), logger=logger)
    return load_records(tmp_path / "sharded", WORLD), load_records(tmp_path / "replicated", WORLD)


def _assert_same_updates(sharded: list[dict], replicated: list[dict], frozen: list[str] = ()) -> None:
    for r in sharded[1:]:
        assert all(torch.equal(r["end"][k], sharded[0]["end"][k]) for k in r["end"]), "ranks see different models"
    assert _relative_error(sharded[0]["start"], replicated[0]["start"]) == 0
    moved = 0
    for t, (mine, theirs) in enumerate(zip(_updates(sharded[0]), _updates(replicated[0]), strict=True)):
        if all(v.abs().max() == 0 for v in theirs.values()):  # every rank's Poisson batch was empty
            assert all(v.abs().max() == 0 for v in mine.values()), f"step {t}"
            continue
        moved += 1
        assert _relative_error(mine, theirs) <= 1e-6, f"step {t}"
        assert all(mine[k].abs().max() == 0 for k in frozen)
    assert moved, "the reference updates are all trivial"
    assert sharded[0]["ledger"]["entries"] == replicated[0]["ledger"]["entries"]  # two runs: their run ids differ


MODELS = {  # name: (model, settings of both strategies)
    "transformer": (ShardedTransformer, {}),
    "tied": (TiedLM, {"max_physical_batch_size": 2}),
    "lora": (LoRALM, {}),
    "activation_checkpointing": (CheckpointedTransformer, {}),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.usefixtures("without_data_ledger")  # each run alone: the two runs read the same records
def test_zero_noise_sharded_step_equals_the_replicated_step(tmp_path, name, monkeypatch):
    """Float64, zero noise, the same Poisson batches (same sampler seed per rank, q < 1, clipping active):
    every step's update of every parameter equals DPStrategy's (rel. error ≤ 1e-6), the gradients the
    optimizer saw were shards (DTensor, this rank's rows), FSDP2 never reduced a gradient itself, and no
    unsharded leaf kept an autograd gradient."""
    steps = 3
    make, settings = MODELS[name]
    monkeypatch.setattr(fsdp_param_group, "foreach_reduce", _no_fsdp_gradient_reduction)  # forked: in every rank
    monkeypatch.setattr(sharded_privatizer, "BUCKET_ELEMENTS", 100)  # many reduce-scatter buckets, some of one tensor
    sharded, replicated = _run_both(tmp_path, partial(make, seed=1), steps, **settings)
    frozen = [k for k, p in make().named_parameters() if not p.requires_grad]
    _assert_same_updates(sharded, replicated, frozen)
    grads = sharded[0]["grads"][0]
    assert grads and all(kind == "DTensor" for kind, _ in grads.values())
    full = {k: v.shape[0] for k, v in sharded[0]["start"].items()}
    assert all(shape[0] == -(-full[k] // WORLD) for k, (_, shape) in grads.items()), "rank 0 holds ⌈rows/2⌉ rows"
    assert all(r["leaf_grads"] == [[]] * steps for r in sharded), "an unsharded leaf kept an autograd gradient"


@pytest.mark.usefixtures("without_data_ledger")  # each run alone: the two runs read the same records
def test_empty_local_batches_match_the_replicated_run(tmp_path):
    """One expected example per rank: a rank's Poisson batch is often empty while its peer's is not (it runs a
    stand-in example whose gradient is discarded, so FSDP2's collectives line up), sometimes both are; the
    updates still equal DPStrategy's and nothing hangs."""
    sharded, replicated = _run_both(tmp_path, partial(ShardedTransformer, seed=1), 8, batch=1)
    _assert_same_updates(sharded, replicated)
    empty = (torch.tensor([r["batch_sizes"] for r in sharded]) == 0).sum(0)
    assert (empty == 1).any() and (empty == WORLD).any(), "the seed should give both kinds of step"


@pytest.mark.parametrize("variant", ["independent_moments",
                                     pytest.param("scale_then_privatize", marks=pytest.mark.slow)])  # (make test-all)
@pytest.mark.usefixtures("without_data_ledger")  # each run alone: the two runs read the same records
def test_adam_variants_and_the_monitor_see_the_replicated_run(tmp_path, variant):
    """DP-Adam variants that ask the mechanism for more (a second noised statistic; a per-coordinate scale
    gathered to full size before clipping) update the sharded state exactly as under DPStrategy, and
    SecondMomentMonitor's statistics, gathered over both shards, are logged once and equal the replicated ones."""
    steps = 3

    def callbacks():
        return [AdamVariant(variant), SecondMomentMonitor(every_n_steps=1, histograms=False)]

    make = partial(ShardedTransformer, seed=1, optimizer="adam", lr=1e-2)
    sharded, replicated = _run_both(tmp_path, make, steps, callbacks, metrics=True)
    _assert_same_updates(sharded, replicated)
    mine, theirs = (torch.load(tmp_path / f"{k}.metrics", weights_only=False) for k in ("sharded", "replicated"))
    monitored = [{k: v for k, v in row.items() if k.startswith("vt/")} for _, row in mine]
    reference = [{k: v for k, v in row.items() if k.startswith("vt/")} for _, row in theirs]
    assert len([m for m in monitored if m]) == steps, "one log per step, from rank 0 only"
    for got, want in zip(monitored, reference, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12), k


def _no_fsdp_gradient_reduction(*args, **kwargs):
    raise AssertionError("FSDP2 reduce-scattered autograd's (unclipped) gradients")


def test_noise_is_sigma_c_over_b_once_per_coordinate(tmp_path):
    """Zero clipped sums (lr·update = −(σC/B)z): the per-coordinate std over all d coordinates is σC/B
    (chi-square at 1e-6: fails for σ off by 10 % and for noise added on both ranks, √2), and the two
    ranks' shards are independent: a seeded GaussianNoise is split per rank, so rank 1's rows are not a
    copy of rank 0's (the same seed on two ranks would give equal draws)."""
    sigma, C, b, n = 0.8, 2.0, 10, 200
    model = ShardedTransformer(seed=3, lr=1.0)
    data = token_data(n, model.tok.num_embeddings, 5)
    trainer_kwargs = dict(max_steps=1)
    _fit(_sharded(noise_multiplier=sigma, max_grad_norm=C, noise=GaussianNoise(seed=5), sampler_seed=0,
                  max_physical_batch_size=None), _ZeroGrad(model), data, tmp_path, b, **trainer_kwargs)
    (record, _) = load_records(tmp_path, WORLD)
    update = torch.cat([(record["end"][k] - record["start"][k]).reshape(-1) for k in record["start"]]).double()
    B = WORLD * b
    assert record["expected_batch_size"] == B
    std = sigma * C / B
    assert record["noise_std"] == pytest.approx(std)
    d = update.numel()
    chi2 = float((update / std).pow(2).sum())
    low, high = stats.chi2.ppf(1e-6, d), stats.chi2.isf(1e-6, d)
    assert low < chi2 < high, f"update std {float(update.std()):.5f} ≠ σC/B {std:.5f}"
    for wrong in (1.1, 0.9, 2 ** 0.5):  # the same draws would fail the bound at these noise levels
        assert not low < chi2 / wrong**2 < high
    # No stream shared: rank r's draws are its rows of every parameter, in parameter order. One seed on
    # both ranks would make rank 1's sequence the first entries of rank 0's (the same generator stream).
    own = [[], []]
    for k, v in record["start"].items():
        delta = (record["end"][k] - v).reshape(v.shape[0], -1)
        c = -(-v.shape[0] // WORLD)
        own[0].append(delta[:c].reshape(-1))
        own[1].append(delta[c:].reshape(-1))
    first, second = torch.cat(own[0]), torch.cat(own[1])
    m = min(first.numel(), second.numel())
    corr = float(torch.corrcoef(torch.stack([first[:m], second[:m]]))[0, 1])
    assert abs(corr) < 6 / m ** 0.5, f"the ranks' noise streams are correlated ({corr:.3f})"


class _ZeroGrad(pl.LightningModule):
    """Wraps a sharded model with a loss whose every per-example gradient is zero (SGD lr = 1)."""

    def __init__(self, inner: ShardedTransformer) -> None:
        super().__init__()
        self.inner = inner

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.inner.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        return self.inner(x)  # FSDP2 gathers the root's parameters in the root's forward: call self(x)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).mean() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_checkpoint_resume_continues_the_ledger(tmp_path):
    """A distributed checkpoint carries the ledger: the resumed run's ε counts every step exactly once."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_dp import ledger_epsilon
    from lightning_dp.accounting import forget_data_releases

    data = token_data(60, 17, 5)
    ckpt_dir = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", every_n_train_steps=2, save_top_k=-1)
    _fit(_sharded(noise_multiplier=1.1, max_grad_norm=1.0), ShardedTransformer(), data, tmp_path / "first", 6,
         max_steps=2, callbacks=[saver], enable_checkpointing=True)
    (path,) = list(ckpt_dir.glob("*.ckpt"))
    assert path.is_dir(), "a distributed (sharded) checkpoint is a folder"
    resumed = _sharded(noise_multiplier=1.1, max_grad_norm=1.0)
    _fit(resumed, ShardedTransformer(), data, tmp_path / "second", 6, max_steps=5, ckpt_path=str(path))
    records = load_records(tmp_path / "second", WORLD)
    assert records[0]["ledger_steps"] == 5 and records[0]["global_step"] == 5
    assert resumed.ledger.steps == 5  # back in the main process
    with pytest.warns(UserWarning, match="forgotten"):  # the straight run's ε alone, not composed with the two above
        forget_data_releases()
    straight = _sharded(noise_multiplier=1.1, max_grad_norm=1.0)
    _fit(straight, ShardedTransformer(), data, None, 6, max_steps=5)
    assert ledger_epsilon(resumed.ledger, 1e-5) == ledger_epsilon(straight.ledger, 1e-5)


def test_bf16_mixed_and_privacy_budget(tmp_path):
    """bf16-mixed autocast (clipping in float32 on float32 shards) trains; PrivacyBudget reads the ledger and
    stops the run before ε would pass its target."""
    from lightning_dp import ledger_epsilon

    strategy = _sharded(noise_multiplier=1.7, max_grad_norm=1.0)  # q = 12/60: about 6 steps within ε = 2
    budget = PrivacyBudget(target_epsilon=2.0, delta=1e-5)
    _fit(strategy, ShardedTransformer(seed=2).float(), token_data(60, 17, 5), tmp_path, 6,
         max_steps=200, precision="bf16-mixed", callbacks=[budget], logger=MetricsFile(tmp_path / "metrics"))
    (record, _) = load_records(tmp_path, WORLD)
    assert 0 < strategy.ledger.steps < 200 and record["ledger_steps"] == strategy.ledger.steps
    assert ledger_epsilon(strategy.ledger, 1e-5) <= 2.0
    assert all(torch.isfinite(v).all() for v in record["end"].values())
    assert any(not torch.equal(record["end"][k], record["start"][k]) for k in record["end"])
    rows = torch.load(tmp_path / "metrics", weights_only=False)
    assert any("privacy/epsilon" in row for _, row in rows)
    assert record["global_step"] == strategy.ledger.steps


def test_a_training_step_that_skips_the_sharded_forward_is_named(tmp_path):
    """FSDP2 gathers the root's parameters in the root's forward: a step that calls a submodule directly
    fails in the first step's probe with the fix named (nothing is released)."""

    class Bypass(ShardedTransformer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.head(self.tok(x)).flatten(0, 1), y.flatten())

    with pytest.raises(Exception, match="call the sharded module"):
        _fit(_sharded(noise_multiplier=1.0), Bypass(), token_data(24, 17, 5), None, 4, max_steps=1)


def test_unsupported_settings_fail_loudly():
    with pytest.raises(PrivacyConfigurationError, match="ghost engine only"):
        DPShardedStrategy(noise_multiplier=1.0, per_sample="vmap")
    with pytest.raises(PrivacyConfigurationError, match="banded"):
        DPShardedStrategy(noise_multiplier=1.0, noise="banded")
    with pytest.raises(PrivacyConfigurationError, match="Use DPStrategy"):
        DPShardedStrategy(noise_multiplier=1.0, augmentation_multiplicity=2)
    with pytest.raises(PrivacyConfigurationError, match="for_rank"):  # no way to split it into per-rank streams
        sharded_privatizer.rank_stream(ZeroNoise(), 0)
    with pytest.raises(PrivacyConfigurationError, match="given generator"):
        sharded_privatizer.rank_stream(GaussianNoise(generator=torch.Generator()), 1)


@pytest.mark.parametrize(("model", "fix"), [
    (LeafShardedLM, "apply it to the blocks"),
    (RootlessLM, "apply fully_shard to the root module"),
    (Conv1dLM, "no closed-form per-example rule"),
    (SignLM, "Use DPStrategy with DP-SignSGD"),
], ids=["leaf", "rootless", "conv1d", "sign_sgd"])
def test_unsupported_models_fail_before_any_release(model, fix):
    with pytest.raises(Exception, match=fix):
        _fit(_sharded(noise_multiplier=1.0), model(), token_data(24, 17, 5), None, 4, max_steps=1)


def test_validation_before_and_between_steps(tmp_path):
    """A forward without backward (the sanity check, validation) leaves FSDP2's root parameters gathered; the
    private step reshards first (it failed at the probe with "no per-example gradient captured" before)."""
    strategy = _sharded(noise_multiplier=1.0, max_grad_norm=1.0)
    data = token_data(24, 17, 5)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, max_steps=3, num_sanity_val_steps=1,
                         val_check_interval=1, limit_val_batches=1)
    trainer.fit(ShardedTransformer(), loader(data, 4), loader(data, 4))
    assert strategy.ledger.steps == 3
