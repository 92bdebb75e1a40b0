"""Smoke run of examples/sign_sgd_breast_cancer.py, and its Lévy-stable sampler."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from example_loader import load_example



@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("sign_sgd_breast_cancer.py", "sign_sgd_breast_cancer")


def test_smoke_run_writes_table_and_plot(example: ModuleType, tmp_path: Path) -> None:
    path = example.main(["--smoke", "--out", str(tmp_path)])
    text = path.read_text()
    assert (tmp_path / "curves.png").stat().st_size > 1000
    for label in ("SGD", "SignSGD", "DP-SignSGD ε≈10", "DP-SignSGD ε≈1"):
        assert text.count(f"| {label} |") == 2  # without and with Lévy noise
    assert "σ paper grid" in text and "step 6" in text
    assert "| ε with the standardiser (ours) |" in text  # the whole pipeline's ε, the standardiser's releases in it


def test_features_are_standardised_privately_and_pass_rule_11(example: ModuleType) -> None:
    from torch.utils.data import TensorDataset

    from lightning_dp.data import PrivateStandardizer
    from lightning_dp.record_statistics.data_statistics import data_statistics_held

    data = example.load_data(0)
    assert isinstance(data.scaler, PrivateStandardizer) and data.scaler.releases == 2
    x = torch.cat([x for x, _ in data.workers])
    y = torch.cat([y for _, y in data.workers]).squeeze(1).long()
    assert data_statistics_held([], TensorDataset(x, y)) == []
    assert x.mean(0).abs().max() > 1e-3  # not the exact standardisation: noise and clipping show


@pytest.mark.parametrize("t", [0.5, 2.0, 6.0])
def test_levy_sampler_characteristic_function(example: ModuleType, t: float) -> None:
    """E[cos(tX)] = exp(-|scale·t|^α) for symmetric α-stable (β = 0); 4 sd tolerance."""
    n = 200_000
    x = example.levy_stable((n,), 1.6, 0.25, torch.Generator().manual_seed(0)).double()
    empirical = torch.cos(t * x).mean().item()
    assert abs(empirical - math.exp(-((0.25 * t) ** 1.6))) < 4 * (0.5 / n) ** 0.5
    assert abs(empirical - math.exp(-((0.25 * t) ** 2.0))) > 4 * (0.5 / n) ** 0.5  # not Gaussian


def test_levy_sampler_is_heavy_tailed(example: ModuleType) -> None:
    """P(|X| > x) ~ x^-α: far tails exist that a Gaussian with the same scale never reaches."""
    x = example.levy_stable((100_000,), 1.6, 0.25, torch.Generator().manual_seed(1))
    assert (x.abs() > 10).float().mean().item() > 4e-4  # expected ≈ 9e-4; Gaussian: 0
    with pytest.raises(ValueError, match="alpha"):
        example.levy_stable((3,), 1.0, 1.0)
