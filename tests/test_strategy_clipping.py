"""DPStrategy with clipping policies (issue #39): the release against an explicit loop, the adaptive bound's
trajectory and cost, logging, checkpoints and refusals."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, make_loader, quiet_trainer
from ddp_helpers import ZeroNoise
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import (
    AdaptiveClipping,
    AutomaticClipping,
    DPStrategy,
    PerLayerClipping,
    PrivacyConfigurationError,
    ledger_epsilon,
)
from lightning_dp.accounting import forget_data_releases
from lightning_dp.privacy.noise import GaussianNoise


def _norms(model: TinyClassifier, loader: DataLoader) -> torch.Tensor:
    """Every example's gradient norm, one example at a time (the explicit loop)."""
    x, y = loader.dataset.tensors
    params = list(model.parameters())
    out = []
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        out.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
    return torch.tensor(out, dtype=torch.float64)


def _one_full_batch_step(clipping, C=None):
    """One step with q = 1 (every example), zero noise, SGD(lr = 1): Δθ = −(1/N) Σ_i clip(g_i)."""
    torch.manual_seed(0)
    model = TinyClassifier(lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loader = make_loader(n=24, batch_size=24)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=C, clipping=clipping, noise=ZeroNoise(), sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=1).fit(model, loader)
    return [b - p.detach() for b, p in zip(before, model.parameters())], before, loader, strategy


def _explicit(before, loader, factor_of):
    """(1/N) Σ_i factor_of(g_i) ⊙ g_i at the initial weights, one example at a time."""
    model = TinyClassifier()
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    x, y = loader.dataset.tensors
    total = [torch.zeros_like(b) for b in before]
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        for k, f in enumerate(factor_of(grads)):
            total[k] += f * grads[k] / len(y)
    return total


def test_per_layer_and_automatic_releases_equal_the_explicit_loop():
    C = 0.05
    update, before, loader, strategy = _one_full_batch_step(PerLayerClipping(max_grad_norm=C))
    P = len(before)
    want = _explicit(before, loader, lambda gs: [min(1.0, C / math.sqrt(P) / (float(g.norm()) + 1e-6)) for g in gs])
    assert all(torch.allclose(u, w, atol=1e-6) for u, w in zip(update, want))
    assert strategy.max_grad_norm == C
    update, before, loader, _ = _one_full_batch_step(AutomaticClipping(max_grad_norm=C, gamma=0.01), C=C)
    want = _explicit(before, loader, lambda gs: [C / (math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) + 0.01)] * P)
    assert all(torch.allclose(u, w, atol=1e-6) for u, w in zip(update, want))


def _adaptive_run(tmp_path, initial_norm, steps, seed=0):
    torch.manual_seed(0)
    model = TinyClassifier(lr=0.0)  # fixed weights: the norms' quantiles do not move
    policy = AdaptiveClipping(initial_norm=initial_norm, target_quantile=0.5, learning_rate=0.2)
    policy._generator.manual_seed(seed)  # the count's noise, reproducible here (from the OS otherwise)
    strategy = DPStrategy(noise_multiplier=1.0, clipping=policy, sampler_seed=seed, noise=GaussianNoise(seed=seed))
    logger = CSVLogger(tmp_path, name="adaptive")
    quiet_trainer(strategy=strategy, max_steps=steps, logger=logger, log_every_n_steps=10).fit(
        model, make_loader(n=400, batch_size=32))
    return model, strategy, logger


def test_adaptive_clipping_finds_the_median_from_ten_times_it_and_costs_at_least_the_flat_runs_epsilon(tmp_path):
    loader = make_loader(n=400, batch_size=32)
    torch.manual_seed(0)
    norms = _norms(TinyClassifier(lr=0.0), loader)
    q25, median, q75 = (float(torch.quantile(norms, q)) for q in (0.25, 0.5, 0.75))
    model, strategy, logger = _adaptive_run(tmp_path, initial_norm=10 * median, steps=150)
    assert q25 <= strategy.max_grad_norm <= q75, (q25, strategy.max_grad_norm, q75)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        logged = [float(r["privacy/clip_norm"]) for r in csv.DictReader(f) if r.get("privacy/clip_norm")]
    assert len(logged) >= 10 and logged[0] > 5 * median and q25 <= logged[-1] <= q75
    assert float(model.trainer.callback_metrics["privacy/clip_norm"]) == strategy.max_grad_norm
    with pytest.warns(UserWarning, match="forgotten"):  # the two runs' costs compared, each alone: not composed
        forget_data_releases()
    flat = DPStrategy(noise_multiplier=1.0, max_grad_norm=median, sampler_seed=0)
    quiet_trainer(strategy=flat, max_steps=150).fit(TinyClassifier(lr=0.0), make_loader(n=400, batch_size=32))
    adaptive_eps = ledger_epsilon(strategy.ledger, 1e-5, "rdp")
    assert adaptive_eps >= ledger_epsilon(flat.ledger, 1e-5, "rdp") > 0
    release = strategy.last_release
    assert release.noise_multiplier > 1.0  # the gradient's noise raised for the count (Andrew et al., Theorem 1)


