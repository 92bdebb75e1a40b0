"""Smoke run of examples/sparse_logreg.py, and checks of its vectorised use of the mechanism."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_dp.privacy.noise import GaussianNoise

from lightning_dp.privacy.privatizer import Privatizer

from lightning_dp.privacy.release import MechanismRequest
from lightning_dp.grad_sample.base import clip_and_sum_materialised
from example_loader import load_example



@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("sparse_logreg.py", "sparse_logreg")


def test_smoke_run_writes_the_table(example: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "sparse.md"
    assert example.main(["--smoke", "--out", str(out)]) == out
    text = out.read_text()
    setup = example.load_setup(example.DEFAULT_CONFIG)
    for method in setup.methods:
        row = next(line for line in text.splitlines() if line.startswith(f"| {method.label} |"))
        mean, sem = (float(v) for v in re.findall(r"\*\*([\d.]+) ± ([\d.]+)\*\*", row)[0])
        assert 0.4 < mean < 1.5 and sem >= 0.0
    assert "| ground truth (w = w*) |" in text and "2 trials" in text
    assert setup.trials == 30 and len(setup.sigmas) >= 1 and {m.kind for m in setup.methods} >= {"nonprivate", "post_processing",
                                                                          "independent_moments"}


def test_example_gradient_is_the_logistic_gradient(example: ModuleType) -> None:
    w = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([1.5, 0.0, -0.7], dtype=torch.float64)
    y = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    torch.nn.functional.softplus(-y * w * x).sum().backward()
    assert torch.allclose(example.example_gradient(w.detach(), x, y), w.grad)


def test_vectorised_nonprivate_run_equals_scalar_adagrad(example: ModuleType) -> None:
    setup = example.load_setup(example.DEFAULT_CONFIG)
    method = example.Method("np", "nonprivate", {"lr": [0.1, 1.0]})
    gen = torch.Generator().manual_seed(3)
    data = [example.sample(40, 1.0, gen, 0.5) for _ in range(3)]
    x, y = torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])
    w = example.train(method, [0.1, 1.0], None, x, y, setup, 1.0, noise_seed=0)
    for k, lr in enumerate([0.1, 1.0]):
        for t in range(3):
            p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adagrad([p], lr=lr, eps=1e-10)
            for xi, yi in zip(x[t], y[t]):
                opt.zero_grad()
                torch.nn.functional.softplus(-yi * p * xi).sum().backward()
                opt.step()
            assert float(w[k, t]) == pytest.approx(float(p), rel=1e-9, abs=1e-12)


def test_one_hot_rows_clip_each_model_separately(example: ModuleType) -> None:
    grads = torch.tensor([[3.0, -0.5], [0.2, -4.0]], dtype=torch.float64)  # [L=2, T=2]
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(2)]
    samples = [example.one_hot_rows(grads, k, 2) for k in range(2)]
    batch = clip_and_sum_materialised(params, samples, 1.0, with_squares=True)
    assert torch.allclose(batch.sums[params[0]], torch.tensor([1.0, -0.5], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(batch.sums[params[1]], torch.tensor([0.2, -1.0], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(batch.square_sums[params[1]], torch.tensor([0.04, 1.0], dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("second_moment, noise_scale, factor", [(False, 1.0, 1.0), (True, 1.0, 2 ** 0.5),
                                                                 (True, 2 ** -0.5, 1.0)])
def test_noise_per_coordinate_has_the_mechanisms_std(example: ModuleType, second_moment: bool, noise_scale: float,
                                                     factor: float) -> None:
    """Zero gradients: ĝ is pure noise with std σC·factor per model (√2 when the budget is split)."""
    sigma, C, T, draws = 0.7, 2.0, 1000, 20
    params = [torch.nn.Parameter(torch.zeros(T, dtype=torch.float64))]
    samples = [example.one_hot_rows(torch.zeros(1, T, dtype=torch.float64), 0, 1)]
    privatizer = Privatizer(GaussianNoise(seed=5))
    grads, seconds = [], []
    for _ in range(draws):
        batch = clip_and_sum_materialised(params, samples, C, with_squares=second_moment)
        release = privatizer.privatize(batch, params, MechanismRequest(second_moment=second_moment),
                                       sigma * noise_scale, C, 1.0)
        grads.append(params[0].grad.clone())
        if second_moment:
            seconds.append(release.second_moment[params[0]])
    assert float(torch.cat(grads).std()) == pytest.approx(sigma * C * factor, rel=0.03)  # 3 % ≈ 6 s.e. at n = 20 000
    assert release.noise_std == pytest.approx(sigma * C * factor)
    if second_moment:
        assert float(torch.cat(seconds).std()) == pytest.approx(sigma * C**2 * factor, rel=0.03)


def test_config_errors_name_the_fix(example: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("w_star: 1\nn_train: 10\nzero_fraction: 0.5\nn_eval: 10\nsigma: 1\nmax_grad_norm: 1\ntrials: 1\n"
                   "methods:\n  - {label: x, kind: adam, grid: {lr: [1]}}\n")
    with pytest.raises(ValueError, match="kind must be one of"):
        example.load_setup(bad)
    bad.write_text(bad.read_text().replace("kind: adam, grid: {lr: [1]}", "kind: post_processing, grid: {gamma: [1]}"))
    with pytest.raises(ValueError, match="`lr` list"):
        example.load_setup(bad)
