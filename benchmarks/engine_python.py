"""The clipping engine's Python per private step, by function (issue 38): cProfile over the steps of
benchmarks/cost_floor.py's loop (``PrivateStep``, ghost engine, Adam, noise drawn at the release), only the functions
whose file matches ``--match`` (default: ``grad_sample/`` and ``clipping/``). Run by hand from the repository root:

    PYTHONPATH=. python benchmarks/engine_python.py --model digits --batch 2 --steps 300

Printed per step: calls, self time (the function's own Python, and the arithmetic of its operators such as ``a @ b``,
which cProfile does not list apart) and cumulative time, in µs, sorted by self time. cProfile's per-call overhead
inflates small functions (a Python function costs ≈ 0.5–1 µs more under it than without): read the table for where
the time goes and how many calls there are, and measure any change paired (ab_revisions.py --phases). ``--ops`` adds
torch.profiler's table of the step's operators with their input shapes (record_shapes), by self CPU time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_floor as cf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits", choices=(*cf.MODELS, *cf.EXTRA_MODELS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--match", default=r"lightning_dp/(grad_sample|clipping)/")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ops", action="store_true", help="also torch.profiler's operators (record_shapes), by self time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tokens, data = cf.build(args.model, args.batch)
    run = cf.ldp(False)(model, tokens, data, args.batch)
    for _ in range(30):  # warm-up: the first step's probe and checks
        run.prepare()
        run()
    profiler = cProfile.Profile()
    for _ in range(args.steps):
        run.prepare()  # the next Poisson batch, not profiled
        profiler.enable()
        run()
        profiler.disable()
    match = re.compile(args.match)
    rows = [(f, line, fn, nc, tt, ct) for (f, line, fn), (_, nc, tt, ct, _) in pstats.Stats(profiler).stats.items()
            if match.search(f.replace("\\", "/"))]
    rows.sort(key=lambda r: -r[4])
    n = args.steps
    calls, self_us = sum(r[3] for r in rows) / n, sum(r[4] for r in rows) / n * 1e6
    print(f"{args.model}, batch {args.batch}: {calls:.0f} calls and {self_us:.0f}"
          f" µs of self time a step in the matched files")
    print(f"{'function':60s} {'calls':>6s} {'self µs':>8s} {'cum µs':>8s}")
    for f, line, fn, nc, tt, ct in rows[:args.top]:
        where = f.replace("\\", "/").split("lightning_dp/")[-1]
        print(f"{where + ':' + str(line) + ' ' + fn:60.60s} {nc / n:6.1f} {tt / n * 1e6:8.1f} {ct / n * 1e6:8.1f}")
    if args.ops:  # the whole step's operators with their shapes: the arithmetic, apart from the Python above
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                run.prepare()
                run()
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                                 max_name_column_width=40))


if __name__ == "__main__":
    main()
