"""Where a private step's time goes: torch.profiler over the non-private and the private step of one model of
benchmarks/real_models.py, on its device. Run by hand:

    PYTHONPATH=. python benchmarks/profile_step.py --model gpt2 --device cuda --hidden 256 --seq 128 --batch 64

Prints, for each mode, the wall time per step, the host (CPU) time the profiler counts in the top-level ops, the
device time of all kernels, and the number of kernel launches; then the private step's operators ranked by
self device time and by self host time. A step whose wall time is far above its device time is bound by the host
(Python, hooks, launches), not by the arithmetic; the private/non-private ratio then shrinks as sizes grow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_models  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _wall(step: Callable[[], None], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _profiled(step: Callable[[], None], device: str, repeats: int) -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        _sync(device)
    return prof


def _summary(prof: profile, repeats: int, device: str) -> str:
    events = prof.key_averages()
    on_device = sum(getattr(e, "self_device_time_total", 0) for e in events) / repeats / 1e3
    launches = sum(e.count for e in events if "cudaLaunchKernel" in e.key or "cuLaunchKernel" in e.key) / repeats
    host = sum(e.self_cpu_time_total for e in events) / repeats / 1e3
    return f"host ops {host:8.2f} ms   device kernels {on_device:8.2f} ms   kernel launches {launches:7.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=real_models.B)
    p.add_argument("--seq", type=int, default=real_models.T)
    p.add_argument("--hidden", type=int, default=real_models.D)
    p.add_argument("--vocab", type=int, default=real_models.V)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    real_models.configure(args.batch, args.seq, args.hidden, args.vocab)
    make = real_models.models()[args.model]
    engine = real_models.select_engine(make())
    nonprivate, private = real_models.steps(make, engine, args.device)
    for step in (nonprivate, private, nonprivate, private):  # warm-up (allocator, kernels, lazy init)
        step()
    print(f"{args.model} on {args.device}: batch {args.batch}, T {args.seq}, hidden {args.hidden}, engine {engine}")
    profiles = {}
    for name, step in (("non-private", nonprivate), ("private", private)):
        wall = _wall(step, args.device, args.repeats)
        profiles[name] = _profiled(step, args.device, args.repeats)
        print(f"{name:12s} wall {wall * 1e3:8.2f} ms   {_summary(profiles[name], args.repeats, args.device)}")
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(profiles["private"].key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if args.device.startswith("cuda"):
        print(profiles["private"].key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                       max_name_column_width=60))


if __name__ == "__main__":
    main()
