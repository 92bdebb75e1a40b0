"""Speed of the accounting layer (run by hand: ``python benchmarks/accounting.py``).

Prints:
1. ε for 10^5 steps (RDP; target ≤ 50 ms), cold cache and warm;
2. calibration time (RDP; target ≤ 2 s), and for PRV/PLD;
3. per-step overhead of PrivacyBudget under DPStrategy (target ≤ 1 % of a step) on the digits
   example (DigitsCNN, channels 16, B = 64, as configs/digits.yaml) and, as a harsher case, on a
   tiny digits MLP whose step is ~4× cheaper; with σ constant, with σ or q changing every step
   on a schedule, with both jittering randomly, all with the default rdp_curve="auto", and a
   schedule with rdp_curve="exact" (every σ exact) and with rdp_curve="exact", rdp_quantum=5e-3
   (exact once per 0.5 % grid cell, docs/accounting.md's tight setting for σ < 1 schedules). σ and q are changed through the strategy's private
   ``_noise_multiplier`` / ``_sample_rate`` (benchmark only).
4. σ needed at ε = 1 by each accountant (the issue's comparison with the DP-SignSGD grid).
"""

from __future__ import annotations

import statistics
import dataclasses
import time
import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import calibrate_noise, epsilon
from lightning_dp.accounting.rdp import STEP_CACHE
from lightning_dp.callbacks.privacy_budget import PrivacyBudget
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN
from lightning_dp.strategy import DPStrategy

STEPS = 500


def timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


class Digits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class TimedBudget(PrivacyBudget):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls: list[float] = []

    @property
    def seconds(self) -> float:
        return sum(self.calls)

    def on_train_batch_end(self, *args, **kw):
        t = time.perf_counter()
        super().on_train_batch_end(*args, **kw)
        self.calls.append(time.perf_counter() - t)


class Schedule(Callback):
    """A new σ and/or q before every step (through the strategy's private fields; benchmark only).

    ``"sigma"``: σ decays smoothly 1.2 → 1.0 (a noise schedule); ``"q"``: q ramps up 0.5 → 1×
    (a batch-size warm-up); ``"jitter"``: σ drifts and q jumps randomly by up to 10 % every step
    (adversarial: almost no two steps share a grid cell).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strategy, t = trainer.strategy, trainer.global_step / STEPS
        if not hasattr(self, "q0"):
            self.q0 = strategy.sample_rate
        if self.kind in ("sigma", "jitter"):
            strategy.private_step.noise_multiplier = 1.2 - 0.2 * t
        if self.kind == "q":
            _set_rate(strategy, self.q0 * (0.5 + 0.5 * t))
        if self.kind == "jitter":
            _set_rate(strategy, self.q0 * (1.0 + 0.1 * ((trainer.global_step * 7919) % 101) / 101))


def _set_rate(strategy, rate: float) -> None:
    """Charge the ledger at another q (a benchmark of the accountant only: the sampler keeps its rate)."""
    step = strategy.private_step
    step.plan = dataclasses.replace(step.plan, sample_rate=rate)


class StepClock(Callback):
    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.t0


def digits_run(model: str, callbacks) -> float:
    clock = StepClock()
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), accelerator="cpu", devices=1,
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[*callbacks, clock])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model == "digits CNN (the example)":
            trainer.fit(DigitsCNN(lr=0.01, optimizer="adam", channels=16), datamodule=DigitsDataModule(batch_size=64))
        else:
            x, y = load_digits(return_X_y=True)
            data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
            trainer.fit(Digits(), DataLoader(data, batch_size=64))
    return clock.seconds / STEPS


def main() -> None:
    torch.set_num_threads(1)
    STEP_CACHE.clear()
    eps, cold = timed(epsilon, 1.1, 0.004, 10**5, 1e-5)
    _, warm = timed(epsilon, 1.1, 0.004, 10**5, 1e-5)
    print(f"epsilon(σ=1.1, q=0.004, T=1e5) = {eps:.4f}: {cold * 1e3:.1f} ms cold, {warm * 1e3:.3f} ms cached "
          f"(target ≤ 50 ms)")
    for acc in ("rdp", "prv", "pld"):
        STEP_CACHE.clear()
        sigma, t = timed(calibrate_noise, 3.0, 1e-5, 0.004, 14000, acc)
        print(f"calibrate_noise(ε=3, q=0.004, T=14000, {acc}) = {sigma:.4f}: {t:.2f} s (target ≤ 2 s for rdp)")

    for model in ("digits CNN (the example)", "tiny digits MLP"):
        print(f"{model}: DP step without the callback {digits_run(model, []) * 1e3:.2f} ms")
        for label, extra, kw in [("σ constant", [], {}),
                                 ("σ decays every step", [Schedule("sigma")], {}),
                                 ("q ramps every step", [Schedule("q")], {}),
                                 ("σ, q jitter every step (adversarial)", [Schedule("jitter")], {}),
                                 ("σ decays every step, rdp_curve='exact'", [Schedule("sigma")],
                                  {"rdp_curve": "exact"}),
                                 ("σ decays every step, rdp_curve='exact', rdp_quantum=5e-3", [Schedule("sigma")],
                                  {"rdp_curve": "exact", "rdp_quantum": 5e-3})]:
            STEP_CACHE.clear()
            budget = TimedBudget(target_epsilon=1e3, delta=1e-5, **kw)
            step = digits_run(model, [*extra, budget])
            hook = budget.seconds / STEPS
            # relative to the rest of the same run's step: robust to load changing between runs
            median = statistics.median(budget.calls)
            print(f"  PrivacyBudget, {label}: {hook * 1e6:.0f} µs per step in the hook (median {median * 1e6:.0f}) = "
                  f"{100 * hook / (step - hook):.2f} % of the rest of the step (target ≤ 1 %); "
                  f"step with callback {step * 1e3:.2f} ms")

    print("σ needed at ε = 1, δ = 1e-5 (relative to the paper's integer grid / to RDP):")
    for q, steps in [(1 / 300, 1000), (0.01, 1000), (0.004, 14000)]:
        s = {a: calibrate_noise(1.0, 1e-5, q, steps, a, rtol=1e-3) for a in ("integer_rdp", "rdp", "prv", "pld")}
        cells = ", ".join(f"{a} {v:.4f}" for a, v in s.items())
        print(f"  q={q:.4g}, T={steps}: {cells}; pld needs {100 * (1 - s['pld'] / s['integer_rdp']):.1f} % less "
              f"than the grid, {100 * (1 - s['pld'] / s['rdp']):.1f} % less than RDP")


if __name__ == "__main__":
    main()
