"""The late-write watch's cost (issue 38, judged29's ``_Judge.watched``): a user hook that wrote nothing at its first
call is fingerprinted before and after each later call. Run by hand from the repository root:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/silent_hooks.py --callbacks 3 --steps 60 --ab

A :class:`~lightning_dp.DPStrategy` fit of ``deep_overhead.py``'s 48 × [Linear(64, 64), LayerNorm, GELU] stack (or
``--layers``) with ``--callbacks`` user callbacks, each silent in ``on_before_optimizer_step``, ``on_before_zero_grad``
and ``on_train_batch_end`` (three watched calls a step each). Timed in this thread's CPU time: each watched call, the
hook's own run left out (what the watch costs), and each step (one ``on_train_batch_start`` to the next). Printed: the
watched calls a step, their median µs each and a step, and the step's median (the first ``--skip`` steps left out:
their hooks are judged, not watched). Both numbers come from the same steps of one fit. With ``--ab``, every other
step runs without the shared fingerprints (:mod:`lightning_dp.fingerprints.adjacent_hooks` answering "cannot"), and
the paired differences of consecutive steps are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deep_overhead  # noqa: E402


class Deep(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = deep_overhead.stack(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Silent(pl.Callback):
    """Reads, never writes (a monitor that prints or raises only when something is off)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        assert trainer.global_step >= 0

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        assert trainer.global_step >= 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert trainer.global_step >= 0


class StepClock(pl.Callback):
    """Each step's CPU time, batch start to batch start (a library-free callback: no hook of HOOKS)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.thread_time())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--callbacks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--ab", action="store_true", help="steps alternately without the shared fingerprints: paired")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning_dp import DPStrategy
    from lightning_dp.validators import judged_writes
    from lightning_dp.validators.hook_replays import replaying_now
    from lightning_dp.validators.kept_state import StateFingerprint

    watched: list[list[float]] = [[]]  # per step: each watched call's CPU time less its hook's
    original = judged_writes._Judge.watched

    def timed(self: Any, hook: Any, owner: Any, name: str, hook_args: tuple, kwargs: dict, *rest: Any) -> Any:
        spent = [0.0]

        def run(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return hook(*a, **k)
            finally:
                spent[0] += time.thread_time() - t
        t0 = time.thread_time()
        try:
            return original(self, run, owner, name, hook_args, kwargs, *rest)
        finally:
            watched[-1].append(time.thread_time() - t0 - spent[0])

    judged_writes._Judge.watched = timed  # type: ignore[method-assign]
    takes = [0]
    take = StateFingerprint.take

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        takes[0] += 1
        return take(self, *a, **k)
    StateFingerprint.take = counted  # type: ignore[method-assign]
    clock = StepClock()

    shared = judged_writes.only_the_loop_between
    modes: list[bool] = []  # per step: whether the chain of watched calls may share fingerprints

    class NextStep(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            if replaying_now():  # (the first steps' replays run this hook again)
                return
            watched.append([])
            share = not args.ab or len(modes) % 2 == 0
            modes.append(share)
            judged_writes.only_the_loop_between = shared if share else (lambda *_: False)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch * 16, 64, generator=g)
    data = TensorDataset(x, torch.randint(0, 10, (len(x),), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_steps=args.steps,
                         callbacks=[clock, NextStep(), *(Silent() for _ in range(args.callbacks))],
                         strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0))
    trainer.fit(Deep(args.layers), DataLoader(data, batch_size=args.batch))
    judged_writes._Judge.watched = original  # type: ignore[method-assign]
    judged_writes.only_the_loop_between = shared
    StateFingerprint.take = take  # type: ignore[method-assign]

    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:])][args.skip:]
    calls = [w for w in watched[1:][args.skip:-1] if w]
    each = [c for w in calls for c in w]
    per_step = [sum(w) for w in calls]
    print(f"{args.layers} layers, batch {args.batch}, {args.callbacks} silent callbacks, {len(steps)} steps")
    print(f"watched calls a step: {statistics.median(map(len, calls)) if calls else 0}")
    if each:
        print(f"a watched call (less its hook): median {statistics.median(each) * 1e6:.0f} µs; a step's: median "
              f"{statistics.median(per_step) * 1e3:.3f} ms")
    print(f"fingerprints taken in the fit (all callers): {takes[0]} ({takes[0] / args.steps:.1f} a step)")
    print(f"step: median {statistics.median(steps) * 1e3:.3f} ms (CPU time)")
    if args.ab:  # consecutive steps (shared, not shared): not shared − shared, positive: sharing is faster
        durations = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
        spent = [sum(w) for w in watched[1:]]
        pairs = [k for k in range(args.skip, len(durations) - 1) if modes[k] and not modes[k + 1]]
        for label, values in (("step", durations), ("watched calls a step", spent)):
            diffs = sorted((values[k + 1] - values[k]) * 1e3 for k in pairs)
            q = statistics.quantiles(diffs, n=4)
            print(f"{label}: unshared − shared median {statistics.median(diffs):.3f} ms (quartiles {q[0]:.3f} .. "
                  f"{q[2]:.3f}), {len(diffs)} pairs")


if __name__ == "__main__":
    main()
