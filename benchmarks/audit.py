"""One-run privacy audits, by hand: ``python benchmarks/audit.py [--canaries 1000] [--max-epochs 10]``.

Prints (1) the lower bound of Steinke, Nasr & Jagielski (2023) for ε0-randomized response,
whose ε is known (the bound's tightness), and (2) audits of the digits job
(configs/audit_digits.yaml) with the real mechanism and with deliberately broken ones:
no noise, and noise 10× too small (a wrong-constant bug). Figures go in docs/auditing.md.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

from lightning_dp.audit import count_correct, epsilon_lower_bound, run_audit
from lightning_dp.audit.bound import rr_accuracy
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism


class ScaledNoise(NoiseMechanism):
    """A broken mechanism: Gaussian noise multiplied by ``factor`` (0 = no noise)."""

    def __init__(self, factor: float) -> None:
        self.factor, self.inner = factor, GaussianNoise()

    def sample(self, like):
        return [self.factor * z for z in self.inner.sample(like)]


def rr_table(confidence: float) -> None:
    """The bound on ε0-RR with every canary guessed: how close a tight mechanism gets."""
    rng = np.random.default_rng(0)
    print(f"ε0-randomized response, all m guessed, {100 * confidence:g} % confidence, δ = 0")
    print(f"{'ε0':>4} " + " ".join(f"{'m=' + str(m):>10}" for m in (100, 1000, 10_000, 100_000)))
    for eps0 in (0.5, 1.0, 2.0, 4.0):
        cells = []
        for m in (100, 1000, 10_000, 100_000):
            coins = rng.random(m) < 0.5
            out = np.where(rng.random(m) < rr_accuracy(eps0), coins, ~coins)
            r, v = count_correct(np.where(out, 1, -1), coins)
            cells.append(f"{epsilon_lower_bound(m, r, v, confidence):10.3f}")
        print(f"{eps0:4g} " + " ".join(cells))


def digits_table(args: argparse.Namespace) -> None:
    """Audits of configs/audit_digits.yaml: real and broken mechanisms, both canary kinds."""
    cases = [
        ("gradient", "real", None), ("gradient", "noise × 0.1", ScaledNoise(0.1)),
        ("gradient", "no noise", ScaledNoise(0.0)),
        ("input", "real", None), ("input", "no noise", ScaledNoise(0.0)),
    ]
    print(f"\ndigits (configs/audit_digits.yaml), m = {args.canaries} canaries, {100 * args.confidence:g} % confidence")
    header = ("canaries", "mechanism", "claimed ε", "lower bound", "correct/guesses", "steps", "time")
    print("{:9} {:12} {:>9} {:>11} {:>16} {:>5} {:>7}".format(*header))
    for kind, name, noise in cases:
        start = time.perf_counter()
        result = run_audit(args.config, canaries=args.canaries, kind=kind, confidence=args.confidence,
                           max_epochs=args.max_epochs, seed=args.seed, noise=noise)
        wall = time.perf_counter() - start
        flag = "  VIOLATED" if result.violated else ""
        print(f"{kind:9} {name:12} {result.claimed_epsilon:9.3f} {result.epsilon_lower_bound:11.3f} "
              f"{f'{result.correct}/{result.guesses}':>16} {result.steps:5d} {wall:6.1f}s{flag}")


def main() -> None:
    """Run both tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/audit_digits.yaml")
    p.add_argument("--canaries", type=int, default=1000)
    p.add_argument("--max-epochs", type=int, default=None)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    rr_table(args.confidence)
    digits_table(args)


if __name__ == "__main__":
    main()
