"""The private step of another git revision against the working tree's, interleaved in one process (issue 38). Run
by hand from the repository root:

    PYTHONPATH=. python benchmarks/ab_revisions.py --rev HEAD~1 --model digits --rounds 800

Separate processes on this shared 2-vCPU machine differ by more than a change worth keeping (cost_floor.py's digits
ratio moves by ±0.06 between runs of the same code); steps of both trees interleaved in one process do not. The
revision's ``lightning_dp`` is unpacked (``git archive``) into a temporary directory as the package
``lightning_dp_rev``, every import renamed, so that both trees run side by side: each builds the same model (same
initial weights, :func:`cost_floor.build`) with its own :class:`~lightning_dp.privacy.private_step.PrivateStep`
(ghost engine, Adam, noise drawn at the release unless ``--prefetch``), and the non-private step runs beside them.
Each round runs one step of each in a shuffled order. Printed: each tree's median ms per step and median ratio to
the non-private step of the same round, and the median and quartiles of the per-round difference rev − working
tree (positive: the working tree is faster); with ``--fingerprint``, the boundary's two kept-state fingerprints and
their comparison alone instead of the step (the non-private step still beside them); with ``--boundary``, the
boundary's per-step reads alone (:func:`boundary_alone`: the parameter set, the optimizer's state, the fingerprints);
with ``--clipping``, the ghost
engine's clipping alone (norms, factors and clipped sums of one captured step, again each round). With ``--phases``,
the same for each phase of the step (begin, forward and loss; backward; release; optimizer step): a change's own phase
varies far less from round to round than the whole step. With ``--cpu``, every time is this thread's CPU time instead
of the wall clock: on a machine other processes keep busy, the scheduler's pauses (milliseconds, at random) are left
out of the paired differences.

A revision against an unchanged tree (``--rev HEAD``, nothing uncommitted) measures the harness's own offset (measured
2026-11-29: 0.01–0.04 ms on the digits CNN, 0.07 ms on the MLP); only a difference well above it is the change's.
Watch the page faults printed too: a change of allocation history can make one tree fault where the other does not
(a reference cycle through the autograd graph once did: 320 faults a step), which is real but not the change's
arithmetic.
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from io import BytesIO
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cost_floor as cf  # noqa: E402

RENAMED = "lightning_dp_rev"
CLOCK: list[Callable[[], float]] = [time.perf_counter]
"""The clock every time is read from: wall time, or with ``--cpu`` this thread's CPU time (``time.thread_time``), which
leaves out the time the scheduler gives other processes on a shared machine (with 1 thread and the noise drawn at the
release, the whole step runs on this thread; a noise drawn ahead, ``--prefetch``, would not be counted)."""
PHASES = ("forward", "backward", "release", "optimizer")
"""The private step's phases timed apart (``--phases``): begin + forward + loss, backward, release, optimizer step."""


