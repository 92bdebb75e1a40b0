"""`lightning-dp fit --config configs/lm_sharded.yaml`: sharded private training from the command line, 2 CPU
processes (Lightning's popen launcher re-runs the command for rank 1), with validation before and between the
private steps, ending with the privacy summary of the sharded run's ledger."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lm_sharded.yaml"


def test_the_sharded_config_targets_what_its_budget_callback_reports():
    config = yaml.safe_load(CONFIG.read_text())
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_dp.DPShardedStrategy" and config["trainer"]["devices"] == 2
    (budget,) = [c for c in config["trainer"]["callbacks"] if c["class_path"] == "lightning_dp.PrivacyBudget"]
    assert budget["init_args"]["target_epsilon"] == strategy["init_args"]["target_epsilon"]


@pytest.mark.slow  # ≈ 20 s of two processes (make test-all); FSDP2: test_sharded_strategy, the CLI: test_cli_ddp
@pytest.mark.ddp
def test_two_process_sharded_fit_from_the_command_line(tmp_path):
    args = [sys.executable, "-m", "lightning_dp.cli", "fit", "--config", str(CONFIG), "--trainer.max_steps=3",
            "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
            "--data.init_args.max_train_windows=256", "--data.init_args.batch_size=8"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if proc.returncode in (-6, 134) and "terminate called without an active exception" in proc.stderr:
        # the known rare abort at interpreter exit after a finished 2-process gloo run (tests/test_cli_ddp.py's
        # docstring; seen once in ~40 fresh-clone runs of this test after the fit had ended): run once more
        proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DPShardedStrategy: σ = " in proc.stderr
    eps = re.search(r"privacy: ε = ([0-9.]+) at δ = 1e-05 after 3 steps", proc.stdout)
    assert eps is not None, proc.stdout[-2000:]
    assert 0 < float(eps.group(1)) <= 3.0 + 1e-9
    assert "no privacy guarantee" not in proc.stdout
