"""`lightning-dp fit` on 2 CPU processes exits cleanly, every time, on every rank.

A gloo process group still alive when Python finalizes can abort a process after the run
("terminate called without an active exception", exit 134; about 1 process in 30 here). The
abort is rare, so beside the exit status and stderr of the run, each rank records — from the
last exit handler, after the run's own — whether its process group was destroyed in time: that
part fails every time the clean-up is missing (so one run suffices; a second one only added a 1-in-30
chance of seeing the abort itself).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
RUNS = 1

# Lightning's popen launcher starts rank 1 as `python <this script> <same argv>`.
SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys

    def _record_process_group_state():
        import torch.distributed as dist

        alive = dist.is_available() and dist.is_initialized()
        with open(f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.txt", "w") as f:
            f.write("alive" if alive else "destroyed")

    atexit.register(_record_process_group_state)  # registered first, so it runs last

    from lightning_dp.cli import main

    sys.exit(main())
    """
)


@pytest.mark.ddp
def test_two_process_fit_exits_cleanly(tmp_path):
    script = tmp_path / "run_cli.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), "fit", "--config", str(CONFIG), "--trainer.devices=2",
            "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--test_after_fit=false"]
    for run in range(RUNS):
        cwd = tmp_path / f"run{run}"
        cwd.mkdir()
        # capture_output waits for EOF on the pipes rank 1 inherited: rank 1 has exited too
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "privacy: ε = " in proc.stdout
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
        states = {p.name: p.read_text() for p in sorted(cwd.glob("exit_rank*.txt"))}
        assert states == {"exit_rank0.txt": "destroyed", "exit_rank1.txt": "destroyed"}, states
