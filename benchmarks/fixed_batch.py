"""Fixed-shape batches and torch.compile on CPU (issue 38): what padding costs and what compiling buys. Run by hand:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/fixed_batch.py --threads 1 --models mlp,digits

Per model, a plain loop of the private step (ghost engine, the library's Privatizer, SGD) in four modes, timed
interleaved in one process (one step of each in turn; medians, and medians of per-round ratios):

* ``poisson``: eager, each step's batch of Poisson size n (B ± √B rows: new shapes every step);
* ``padded``: eager, every batch padded to F = B + 3√B rows (``fixed_batch_size``: padding rows' clip factor 0);
* ``compiled``: ``torch.compile(model)`` on the padded batches (one shape: compiled once);
* ``compiled_poisson``: ``torch.compile(model)`` on the Poisson batches (dynamic shapes after the first recompile);

and the non-private step at Poisson shapes, eager and compiled, for the ratios. Compile time (the first steps) is
reported apart. The engine's hooks run around the compiled layers (graph breaks at each hooked layer), so what
compiles is what lies between them.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402  (the models of benchmarks/speed.py)

from lightning_dp.grad_sample import make_engine

from lightning_dp.privacy.noise import GaussianNoise

from lightning_dp.privacy.privatizer import Privatizer

from lightning_dp.privacy.release import DEFAULT_REQUEST


def private_step(model: torch.nn.Module, loss_fn, fixed: bool, compiled: bool, batch: int) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """One private step on (x, y) holding n examples then padding rows (``fixed``), as DPStrategy runs it."""
    engine = make_engine("ghost")
    engine.attach(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    privatizer = Privatizer(GaussianNoise())
    forward = torch.compile(model) if compiled else model

    def step(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
        opt.zero_grad(set_to_none=True)
        engine.begin_step(len(x))
        loss_fn(forward, x, y).backward()
        engine.padding_rows = len(x) - n
        out = engine.clip_and_sum(params, 1.0)
        engine.padding_rows = 0
        privatizer.privatize(out, params, DEFAULT_REQUEST, 1.0, 1.0, float(batch))
        opt.step()

    return step


def nonprivate_step(model: torch.nn.Module, loss_fn, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compiled else model

    def step(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(forward, x[:n], y[:n]).backward()
        opt.step()

    return step


def run(name: str, args: argparse.Namespace) -> None:
    B = args.batch
    F = B + math.ceil(3 * math.sqrt(B))
    _, loss_fn, (x_all, y_all) = speed.build(name, 4 * F, torch.device("cpu"))
    modes = {
        "np_eager": (False, False, None), "np_compiled": (False, True, None),
        "poisson": (True, False, False), "padded": (True, False, True),
        "compiled": (True, True, True), "compiled_poisson": (True, True, False),
    }
    steps, fixed_of = {}, {}
    for mode, (private, compiled, fixed) in modes.items():
        model, _, _ = speed.build(name, 1, torch.device("cpu"))
        steps[mode] = private_step(model, loss_fn, fixed, compiled, B) if private else nonprivate_step(model, loss_fn, compiled)
        fixed_of[mode] = fixed
    gen = torch.Generator().manual_seed(0)
    sizes = torch.distributions.Binomial(4 * F, torch.tensor(B / (4 * F))).sample((args.warmup + args.steps,)).int().tolist()
    times: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, float] = {}
    for i, n in enumerate(sizes):
        n = min(max(n, 1), F)
        rows = torch.randperm(4 * F, generator=gen)[:n]
        pad = torch.zeros(F - n, *x_all.shape[1:], dtype=x_all.dtype)
        xp, yp = torch.cat([x_all[rows], pad]), torch.cat([y_all[rows], torch.zeros(F - n, *y_all.shape[1:], dtype=y_all.dtype)])
        for mode, step in steps.items():
            x, y = (xp, yp) if fixed_of[mode] else (x_all[rows], y_all[rows])
            t0 = time.perf_counter()
            step(x, y, n)
            dt = time.perf_counter() - t0
            if i == 0:
                first[mode] = dt
            elif i >= args.warmup:
                times[mode].append(dt * 1e3)
    med = {m: statistics.median(v) for m, v in times.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"\n== {name}: expected batch {B}, F = {F}, {torch.get_num_threads()} thread(s), {args.steps} steps ==")
    for m in modes:
        print(f"{m:<17}{med[m]:8.2f} ms   first step (compile) {first[m]:7.2f} s")
    print(f"padded/poisson {paired('padded', 'poisson'):.3f}   compiled/padded {paired('compiled', 'padded'):.3f}   "
          f"compiled/poisson {paired('compiled', 'poisson'):.3f}   compiled_poisson/poisson "
          f"{paired('compiled_poisson', 'poisson'):.3f}   np_compiled/np_eager {paired('np_compiled', 'np_eager'):.3f}")
    print(f"private/non-private (eager, Poisson) {paired('poisson', 'np_eager'):.2f}; best private "
          f"{min(med[m] for m in ('poisson', 'padded', 'compiled', 'compiled_poisson')):.2f} ms vs non-private eager "
          f"{med['np_eager']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,digits")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        run(name, args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
