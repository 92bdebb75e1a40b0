"""``lightning-dp budget``: ε of a setting from several accountants side by side, or σ for a target ε.

    lightning-dp budget --sample-rate 0.004 --noise-multiplier 1.1 --steps 14000 --delta 1e-5
    lightning-dp budget --sample-rate 0.004 --target-epsilon 3 --steps 14000 --delta 1e-5
    lightning-dp budget ... --plot eps.png      # ε against steps (RDP, and the others given)
    lightning-dp budget ... --sign-sgd          # also the DP-SignSGD paper's per-worker calibration

Accountants are those of :mod:`lightning_dp.accounting.accountants`; ``integer_rdp`` is the
DP-SignSGD paper's coarse grid, shown for comparison only.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence, TypeVar

from lightning_dp.accounting import available_accountants, calibrate_noise, epsilon

DEFAULT_ACCOUNTANTS = ("rdp", "prv", "pld", "integer_rdp")
_T = TypeVar("_T")


def build_parser() -> argparse.ArgumentParser:
    """The ``budget`` subcommand's argument parser."""
    p = argparse.ArgumentParser(prog="lightning-dp budget", description=__doc__.splitlines()[0])
    p.add_argument("--sample-rate", "-q", type=float, required=True, help="q = expected batch / N")
    p.add_argument("--steps", "-T", type=int, required=True, help="number of steps")
    p.add_argument("--delta", type=float, required=True, help="δ, well below 1/N")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--noise-multiplier", "--sigma", type=float, help="σ: report ε")
    g.add_argument("--target-epsilon", type=float, help="ε: report the σ each accountant needs")
    p.add_argument(
        "--accountants", nargs="+", default=list(DEFAULT_ACCOUNTANTS), choices=available_accountants(),
        help="accountants to compare (default: %(default)s)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw ε against steps into this file (needs --noise-multiplier "
                   "or uses the σ calibrated for the first accountant)")
    p.add_argument(
        "--sign-sgd", action="store_true",
        help="add the DP-SignSGD paper's method: integer-order grid AND its 2C sensitivity (it clips the "
        "batch average), next to ours (per-example clipping, sensitivity C); q is then the local rate",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _progress(label: str, work: Callable[[], _T], quiet: bool) -> _T:
    """Run ``work``, telling stderr what is being computed and how long it took (PLD/PRV take seconds)."""
    if quiet:
        return work()
    print(f"  {label} …", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = work()
    print(f" {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    return out


def _sign_sgd_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The seed paper's calibration next to ours (ALGORITHMS.md §6): its σ protects only σ/2."""
    q, steps, delta = args.sample_rate, args.steps, args.delta
    if args.noise_multiplier is not None:
        eps = epsilon(args.noise_multiplier / 2, q, steps, delta, "integer_rdp")
        return [("sign_sgd_paper (true ε of its σ: 2C sensitivity)", f"{eps:.4f}")]
    sigma = calibrate_noise(args.target_epsilon, delta, q, steps, "integer_rdp")
    return [
        ("sign_sgd_paper as published (integer grid, C)", f"{sigma:.4f}"),
        ("sign_sgd_paper corrected (integer grid, 2C)", f"{2 * sigma:.4f}"),
    ]


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    width = max(len(header[0]), *(len(r[0]) for r in rows))
    lines = [f"{header[0]:<{width}}  {header[1]}", f"{'-' * width}  {'-' * len(header[1])}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def plot_epsilon(
    path: str, sigma: float, q: float, steps: int, delta: float, accountants: Sequence[str], quiet: bool = True
) -> None:
    """ε against steps (1..T, 24 points) for each accountant, saved as a PNG (matplotlib, Agg);
    with ``quiet=False`` each accountant's curve is announced on stderr with its time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.unique(np.linspace(1, steps, 24).astype(int))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in accountants:
        curve = _progress(f"ε curve by {name}", lambda: [epsilon(sigma, q, int(t), delta, name) for t in grid], quiet)
        ax.plot(grid, curve, label=name)
    ax.set(xlabel="steps", ylabel=f"ε (δ = {delta:g})", title=f"σ = {sigma:.4g}, q = {q:.4g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``lightning-dp budget``; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    q, steps, delta = args.sample_rate, args.steps, args.delta
    try:
        if args.noise_multiplier is not None:
            sigma = args.noise_multiplier
            rows = [
                (name, f"{_progress(f'ε by {name}', lambda: epsilon(sigma, q, steps, delta, name), args.quiet):.4f}")
                for name in args.accountants
            ]
            rows += _sign_sgd_rows(args) if args.sign_sgd else []
            print(f"ε for σ = {sigma:g}, q = {q:g}, T = {steps}, δ = {delta:g}")
            print(_table(("accountant", "epsilon"), rows))
        else:
            sigmas = {
                name: _progress(
                    f"σ by {name}", lambda: calibrate_noise(args.target_epsilon, delta, q, steps, name), args.quiet
                )
                for name in args.accountants
            }
            sigma = sigmas[args.accountants[0]]
            print(f"σ for ε = {args.target_epsilon:g}, q = {q:g}, T = {steps}, δ = {delta:g}")
            rows = [(n, f"{s:.4f}") for n, s in sigmas.items()] + (_sign_sgd_rows(args) if args.sign_sgd else [])
            print(_table(("accountant", "noise_multiplier"), rows))
        if args.plot:
            plot_epsilon(args.plot, sigma, q, steps, delta, args.accountants, args.quiet)
            print(f"plot written to {args.plot}")
    except ValueError as err:
        print(f"lightning-dp budget: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
