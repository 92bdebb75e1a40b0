"""One δ and one accountant per run (issue 22, item 2): the rules of run_privacy, and the
``lightning-dp fit`` summary and config that follow them."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from conftest import TinyClassifier

from lightning_dp.accounting import ledger_epsilon
from lightning_dp.accounting.run_privacy import default_delta, resolve_accountant, resolve_delta
from lightning_dp.cli import main, privacy_summary
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.strategy import DPStrategy

ROOT = Path(__file__).resolve().parents[2]
N = 64


# --------------------------------------------------------------------------- the rules
def test_the_strategys_delta_wins_and_a_different_one_is_refused_naming_both():
    strategy = SimpleNamespace(target_delta=1e-5, accountant="rdp")
    assert resolve_delta(strategy).value == 1e-5
    assert resolve_delta(strategy, 1e-5).value == 1e-5  # the same value given again is fine
    with pytest.raises(PrivacyConfigurationError, match=r"delta=1e-06 .*target_delta=1e-05.*allow_mismatch=True"):
        resolve_delta(strategy, 1e-6)
    marked = resolve_delta(strategy, 1e-6, allow_mismatch=True)
    assert marked.value == 1e-6 and "1e-05" in marked.source


def test_without_a_strategy_delta_the_given_one_else_the_default():
    strategy = SimpleNamespace(target_delta=None)
    assert resolve_delta(strategy) is None  # N not known yet
    assert resolve_delta(strategy, 2e-6).value == 2e-6
    default = resolve_delta(strategy, num_samples=1000)
    assert default.value == pytest.approx(1000**-1.1) == default_delta(1000) and "1/N^1.1" in default.source


def test_the_strategys_accountant_wins():
    strategy = SimpleNamespace(accountant="pld")
    assert resolve_accountant(strategy).value == "pld"
    with pytest.raises(PrivacyConfigurationError, match=r"accountant='rdp' .*accountant='pld'"):
        resolve_accountant(strategy, "rdp")
    assert resolve_accountant(strategy, "rdp", allow_mismatch=True).value == "rdp"
    assert resolve_accountant(SimpleNamespace(), None).value == "rdp"  # no strategy accountant: the default
    with pytest.raises(ValueError, match="unknown accountant"):
        resolve_accountant(strategy, "nope")


# --------------------------------------------------------------------------- the summary
def _fitted(**strategy_kwargs) -> DPStrategy:
    strategy = DPStrategy(max_grad_norm=1.0, **strategy_kwargs)
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyClassifier(d_in=3), DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))
    return strategy


def _privacy_line(summary: str) -> tuple[float, str]:
    line = next(l for l in summary.splitlines() if l.startswith("privacy: ε = "))
    return float(line.split("=")[1].split()[0]), line


def test_summary_uses_the_runs_accountant_and_delta():
    """The summary used RDP at its own δ whatever the run; now the strategy's accountant and δ."""
    strategy = _fitted(noise_multiplier=1.0, target_delta=1e-5, accountant="prv")
    eps, line = _privacy_line(privacy_summary(strategy, None, {}))
    expected = ledger_epsilon(strategy.ledger, 1e-5, "prv")
    assert expected < 0.95 * ledger_epsilon(strategy.ledger, 1e-5, "rdp")  # the two are told apart at 4 digits
    assert eps == pytest.approx(expected, abs=1e-4)
    assert "prv accountant" in line and "δ = 1e-05" in line and "the strategy's target_delta" in line
    refused = r"--privacy_delta=1e-06.*target_delta=1e-05.*--allow_mismatch=true"
    with pytest.raises(PrivacyConfigurationError, match=refused):
        privacy_summary(strategy, 1e-6, {})
    eps, line = _privacy_line(privacy_summary(strategy, 1e-6, {}, allow_mismatch=True))
    assert eps == pytest.approx(ledger_epsilon(strategy.ledger, 1e-6, "prv"), abs=1e-4) and "δ = 1e-06" in line


def test_summary_without_target_delta_takes_privacy_delta_or_the_default():
    strategy = _fitted(noise_multiplier=1.0)
    eps, line = _privacy_line(privacy_summary(strategy, 1e-6, {}))
    assert eps == pytest.approx(ledger_epsilon(strategy.ledger, 1e-6), abs=1e-4) and "--privacy_delta" in line
    eps, line = _privacy_line(privacy_summary(strategy, None, {}))
    assert eps == pytest.approx(ledger_epsilon(strategy.ledger, default_delta(N)), abs=1e-4) and "1/N^1.1" in line


def test_a_sharded_runs_summary_reports_its_ledger():
    """DPShardedStrategy keeps the same ledger as DPStrategy: the summary reports it (it said "no privacy
    guarantee" for any strategy that was not a DPStrategy)."""
    from lightning_dp import DPShardedStrategy

    replicated = _fitted(noise_multiplier=1.0, target_delta=1e-5)
    sharded = DPShardedStrategy(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5)
    sharded.private_step.load_state_dict(replicated.private_step.state_dict())
    summary = privacy_summary(sharded, None, {})
    assert "no privacy guarantee" not in summary
    assert summary == privacy_summary(replicated, None, {})
    assert "no privacy guarantee" in privacy_summary(object(), None, {})


# --------------------------------------------------------------------------- the command and the config
def test_main_config_writes_delta_once():
    config = yaml.safe_load((ROOT / "configs" / "digits.yaml").read_text())
    assert "privacy_delta" not in config
    assert config["trainer"]["strategy"]["init_args"]["target_delta"] == 1e-5


def test_fit_refuses_a_different_privacy_delta_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs" / "digits.yaml"), "--trainer.max_steps=1",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
            "--privacy_delta=1e-6"]
    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(PrivacyConfigurationError, match=r"--privacy_delta=1e-06.*target_delta=1e-05"):
        main(args)
