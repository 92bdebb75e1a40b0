"""Smoke run of configs/banded_transformer.yaml: independent vs banded noise at equal ε (docs/algorithms.md §7)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest
from example_loader import load_example

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "banded_transformer.yaml"
HEAD = ("max_grad_norm: 1\ndelta: 1.0e-5\nbatch_size: 8\nseq_len: 8\nd_model: 8\nn_layers: 1\n"
        "n_heads: 2\nsteps: 2\neval_every: 1\neval_windows: 4\nseeds: [0]\n")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("transformer_variants.py", "transformer_variants_banded")


def _rows(text: str, labels: list[str]) -> dict[str, list[str]]:
    rows = {}
    for label in labels:
        line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        rows[label] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


@pytest.mark.slow  # ≈ 11 s: the 2 × 2 runs (make test-all); its config and row checks stay in the suite
def test_smoke_run_calibrates_each_noise_to_the_same_epsilon(example: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "bt.md"
    (tmp_path / "bt.md").write_text(f"old page\n{example.READING_MARKER}\nmy reading\n")
    assert example.main(["--config", str(CONFIG), "--smoke", "--out", str(out)]) == out
    text = out.read_text()
    assert "old page" not in text and text.rstrip().endswith("my reading")  # the hand-written part is kept
    smoke = example.load_setup(CONFIG, smoke=True)
    rows = _rows(text, [m.label for m in smoke.methods])
    sigma: dict[str, float] = {}
    for method in smoke.methods:
        noise, _, _, sigma_cell, eps_cell, loss_cell = rows[method.label][1:7]
        assert 0.0 < float(re.findall(r"\*\*([\d.]+) ± ", loss_cell)[0]) < 10.0  # ln 256 ≈ 5.5 at init
        assert float(eps_cell) == pytest.approx(smoke.target_epsilon, rel=2e-3)  # realised from the ledger
        sigma[noise] = float(sigma_cell)
    # Equal ε: the banded rows pay for ⌈T/b⌉ rounds at the b-times larger group rate with a larger σ.
    assert set(sigma) == {"independent", "banded, b = 8"}
    assert sigma["banded, b = 8"] > sigma["independent"] > 0
    assert (tmp_path / "bt.png").stat().st_size > 1000
    assert '"sigma"' in (tmp_path / "bt.json").read_text()


def test_full_config_is_the_two_by_two_at_one_epsilon(example: ModuleType) -> None:
    full = example.load_setup(CONFIG)
    assert len(full.seeds) >= 3 and full.sigma is None and full.target_epsilon is not None
    cells = {(m.variant, example.privacy_kwargs(full, m)["noise"]) for m in full.methods}
    assert cells == {(v, n) for v in ("post_processing", "scale_then_privatize") for n in ("gaussian", "banded")}
    for method in full.methods:
        kwargs = example.privacy_kwargs(full, method)
        assert kwargs["target_epsilon"] == full.target_epsilon and kwargs["target_delta"] == full.delta
        assert full.steps / kwargs["bands"] >= 10  # many rounds per run, not a few-rounds corner
    assert not example.fixed_sigma_gaussian(full)
    assert example.fixed_sigma_gaussian(example.load_setup(example.DEFAULT_CONFIG))  # the variants page is unchanged


def test_row_privacy_overrides_the_config(example: ModuleType, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(HEAD + "target_epsilon: 3\nnoise: banded\nbands: 4\nmethods:\n"
                   "  - {label: a, optimizer: adam, lr: 0.1}\n"
                   "  - {label: b, optimizer: adam, lr: 0.1, noise: gaussian, sigma: 2}\n")
    setup = example.load_setup(cfg)
    a, b = (example.privacy_kwargs(setup, m) for m in setup.methods)
    assert a == {"noise": "banded", "bands": 4, "max_grad_norm": 1.0, "target_epsilon": 3.0, "target_delta": 1e-5}
    assert b == {"noise": "gaussian", "bands": 1, "max_grad_norm": 1.0, "noise_multiplier": 2.0}


@pytest.mark.parametrize(
    ("top", "row", "message"),
    [
        ("sigma: 1\ntarget_epsilon: 3\n", "", "not both"),
        ("target_epsilon: 3\n", ", sigma: 1, target_epsilon: 2", "not both"),
        ("sigma: 1\n", ", noise: laplace", "noise must be one of"),
        ("sigma: 1\n", ", bands: 4", "bands must be 1 for gaussian"),
        ("sigma: 1\nnoise: banded\nbands: 4\n", ", variant: independent_moments", "needs noise: gaussian"),
        ("", "", "set sigma or target_epsilon"),
        ("sigma: 1\nbands: 8\n", "", "bands > 1 needs noise: banded"),
        ("target_epsilon: -1\n", "", "target_epsilon must be"),
    ],
)
def test_bad_privacy_rows_name_the_fix(example: ModuleType, tmp_path: Path, top: str, row: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(HEAD + top + "methods:\n  - {label: x, optimizer: adam, lr: 0.1" + row + "}\n")
    with pytest.raises(ValueError, match=message):
        example.load_setup(cfg)
