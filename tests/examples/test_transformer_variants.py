"""Smoke run of examples/transformer_variants.py, and its v̂ − Φ share (design-principles Fig. 4)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from example_loader import load_example

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdam



@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("transformer_variants.py", "transformer_variants")


@pytest.mark.slow  # ≈ 9 s (make test-all); the variants themselves: tests/callbacks, its config checks stay
def test_smoke_run_writes_table_and_plot(example: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "tv.md"
    assert example.main(["--smoke", "--out", str(out)]) == out
    text = out.read_text()
    smoke = example.load_setup(example.DEFAULT_CONFIG, smoke=True)
    for method in smoke.methods:
        row = next(line for line in text.splitlines() if line.startswith(f"| {method.label} |"))
        loss = float(re.findall(r"\*\*([\d.]+) ± ([\d.]+)\*\*", row)[0][0])
        assert 0.0 < loss < 10.0  # nats/token; ln 256 ≈ 5.5 at initialisation
        cells = [c.strip() for c in row.strip("|").split("|")]
        if method.variant in ("post_processing", "bias_corrected"):
            assert cells[5].endswith("%") and 0.0 <= float(cells[5].rstrip(" %")) <= 100.0
    assert (tmp_path / "tv.png").stat().st_size > 1000
    assert '"val_loss"' in (tmp_path / "tv.json").read_text()  # raw curves kept for re-plotting
    full = example.load_setup(example.DEFAULT_CONFIG)
    assert len(full.seeds) >= 3
    assert {m.variant for m in full.methods} >= {"post_processing", "bias_corrected", "independent_moments",
                                                 "scale_then_privatize", "noiseless"}
    assert any(m.optimizer == "sgd" and m.momentum > 0 and m.private for m in full.methods)


def _adam_with_state(variant: str, v_raw: list[float], step: int) -> tuple[DPAdam, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros(len(v_raw)))
    opt = DPAdam([p], lr=1e-3, betas=(0.9, 0.99), variant=variant)
    opt.state[p] = {"step": step, "exp_avg": torch.zeros(len(v_raw)), "exp_avg_sq": torch.tensor(v_raw)}
    return opt, p


def test_negative_fraction_bias_corrects_v_before_subtracting_phi(example: ModuleType) -> None:
    # step 1, β2 = 0.99: v̂ = v / 0.01 = [1, 2, 3, 4]; Φ = 2.5 -> half the coordinates negative.
    opt, _ = _adam_with_state("bias_corrected", [0.01, 0.02, 0.03, 0.04], step=1)
    release = Release(noise_std=2.5**0.5, expected_batch_size=1.0, noise_multiplier=1.0, max_grad_norm=1.0)
    assert example.negative_fraction(opt, release) == pytest.approx(0.5)
    # independent moments: v̂ is unbiased, Φ is not subtracted; only negative v̂ count.
    opt, _ = _adam_with_state("independent_moments", [-0.01, 0.02, 0.03, 0.04], step=1)
    assert example.negative_fraction(opt, release) == pytest.approx(0.25)
    # scale-then-privatize: Φ per coordinate is noise_std² / s².
    opt, p = _adam_with_state("scale_then_privatize", [0.01, 0.02, 0.03, 0.04], step=1)
    scaled = Release(noise_std=2.5**0.5, expected_batch_size=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                     scale={p: torch.tensor([1.0, 10.0, 1.0, 10.0])})
    assert example.negative_fraction(opt, scaled) == pytest.approx(0.25)


def test_negative_fraction_is_none_without_dp_adam_or_release(example: ModuleType) -> None:
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    release = Release(noise_std=1.0, expected_batch_size=1.0, noise_multiplier=1.0, max_grad_norm=1.0)
    assert example.negative_fraction(sgd, release) is None
    opt, _ = _adam_with_state("post_processing", [1.0, 1.0], step=3)
    assert example.negative_fraction(opt, None) is None


def test_config_errors_name_the_fix(example: ModuleType, tmp_path: Path) -> None:
    head = ("sigma: 1\nmax_grad_norm: 1\ndelta: 1.0e-5\nbatch_size: 8\nseq_len: 8\nd_model: 8\nn_layers: 1\n"
            "n_heads: 2\nsteps: 2\neval_every: 1\neval_windows: 4\nseeds: [0]\nmethods:\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(head + "  - {label: x, optimizer: adam, lr: 0.1, gamma: 1.0e-8}\n")
    with pytest.raises(ValueError, match="under `hparams`"):
        example.load_setup(bad)
    bad.write_text(head + "  - {label: x, optimizer: sgd, variant: bias_corrected, lr: 0.1}\n")
    with pytest.raises(ValueError, match="optimizer: adam"):
        example.load_setup(bad)
    bad.write_text(head.replace("sigma: 1", "sigma: 0") + "  - {label: x, optimizer: sgd, lr: 0.1}\n")
    with pytest.raises(ValueError, match="sigma"):
        example.load_setup(bad)
