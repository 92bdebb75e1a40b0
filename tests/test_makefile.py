"""The Makefile's two commands (issue 35): ``make demo`` installs what the main job needs and nothing of the test or
Hugging Face extras; ``make test`` adds those, after ``make demo`` or alone. Read with ``make -n`` (nothing runs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _dry_run(target: str, venv: Path) -> list[str]:
    # CI runs this suite from inside `make test`: a nested make inherits MAKELEVEL/MAKEFLAGS and would print
    # "Entering/Leaving directory" lines, so run it as a top-level make that prints only the commands.
    env = {k: v for k, v in os.environ.items() if k not in {"MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"}}
    cmd = ["make", "--no-print-directory", "-n", target, f"VENV={venv}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return out.stdout.splitlines()


def _extras(lines: list[str]) -> set[str]:
    """The extras of every ``pip install -e ".[…]"`` line."""
    found: set[str] = set()
    for line in lines:
        for group in re.findall(r'-e "\.\[([^\]]*)\]"', line):
            found |= set(group.split(","))
    return found


def test_make_demo_installs_the_main_jobs_extras_only(tmp_path):
    lines = _dry_run("demo", tmp_path / "venv")
    assert _extras(lines) == {"all"}
    assert any("torch==2.13.0" in line and "-c constraints.txt" in line for line in lines)
    assert all("-c constraints.txt" in line for line in lines if "pip install" in line)
    assert lines[-1].endswith("lightning-dp fit --config configs/digits.yaml")


def test_make_test_adds_the_test_and_hf_extras_after_demo_or_alone(tmp_path):
    venv = tmp_path / "venv"
    alone = _dry_run("test", venv)
    assert {"dev", "hf"} <= _extras(alone) and any("torch==2.13.0" in line for line in alone)
    venv.mkdir()
    (venv / ".installed-demo").touch()  # `make demo` ran: `make test` installs only what it adds
    after = _dry_run("test", venv)
    assert {"dev", "hf"} <= _extras(after) and not any("torch==" in line or "-m venv" in line for line in after)
    assert after[-1].endswith("-m pytest -n 2")  # two workers (TEST_WORKERS): the CI machine's two cores


def test_make_test_tries_the_docs_extra_without_failing_and_make_docs_builds_strictly(tmp_path):
    venv = tmp_path / "venv"
    docs_lines = [line for line in _dry_run("test", venv) if '-e ".[docs]"' in line]
    assert len(docs_lines) == 1 and "-c constraints.txt" in docs_lines[0] and "|| echo" in docs_lines[0]
    lines = _dry_run("docs", venv)
    assert "docs" in _extras(lines) and lines[-1].endswith("-m mkdocs build --strict -d site")
