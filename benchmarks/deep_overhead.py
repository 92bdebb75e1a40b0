"""Per-step Python work that grows with the number of layers (issue 38). Run by hand:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/deep_overhead.py --layers 48 --batch 16

A stack of L × [Linear(64, 64), LayerNorm(64), GELU] (+ a Linear head): tiny layers, so the private step's cost is
its per-layer dispatch and bookkeeping, not arithmetic. One process, a non-private step and lightning_dp's private
step (:class:`~lightning_dp.privacy.private_step.PrivateStep`, ghost engine, plain loop, Adam) in turn, each
phase timed (median over the rounds, µs per hooked layer = per module owning parameters, 2L + 1 of them):

    forward      the forward (the engine's capture hooks)            vs the non-private forward
    backward     the backward (norm layers reduced in their hooks)   vs the non-private backward
    boundary     the release boundary's checks before the release (coverage, gradient hooks, kept state)
    clip         the engine's norms and clipped sums
    release      the rest of the release (noise once, ÷B, p.grad, the ledger)
    step         Adam's step and the boundary's fingerprint after it vs Adam's step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_floor  # noqa: E402


def stack(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())],
                         nn.Linear(64, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    B, hooked = args.batch, 2 * args.layers + 1
    x, y = torch.randn(B, 64), torch.randint(0, 10, (B,))
    plain = stack(args.layers)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    model = stack(args.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine="ghost", sampler_seed=0)
    step.attach(model, opt)
    draw, drawn = cost_floor.drawn_batches(step, x, y, B)  # q = 1: every step the same B rows, drawn
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    boundary = step.boundary
    import inspect

    takes_params = "params" in inspect.signature(step.clipped_sums).parameters  # (older versions walk it inside)
    phases = ["np_forward", "np_backward", "np_step", "forward", "backward", "boundary", "clip", "release", "step"]
    times: dict[str, list[float]] = {k: [] for k in phases}
    for i in range(args.rounds + 10):
        t = [time.perf_counter()]
        plain_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(plain(x), y)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        plain_opt.step()
        t.append(time.perf_counter())
        draw()
        bx, by = drawn()
        opt.zero_grad(set_to_none=True)
        step.begin()
        t.append(time.perf_counter())  # (begin: the engine's reset and the draw, not timed as a phase)
        loss = F.cross_entropy(model(bx), by)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        boundary.check_release(opt, boundary.trainable())
        t.append(time.perf_counter())
        batch = step.clipped_sums(params=step.params()) if takes_params else step.clipped_sums()
        t.append(time.perf_counter())
        step._privatizer.privatize(batch, step.params(), step._request, 1.0, 1.0, step.plan.expected_batch_size)
        step.ledger.record(1.0, step.plan.sample_rate, steps=1)
        step.loop.after_release(None)  # release()'s own book-keeping of the drawn batch (its phases timed above)
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        if i >= 10:
            spans = [t[1] - t[0], t[2] - t[1], t[3] - t[2], t[5] - t[4], t[6] - t[5], t[7] - t[6], t[8] - t[7],
                     t[9] - t[8], t[10] - t[9]]
            for k, v in zip(phases, spans):
                times[k].append(v * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = {"forward": med["np_forward"], "backward": med["np_backward"], "step": med["np_step"]}
    print(f"L = {args.layers} ({hooked} hooked layers), batch {B}, {torch.get_num_threads()} thread(s)")
    print(f"{'phase':<10}{'private µs':>12}{'non-private µs':>16}{'extra µs/layer':>16}")
    extra_total = 0.0
    for k in ["forward", "backward", "boundary", "clip", "release", "step"]:
        extra = med[k] - base.get(k, 0.0)
        extra_total += extra
        print(f"{k:<10}{med[k]:>12.0f}{base.get(k, 0.0):>16.0f}{extra / hooked:>16.1f}")
    total_np = sum(base.values())
    print(f"step total: private {total_np + extra_total:.0f} µs, non-private {total_np:.0f} µs, "
          f"extra {extra_total / hooked:.1f} µs per hooked layer")
    step.detach()


if __name__ == "__main__":
    main()
