"""A private step alone in its process, with and without ``retain_cpu_memory`` (issue 38). Run by hand:

    PYTHONPATH=. python benchmarks/cpu_memory.py                      # digits CNN and MLP, batch 64, 1 thread
    PYTHONPATH=. python benchmarks/cpu_memory.py --models digits --batch 256 --steps 200

For each model and setting, a fresh child process builds the non-private step and the private step
(:class:`~lightning_dp.privacy.private_step.PrivateStep`, ghost engine, the defaults but for
``retain_cpu_memory``), warms both up, and times ``--steps`` steps of each in turn; it prints the median ms/step,
the minor page faults and the system time per step (``getrusage``). A fresh process matters: glibc's adaptive
malloc thresholds follow the process's whole allocation history (lightning_dp/performance/cpu_memory.py), so a
step measured beside other workloads (cost_floor.py's Opacus modes) may fault less than it does alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_floor  # noqa: E402


def _private(retain: bool) -> Callable[..., Callable[[], None]]:
    def make(model, tokens, data, B):
        from torch.utils.data import DataLoader, TensorDataset

        from lightning_dp.privacy.noise import GaussianNoise
        from lightning_dp.privacy.private_step import PrivateStep

        opt = torch.optim.Adam(model.parameters(), lr=cost_floor.LR)
        step = PrivateStep(cost_floor.SIGMA, cost_floor.CLIP, GaussianNoise(), engine="ghost", sampler_seed=0,
                           retain_cpu_memory=retain)
        step.attach(model, opt)
        x, y = data
        draw, drawn = cost_floor.drawn_batches(step, x, y, B)
        step.verify(lambda batch: cost_floor.loss_of(model(batch[0]), batch[1], tokens))

        def run() -> None:
            bx, by = drawn()
            opt.zero_grad(set_to_none=True)
            step.begin()
            cost_floor.loss_of(model(bx), by, tokens).backward()
            step.release(optimizer=opt)
            opt.step()

        run.prepare = draw  # type: ignore[attr-defined]
        return run

    return make


def child(name: str, B: int, retain: bool, steps: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    runs = {}
    for mode, make in (("nonprivate", cost_floor.nonprivate), ("private", _private(retain))):
        model, tokens, data = cost_floor.build(name, B)
        runs[mode] = make(model, tokens, data, B)
    for _ in range(20):
        for run in runs.values():
            run()
    out = {}
    for mode, run in runs.items():
        times, faults, system = [], 0, 0.0
        prepare = getattr(run, "prepare", lambda: None)  # the next Poisson batch drawn, neither timed nor counted
        for _ in range(steps):
            prepare()
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults += after.ru_minflt - before.ru_minflt
            system += after.ru_stime - before.ru_stime
        out[mode] = {"ms": statistics.median(times) * 1e3, "faults": faults / steps,
                     "sys_ms": system * 1e3 / steps}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, retain = args.child.split(":")
        print(json.dumps(child(name, args.batch, retain == "1", args.steps)))
        return
    print("| model | B | retain_cpu_memory | non-private ms | private ms | private / non-private | "
          "private page faults / step | private system ms / step |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for retain in ("0", "1"):
            cmd = [sys.executable, __file__, "--child", f"{name}:{retain}", "--batch", str(args.batch),
                   "--steps", str(args.steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if res.returncode != 0:
                print(f"| {name} | {args.batch} | {retain == '1'} | error: {res.stderr.strip().splitlines()[-1][:80]} |")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            n, p = r["nonprivate"], r["private"]
            print(f"| {name} | {args.batch} | {retain == '1'} | {n['ms']:.2f} | {p['ms']:.2f} | {p['ms'] / n['ms']:.2f}x "
                  f"| {p['faults']:.0f} | {p['sys_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
