"""Training-time overhead of SecondMomentMonitor on the digits example (issue 5: ≤ 5 % at n = 50). Run by hand:

    python benchmarks/monitor_overhead.py                          # 300 steps, 3 rounds, every_n_steps=50
    python benchmarks/monitor_overhead.py --steps 500 --rounds 5 --diagnostics non_private

Trains ``DigitsCNN(optimizer="adam")`` on ``DigitsDataModule`` under ``DPStrategy`` with a
TensorBoard logger, without and with the monitor, alternating the two in each round so
a busy machine slows both alike. Time is measured from the end of a warm-up step to the
end of the last step (setup, data loading and the first steps excluded). Prints
the median ms/step of each, the ratio with/without, and the time spent inside the
monitor's own hook per step (a direct measure, less exposed to machine noise).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN
from lightning_dp.strategy import DPStrategy


class TimedMonitor(SecondMomentMonitor):
    """The monitor, timing its own hooks (a direct, less noisy measure of its cost)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    def on_train_batch_end(self, *args, **kwargs):
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.seconds += time.perf_counter() - start


class StepClock(Callback):
    """Wall time between the end of step ``warmup`` and the end of the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        if trainer.global_step == self.warmup:
            self.start = now
        self.end, self.steps = now, trainer.global_step - self.warmup

    @property
    def ms_per_step(self) -> float:
        return 1000 * (self.end - self.start) / max(self.steps, 1)


def run(steps: int, warmup: int, monitor: SecondMomentMonitor | None, logdir: str) -> float:
    """ms/step of one training run (monitor ``None``: without it)."""
    pl.seed_everything(0, verbose=False)
    clock = StepClock(warmup)
    callbacks = [monitor, clock] if monitor is not None else [clock]
    trainer = pl.Trainer(
        strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), accelerator="cpu", devices=1,
        max_steps=steps, logger=TensorBoardLogger(logdir), callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(DigitsCNN(optimizer="adam", lr=1e-3), DigitsDataModule(batch_size=64))
    return clock.ms_per_step


def main() -> None:
    """Parse arguments, run the rounds, print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--diagnostics", default="private", choices=("private", "non_private"))
    p.add_argument("--no-histograms", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    base, with_monitor, hook_ms = [], [], []
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.rounds):
            monitor = TimedMonitor(args.every_n_steps, args.diagnostics, histograms=not args.no_histograms)
            pair = [("without", None), ("with", monitor)]
            for name, cb in pair if r % 2 == 0 else pair[::-1]:
                ms = run(args.steps, args.warmup, cb, logdir)
                (base if cb is None else with_monitor).append(ms)
                if cb is not None:
                    hook_ms.append(1000 * cb.seconds / args.steps)
                print(f"round {r + 1}: {name:<7} monitor {ms:7.2f} ms/step")
    b, w = statistics.median(base), statistics.median(with_monitor)
    print(f"\nDigitsCNN(adam), DPStrategy(σ=1), batch 64, {args.steps} steps, every_n_steps={args.every_n_steps}, "
          f"diagnostics={args.diagnostics}, histograms={not args.no_histograms}")
    print(f"median without monitor: {b:.2f} ms/step")
    print(f"median with monitor:    {w:.2f} ms/step")
    print(f"time inside the monitor's hooks: {statistics.median(hook_ms):.3f} ms/step "
          f"({100 * statistics.median(hook_ms) / b:.2f} % of a step without it)")
    print(f"ratio with/without:     {w / b:.4f}  (overhead {100 * (w / b - 1):+.2f} %; target <= +5 %)")


if __name__ == "__main__":
    main()
