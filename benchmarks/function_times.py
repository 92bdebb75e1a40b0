"""Inclusive time per private step of named functions, without a profiler (issue 38). Run by hand from the repository
root:

    PYTHONPATH=. python benchmarks/function_times.py --model digits --batch 2 --steps 400 \
        lightning_dp.grad_sample.ghost:GhostEngine.clip_and_sum lightning_dp.validators.kept_state:StateFingerprint.take

Each ``module:function`` or ``module:Class.method`` is wrapped in a ``perf_counter_ns`` pair (≈ 0.3 µs a call), the
wrapper set on that module or class, so only the calls that look it up there are counted (a name imported into
another module before the wrapping keeps the original: wrap it where it is called, ``lightning_dp.grad_sample.ghost:
clip_from_parts``). cProfile charges 0.5–1 µs to every Python call and makes a function of many small calls look
several times its cost (benchmarks/engine_python.py says where the calls are; this says what they cost). The loop is
benchmarks/cost_floor.py's (``PrivateStep``, ghost engine, Adam, noise drawn at the release); the non-private step
runs beside it in each round. Printed: both steps' medians, then each function's calls and mean µs a step. Compare
changes paired (ab_revisions.py), not across runs of this script.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_floor as cf  # noqa: E402


CLOCK_NS: list[Callable[[], int]] = [time.perf_counter_ns]
"""The clock every time is read from: the wall clock, or with ``--cpu`` this thread's CPU time (the scheduler's pauses
on a shared machine left out, as ``ab_revisions.py --cpu``)."""


def wrap(spec: str, spent: dict[str, list[int]]) -> None:
    """Replace ``module:name`` or ``module:Class.name`` by a wrapper adding its calls and ns to ``spent[spec]``."""
    module_name, _, qualified = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, attribute = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn: Callable[..., Any] = getattr(owner, attribute)
    tally = spent.setdefault(spec, [0, 0])

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = CLOCK_NS[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            tally[0] += 1
            tally[1] += CLOCK_NS[0]() - start

    setattr(owner, attribute, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("functions", nargs="+", help="module:function or module:Class.method")
    ap.add_argument("--model", default="digits", choices=(*cf.MODELS, *cf.EXTRA_MODELS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="this thread's CPU time instead of the wall clock")
    args = ap.parse_args()
    if args.cpu:
        CLOCK_NS[0] = time.thread_time_ns
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    spent: dict[str, list[int]] = {}
    for spec in args.functions:
        wrap(spec, spent)
    model, tokens, data = cf.build(args.model, args.batch)
    private = cf.ldp(False)(model, tokens, data, args.batch)
    other, _, _ = cf.build(args.model, args.batch)
    plain = cf.nonprivate(other, tokens, data, args.batch)
    for _ in range(30):  # warm-up: the first step's probe and checks
        private.prepare()  # type: ignore[attr-defined]
        private()
        plain()
    for tally in spent.values():
        tally[:] = [0, 0]
    times: dict[str, list[float]] = {"private": [], "non-private": []}
    for _ in range(args.steps):
        private.prepare()  # type: ignore[attr-defined]  # the next Poisson batch, not timed
        for name, step in (("private", private), ("non-private", plain)):
            start = CLOCK_NS[0]()
            step()
            times[name].append((CLOCK_NS[0]() - start) * 1e-9)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"{args.model}, batch {args.batch}: private {medians['private']:.3f} ms, non-private "
          f"{medians['non-private']:.3f} ms (medians of {args.steps} steps)")
    print(f"{'function':70s} {'calls':>6s} {'µs a step':>10s}")
    for spec, (calls, ns) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
        print(f"{spec:70s} {calls / args.steps:6.1f} {ns / args.steps / 1e3:10.1f}")


if __name__ == "__main__":
    main()