def test_the_adaptive_bound_is_checkpointed_and_resumed(tmp_path):
    _, strategy, _ = _adaptive_run(tmp_path, initial_norm=50.0, steps=5)
    state = strategy.private_step.state_dict()
    assert state["max_grad_norm"] == 50.0 and state["clipping"]["bound"] == strategy.max_grad_norm < 50.0
    resumed = DPStrategy(noise_multiplier=1.0, clipping=AdaptiveClipping(initial_norm=50.0))
    resumed.private_step.load_state_dict(state)
    assert resumed.max_grad_norm == strategy.max_grad_norm
    assert not resumed.private_step.changes_from(state, 1.0)
    other = DPStrategy(noise_multiplier=1.0, clipping=AutomaticClipping(50.0))
    with pytest.raises(PrivacyConfigurationError, match="clipping=AdaptiveClipping"):
        other.private_step.load_state_dict(state)


def test_a_bound_given_twice_must_agree():
    with pytest.raises(PrivacyConfigurationError, match="disagree on the clipping norm C"):
        DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, clipping=AutomaticClipping(max_grad_norm=2.0))
    assert DPStrategy(noise_multiplier=1.0, clipping=AutomaticClipping(max_grad_norm=2.0)).max_grad_norm == 2.0
    assert DPStrategy(noise_multiplier=1.0).max_grad_norm == 1.0


def test_combinations_that_do_not_hold_are_refused_by_name():
    strategy = DPStrategy(noise_multiplier=1.0, clipping=AdaptiveClipping(1.0), noise="banded", bands=2)
    with pytest.raises(PrivacyConfigurationError, match="AdaptiveClipping releases an independent noisy count"):
        quiet_trainer(strategy=strategy, max_steps=1).fit(TinyClassifier(), make_loader(n=40, batch_size=4))


def test_a_policy_works_with_physical_batches_and_every_engine():
    """Physical batches of 5 give the release of one batch (zero noise, q = 1)."""
    for engine in ("ghost", "vmap", "opacus_hooks"):
        results = []
        for limit in (None, 5):
            torch.manual_seed(0)
            model = TinyClassifier(lr=1.0)
            strategy = DPStrategy(noise_multiplier=1.0, clipping=PerLayerClipping(0.05), noise=ZeroNoise(),
                                  sampler_seed=0, per_sample=engine, max_physical_batch_size=limit)
            quiet_trainer(strategy=strategy, max_steps=1).fit(model, make_loader(n=24, batch_size=24))
            results.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*results)), engine


def test_the_configuration_reads_the_policies_from_yaml():
    """LightningCLI's parser (jsonargparse) builds DPStrategy's clipping and privacy_unit from a config."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(DPStrategy, "strategy")
    config = parser.parse_string("""
strategy:
  noise_multiplier: 1.0
  clipping:
    class_path: lightning_dp.AdaptiveClipping
    init_args: {initial_norm: 3.0, target_quantile: 0.6}
  privacy_unit:
    class_path: lightning_dp.Users
    init_args: {user_ids: user_ids, users_per_batch: 8, max_examples_per_user: 4}
""")
    strategy = parser.instantiate_classes(config).strategy
    assert isinstance(strategy.clipping, AdaptiveClipping) and strategy.clipping.target_quantile == 0.6
    assert strategy.max_grad_norm == 3.0 and strategy.private_step.users.users_per_batch == 8


def test_the_probe_checks_each_policys_factors(monkeypatch):
    """A ghost engine that clips a layer's bias with its weight's per-layer factor is refused by the first step's
    probe (its clipped pass applies the run's policy), before any release."""
    from lightning_dp.grad_sample.layer_stats import WeightBiasStats

    def mixed(self, factors):
        out = {}
        if self.weight is not None and self.weight in factors:
            out[self.weight] = self.sums(factors[self.weight])[self.weight]
        if self.bias is not None and self.bias in factors:
            out[self.bias] = (factors[self.weight] * self.k) @ self.db  # the weight's factor
        return out

    monkeypatch.setattr(WeightBiasStats, "sums_by_param", mixed)
    strategy = DPStrategy(noise_multiplier=1.0, clipping=PerLayerClipping(1.0), per_sample="ghost", sampler_seed=0)
    with pytest.raises(PrivacyConfigurationError, match="clipped the first step's examples wrongly"):
        quiet_trainer(strategy=strategy, max_steps=1).fit(TinyClassifier(), make_loader(n=40, batch_size=8))


def test_lightning_dp_fit_takes_a_policy_from_the_command_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("jsonargparse")
    from pathlib import Path

    from lightning_dp.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
    args = ["fit", "--config", str(config), "--trainer.max_steps=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--test_after_fit=false",
            "--trainer.strategy.max_grad_norm=null", "--trainer.strategy.clipping=lightning_dp.AutomaticClipping",
            "--trainer.strategy.clipping.max_grad_norm=2.0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "C = 2," in out and "clipping: automatic clipping" in out


def test_the_sharded_strategy_refuses_policies_and_users_by_name():
    from lightning_dp import DPShardedStrategy, Users

    with pytest.raises(PrivacyConfigurationError, match=r"DPShardedStrategy\(clipping=...\).*Use DPStrategy"):
        DPShardedStrategy(noise_multiplier=1.0, clipping=AutomaticClipping(1.0))
    with pytest.raises(PrivacyConfigurationError, match=r"DPShardedStrategy\(privacy_unit=...\)"):
        DPShardedStrategy(noise_multiplier=1.0, privacy_unit=Users([0, 1], users_per_batch=1))
