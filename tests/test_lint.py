"""``ruff check lightning_dp`` is clean under the configuration in pyproject.toml (line length 120; pycodestyle and
pyflakes). ruff comes with the ``lint`` extra, which ``make test`` installs where the index has it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_is_lint_clean():
    pytest.importorskip("ruff", reason="ruff is in the lint extra: pip install -e '.[lint]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "lightning_dp"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_configuration_sets_a_line_length_and_the_rules():
    text = (ROOT / "pyproject.toml").read_text()
    assert "[tool.ruff]" in text and "line-length = 120" in text and 'select = ["E", "W", "F"]' in text