def unpack_revision(rev: str, into: Path) -> None:
    """``lightning_dp`` at ``rev`` as the package :data:`RENAMED` under ``into`` (its imports renamed)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "lightning_dp"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    package = into / RENAMED
    (into / "lightning_dp").rename(package)
    name = re.compile(r"\blightning_dp\b(?!_)")
    for path in package.rglob("*.py"):
        path.write_text(name.sub(RENAMED, path.read_text()))


def private_step(package: str, model_name: str, batch: int, prefetch: bool) -> Callable[[], None]:
    """One private step of ``package``'s :class:`PrivateStep` on a fresh copy of the model (cost_floor.py's loop)."""
    noise = importlib.import_module(package + ".privacy.noise")
    steps = importlib.import_module(package + ".privacy.private_step")
    model, tokens, (x, y) = cf.build(model_name, batch)
    opt = torch.optim.Adam(model.parameters(), lr=cf.LR)
    step = steps.PrivateStep(cf.SIGMA, cf.CLIP, noise.GaussianNoise() if prefetch else noise.GaussianNoise(
        prefetch=False), engine="ghost", sampler_seed=0)
    step.attach(model, opt)
    draw, drawn = cf.drawn_batches(step, x, y, batch)
    step.verify(lambda b: cf.loss_of(model(b[0]), b[1], tokens))

    phases: dict[str, list[float]] = {name: [] for name in PHASES}

    def run() -> None:
        t0 = CLOCK[0]()
        bx, by = drawn()
        opt.zero_grad(set_to_none=True)
        step.begin()
        loss = cf.loss_of(model(bx), by, tokens)
        t1 = CLOCK[0]()
        loss.backward()
        t2 = CLOCK[0]()
        step.release(optimizer=opt)
        t3 = CLOCK[0]()
        opt.step()
        t4 = CLOCK[0]()
        for name, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            phases[name].append((b - a) * 1e3)

    def before_release() -> None:  # a step up to its release (the captures made, not yet clipped): --clipping
        bx, by = drawn()
        opt.zero_grad(set_to_none=True)
        step.begin()
        cf.loss_of(model(bx), by, tokens).backward()

    run.prepare = draw  # type: ignore[attr-defined]
    run.before_release = before_release  # type: ignore[attr-defined]
    run.step = step  # type: ignore[attr-defined]
    run.phases = phases  # type: ignore[attr-defined]
    run.boundary = step.boundary  # type: ignore[attr-defined]
    run.optimizer = opt  # type: ignore[attr-defined]
    return run


def fingerprint_pair(run: Callable[[], None]) -> Callable[[], None]:
    """``--fingerprint``: what a step's boundary does with its kept-state fingerprint, alone: one ``take()`` (the
    baseline after the update) and one ``take()`` compared with it (the check before the release)."""
    boundary = run.boundary  # type: ignore[attr-defined]
    fingerprint, callbacks = boundary._fingerprint, boundary.callbacks

    def pair() -> None:
        before = fingerprint.take(callbacks())
        fingerprint.changed(before, fingerprint.take(callbacks()))

    return pair


def boundary_alone(run: Callable[[], None]) -> Callable[[], None]:
    """``--boundary``: the release boundary's per-step reads alone, as a step makes them (``PrivateStep.begin``'s
    parameter-set check and optimizer read, the release's parameter list, optimizer check and kept-state check, the
    baseline after the update), on the model and optimizer as a few steps left them."""
    boundary, opt = run.boundary, run.optimizer  # type: ignore[attr-defined]
    fingerprint, callbacks = boundary._fingerprint, boundary.callbacks

    def reads() -> None:
        boundary.parameters_changed()
        boundary.step_begins()
        boundary.trainable()
        boundary.check_hyperparameters(opt)
        before = fingerprint.take(callbacks())
        fingerprint.changed(before, fingerprint.take(callbacks()))

    return reads


def clipping_alone(run: Callable[[], None]) -> Callable[[], None]:
    """``--clipping``: the engine's clipping alone (``GhostEngine._clip_and_sum``: norms, factors, clipped sums), on
    the captures of one step of ``run`` kept and clipped again each time (the clipping reads them, changes nothing)."""
    step = run.step  # type: ignore[attr-defined]
    run.prepare()  # type: ignore[attr-defined]
    run.before_release()  # type: ignore[attr-defined]
    engine, params = step._engine, step.params()
    engine._capture.end_backward()

    def clip() -> None:
        with engine._capture.suspended():
            engine._clip_and_sum(params, cf.CLIP, None, False)

    return clip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision compared with the working tree")
    ap.add_argument("--model", default="digits", choices=(*cf.MODELS, *cf.EXTRA_MODELS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefetch", action="store_true", help="noise drawn ahead (prefetch='auto') in both trees")
    ap.add_argument("--phases", action="store_true", help="also the paired differences of each phase of the step")
    ap.add_argument("--fingerprint", action="store_true", help="time the boundary's two fingerprints and their "
                    "comparison alone (after a few steps of each tree), not the step")
    ap.add_argument("--boundary", action="store_true", help="time the release boundary's per-step reads alone (the "
                    "parameter set, the optimizer's state twice, the two fingerprints) after a few steps, not the step")
    ap.add_argument("--clipping", action="store_true", help="time the engine's clipping alone (norms, factors, "
                    "clipped sums) on one captured step of each tree, again each round, not the step")
    ap.add_argument("--cpu", action="store_true", help="time this thread's CPU time, not the wall clock (a shared "
                    "machine's other processes left out)")
    args = ap.parse_args()
    if args.cpu:
        CLOCK[0] = time.thread_time
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        unpack_revision(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        model, tokens, data = cf.build(args.model, args.batch)
        steps = {"nonprivate": cf.nonprivate(model, tokens, data, args.batch),
                 "rev": private_step(RENAMED, args.model, args.batch, args.prefetch),
                 "tree": private_step("lightning_dp", args.model, args.batch, args.prefetch)}
        if args.fingerprint:
            for _ in range(5):
                for name in ("rev", "tree"):
                    steps[name].prepare()  # type: ignore[attr-defined]
                    steps[name]()
            steps = {"nonprivate": steps["nonprivate"], "rev": fingerprint_pair(steps["rev"]),
                     "tree": fingerprint_pair(steps["tree"])}
        if args.boundary:
            for _ in range(5):
                for name in ("rev", "tree"):
                    steps[name].prepare()  # type: ignore[attr-defined]
                    steps[name]()
            steps = {"nonprivate": steps["nonprivate"], "rev": boundary_alone(steps["rev"]),
                     "tree": boundary_alone(steps["tree"])}
        if args.clipping:
            for _ in range(5):
                for name in ("rev", "tree"):
                    steps[name].prepare()  # type: ignore[attr-defined]
                    steps[name]()
            steps = {"nonprivate": steps["nonprivate"], "rev": clipping_alone(steps["rev"]),
                     "tree": clipping_alone(steps["tree"])}
        ms: dict[str, list[float]] = {k: [] for k in steps}
        faults: dict[str, list[int]] = {k: [] for k in steps}
        order = random.Random(0)
        for _ in range(args.rounds):
            names = list(steps)
            order.shuffle(names)
            for name in names:
                getattr(steps[name], "prepare", lambda: None)()  # the next Poisson batch drawn, not timed
                before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, CLOCK[0]()
                steps[name]()
                ms[name].append((CLOCK[0]() - start) * 1e3)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    skip = max(3, args.rounds // 20)  # warm-up
    ms = {k: v[skip:] for k, v in ms.items()}
    for name in ("rev", "tree"):
        ratio = statistics.median(a / b for a, b in zip(ms[name], ms["nonprivate"]))
        print(f"{name:5s} {statistics.median(ms[name]):8.3f} ms  {ratio:.3f}x non-private  "
              f"{statistics.mean(faults[name][skip:]):6.1f} page faults/step")
    diff = [a - b for a, b in zip(ms["rev"], ms["tree"])]
    q1, _, q3 = statistics.quantiles(diff, n=4)
    print(f"non-private {statistics.median(ms['nonprivate']):.3f} ms; rev - tree: median "
          f"{statistics.median(diff):.3f} ms (quartiles {q1:.3f} .. {q3:.3f})")
    if args.phases and not (args.fingerprint or args.clipping or args.boundary):  # the same rounds' phases: a
        # change's own varies less
        for phase in PHASES:
            a, b = steps["rev"].phases[phase][skip:], steps["tree"].phases[phase][skip:]  # type: ignore[attr-defined]
            d = [x - y for x, y in zip(a, b)]
            p1, _, p3 = statistics.quantiles(d, n=4)
            print(f"  {phase:9s} rev {statistics.median(a):7.3f}  tree {statistics.median(b):7.3f} ms; rev - tree: "
                  f"median {statistics.median(d) * 1e3:7.1f} µs (quartiles {p1 * 1e3:.1f} .. {p3 * 1e3:.1f})")


if __name__ == "__main__":
    main()
