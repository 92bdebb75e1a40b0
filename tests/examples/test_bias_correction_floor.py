"""Smoke run of examples/bias_correction_floor.py (a few steps, one seed): every row and column of its table."""

from __future__ import annotations

from example_loader import load_example


def test_smoke_run_prints_one_row_per_floor():
    example = load_example("bias_correction_floor.py", "bias_correction_floor")
    text = example.main(["--smoke", "--models", "lstm"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [r.split("|")[1].strip() for r in rows] == [label for label, _, _ in example.ROWS]
    assert all(0.0 <= float(r.split("|")[2]) <= 100.0 for r in rows)
