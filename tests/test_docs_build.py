"""The documentation site builds strictly (``mkdocs build --strict``, as ``make docs``): every page of docs/ is in
the nav, every relative link and anchor resolves, and mkdocstrings renders the API reference from the docstrings
without a griffe warning. Skipped only where mkdocs or mkdocstrings is not installed (the ``docs`` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly_with_the_api_reference(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", exc_type=ImportError)
    pytest.importorskip("mkdocstrings", exc_type=ImportError)
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, not a warning of ours
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    page = site / "api" / "strategies" / "index.html"
    assert page.is_file(), "the API reference's strategies page was not built"
    html = page.read_text()
    # DPStrategy's docstring, rendered by mkdocstrings (its first line and its first parameter)
    assert "Train any LightningModule with DP-SGD-style per-example clipping and Gaussian noise." in html
    assert "noise_multiplier" in html
    assert (site / "api" / "privacy" / "index.html").is_file() and (site / "index.html").is_file()
