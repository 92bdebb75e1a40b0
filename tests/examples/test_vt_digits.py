"""examples/vt_digits.py: the table's numbers are the run's v̂, v^c and Φ, recomputed independently.

A recorder (the example's SecondMomentMonitor, subclassed) keeps, after every step, the raw
Adam state (``exp_avg_sq``, its step count and β2), the strategy's clean clipped mean ḡ and
σ, C, B. From those alone the test recomputes what the page must show: v̂ = v/(1−β2^t), the clean
EMA v^c of ḡ², Φ = (σC/B)², v̂ − Φ and the share of coordinates below Φ, and their min, quartiles,
max and mean, and compares them with the markdown table (printed to 4 significant digits).
"""

from __future__ import annotations

import functools

import re

import pytest
import torch
from example_loader import load_example

STATS = ("min", "q1", "median", "q3", "max", "mean")
REL = 1e-3  # the table prints 4 significant digits


def _summary(values: torch.Tensor) -> dict[str, float]:
    values = values.detach().reshape(-1).float()
    q1, median, q3 = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75])).tolist()
    return {"min": float(values.min()), "q1": q1, "median": median, "q3": q3, "max": float(values.max()),
            "mean": float(values.double().mean())}


def _table(text: str) -> dict[tuple[int, str], dict[str, float]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[(int(cells[0]), cells[1])] = dict(zip(STATS, map(float, cells[2:])))
    return rows


def _notes(text: str) -> dict[int, tuple[float, float]]:
    pattern = r"- step (\d+): Φ = (\S+), fraction of coordinates with v̂ − Φ < 0 = (\S+)"
    return {int(s): (float(phi), float(neg)) for s, phi, neg in re.findall(pattern, text)}


def test_table_holds_the_runs_second_moments(tmp_path, monkeypatch):
    module = load_example("vt_digits.py", "vt_digits")
    seen: dict[int, dict] = {}

    class Recorder(module.SecondMomentMonitor):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            (optimizer,) = trainer.optimizers
            params = [p for group in optimizer.param_groups for p in group["params"]]
            strategy = trainer.strategy
            seen[trainer.global_step] = {
                "v": [optimizer.state[p]["exp_avg_sq"].clone() for p in params],
                "t": [int(optimizer.state[p]["step"]) for p in params],
                "beta2": optimizer.param_groups[0]["betas"][1],
                "clean": [strategy.non_private_diagnostics.clean_mean[p].clone() for p in params],
                "phi": (strategy.noise_multiplier * strategy.max_grad_norm / strategy.expected_batch_size) ** 2,
            }

    monkeypatch.setattr(module, "SecondMomentMonitor", Recorder)
    # the recorder keeps the optimizer's state and the non-private diagnostics from on_train_batch_end: the test's
    # observer, declared public for the release boundary
    monkeypatch.setattr(module, "DPStrategy", functools.partial(module.DPStrategy, public_state=["Recorder"]))
    page = module.run(tmp_path, epochs=1, every=2, max_steps=4)
    text = page.read_text()
    assert "| step | series |" in text and "clean v (NOT private)" in text
    assert (tmp_path / "vt_digits.png").stat().st_size > 10_000
    assert sorted(seen) == [1, 2, 3, 4]

    clean_ema, beta2 = None, seen[1]["beta2"]
    expected: dict[tuple[int, str], dict[str, float]] = {}
    fractions: dict[int, float] = {}
    for step in sorted(seen):
        rec = seen[step]
        g = torch.cat([c.reshape(-1) for c in rec["clean"]]).double()
        clean_ema = (1 - beta2) * g**2 if clean_ema is None else beta2 * clean_ema + (1 - beta2) * g**2
        if step not in (1, 4):  # the table's early and late steps: the first and last logged
            continue
        assert set(rec["t"]) == {step}
        v_hat = torch.cat([v.reshape(-1) / (1 - beta2**step) for v in rec["v"]])
        expected[(step, "private v̂")] = _summary(v_hat)
        expected[(step, "corrected v̂ − Φ")] = _summary(v_hat - rec["phi"])
        expected[(step, "clean v (NOT private)")] = _summary(clean_ema / (1 - beta2**step))
        fractions[step] = float(((v_hat - rec["phi"]) < 0).double().mean())

    table = _table(text)
    assert sorted(table) == sorted(expected)
    for key, stats in expected.items():
        phi = seen[key[0]]["phi"]
        slack = REL * phi if key[1].startswith("corrected") else 0.0  # v̂ − Φ crosses 0
        for name in STATS:
            assert table[key][name] == pytest.approx(stats[name], rel=REL, abs=slack), (key, name)
    for step, (phi, negative) in _notes(text).items():
        assert phi == pytest.approx(seen[step]["phi"], rel=REL)
        assert negative == pytest.approx(fractions[step], abs=2e-4)  # 4 digits, and a float32 tie or two
    assert set(_notes(text)) == {1, 4}
    # invariants the numbers must keep whatever the run: second moments are ≥ 0, ordered stats
    for (step, series), stats in table.items():
        ordered = [stats[s] for s in ("min", "q1", "median", "q3", "max")]
        assert ordered == sorted(ordered) and stats["min"] <= stats["mean"] <= stats["max"]
        if series != "corrected v̂ − Φ":
            assert stats["min"] >= 0
