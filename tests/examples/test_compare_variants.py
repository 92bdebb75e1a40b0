"""Smoke run of examples/compare_variants.py, and its selection / table helpers."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import ModuleType

import pytest
from example_loader import load_example

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("compare_variants.py", "compare_variants")


def _run(example: ModuleType, val: float, test: float = 0.5, eps: float = 3.0) -> object:
    return example.RunResult(val_acc=val, test_acc=test, sigma=1.0, epsilon_spent=eps, seconds=0.0)


def test_smoke_run_writes_markdown_table(example: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    assert example.main(["--smoke", "--out", str(out)]) == out
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 8 |")]
    selected = [r for r in rows if "**" in r]
    assert [r.split("|")[2].strip() for r in selected] == ["DP-SGD", "post_processing"]
    for row in selected:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert abs(float(cells[4]) - 8.0) < 0.05  # ε spent from the ledger ≈ the calibration target
        mean, std = (float(x) for x in re.findall(r"[\d.]+", cells[6]))
        assert 0.0 <= mean <= 100.0 and std == 0.0  # one seed
    assert "does **not** account" in text and "max_steps = 3" in text


def test_selection_uses_validation_not_test(example: ModuleType) -> None:
    method = example.Method("m", "adam", "post_processing", grid={"lr": [0.1, 0.2, 0.3]})
    points = method.points()
    results = {
        "lr=0.1": [_run(example, 0.50, test=0.99), _run(example, 0.52, test=0.99)],
        "lr=0.2": [_run(example, 0.90, test=0.10), _run(example, 0.80, test=0.10)],
        "lr=0.3": [_run(example, 0.95, test=0.20), _run(example, 0.60, test=0.20)],
    }
    row = example.select(method, 3.0, results, points)
    assert row.point == {"lr": 0.2}
    assert row.test == pytest.approx([10.0, 10.0])
    assert example.at_edge(method, row.point) == []
    assert example.at_edge(method, {"lr": 0.3}) == ["lr"]


def test_grid_is_the_product_of_its_lists(example: ModuleType) -> None:
    method = example.Method("stp", "adam", "scale_then_privatize", grid={"lr": [0.01, 0.03], "max_grad_norm": [0.1, 1]})
    assert method.points() == [{"lr": 0.01, "max_grad_norm": 0.1}, {"lr": 0.01, "max_grad_norm": 1},
                               {"lr": 0.03, "max_grad_norm": 0.1}, {"lr": 0.03, "max_grad_norm": 1}]


def test_table_marks_non_private_runs(example: ModuleType) -> None:
    method = example.Method("noiseless (NOT private)", "adam", "noiseless", grid={"lr": [1e-3]})
    runs = [_run(example, 0.9, 0.8, eps=math.inf), _run(example, 0.9, 0.9, eps=math.inf)]
    row = example.Row(method, 3.0, {"lr": 1e-3}, runs)
    line = example.markdown_table([row]).splitlines()[-1]
    assert "∞ (not private)" in line and "**85.0 ± 7.1**" in line


def test_config_errors_name_the_fix(example: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("delta: 1.0e-5\nepsilons: [3]\nseeds: [0]\nepochs: 1\nbatch_size: 8\nmax_grad_norm: 1\n"
                   "val_fraction: 0.1\nmethods:\n"
                   "  - {label: x, optimizer: adam, variant: noiseless, grid: {gamma: [1]}}\n")
    with pytest.raises(ValueError, match="`lr` list"):
        example.load_sweep(bad)
    sweep = example.load_sweep(example.DEFAULT_CONFIG)
    assert len(sweep.seeds) >= 3 and sweep.epsilons == [3.0, 8.0] and sweep.delta == 1e-5
    assert {m.variant for m in sweep.methods} >= {"post_processing", "bias_corrected", "independent_moments",
                                                   "scale_then_privatize", "noiseless"}
    with pytest.raises(SystemExit):
        example.parse_args(["--seeds", "0"])


def test_smoke_run_of_the_adambc_config(example: ModuleType, tmp_path: Path) -> None:
    """Issue 9 (d) runs the same script with configs/adambc_vs_adam_vs_sgd.yaml."""
    out = tmp_path / "adambc.md"
    config = ROOT / "configs" / "adambc_vs_adam_vs_sgd.yaml"
    assert example.main(["--smoke", "--config", str(config), "--out", str(out)]) == out
    selected = [r for r in out.read_text().splitlines() if r.startswith("| 8 |") and "**" in r]
    assert [r.split("|")[2].strip() for r in selected] == ["DP-SGD", "DP-AdamBC γ'=1e-9"]
