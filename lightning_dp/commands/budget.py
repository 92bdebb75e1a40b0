"""``lightning-dp budget``: ε of a setting from several accountants side by side, or σ for a target ε.

    lightning-dp budget --sample-rate 0.004 --noise-multiplier 1.1 --steps 14000 --delta 1e-5
    lightning-dp budget --sample-rate 0.004 --target-epsilon 3 --steps 14000 --delta 1e-5
    lightning-dp budget --dataset-size 60000 --batch-size 256 --epochs 60 --sigma 1.1 --delta 1e-5
    lightning-dp budget ... --plot eps.png      # ε against steps, one curve per accountant
    lightning-dp budget ... --sign-sgd          # also the DP-SignSGD paper's per-worker calibration

The setting is either q and T, or what a Lightning run has: N training examples, the
(global, expected) batch size B and the number of epochs E; then q = B/N and
T = E × steps per epoch, derived as ``DPStrategy`` derives them
(:func:`~lightning_dp.privacy.min_sep_sampling.group_sample_rate`,
:func:`~lightning_dp.privacy.min_sep_sampling.min_sep_steps_per_epoch`: round(N/B)).

Accountants are those of :mod:`lightning_dp.accounting.accountants`; ``integer_rdp`` is the
DP-SignSGD paper's coarse grid, shown for comparison only.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

DEFAULT_ACCOUNTANTS = ("rdp", "prv", "pld", "integer_rdp")
#: accountants cheap enough (~0.1 ms a point) to be evaluated at every step of the plot's dense grid
CHEAP_ACCOUNTANTS = ("rdp", "integer_rdp")
#: points of the plot's dense grid (cheap accountants: evaluated there; others: interpolated there)
DENSE_POINTS = 400
#: points at which an expensive accountant (PLD, PRV: ~0.3–1 s each) is evaluated for the plot
EXPENSIVE_POINTS = 20
#: a log ε axis when the largest final ε exceeds the smallest by this factor
LOG_SCALE_RATIO = 5.0
_T = TypeVar("_T")


def build_parser() -> argparse.ArgumentParser:
    """The ``budget`` subcommand's argument parser."""
    p = argparse.ArgumentParser(prog="lightning-dp budget", description=__doc__.splitlines()[0])
    s = p.add_argument_group("setting",
                             "either --sample-rate and --steps, or --dataset-size, --batch-size and --epochs")
    s.add_argument("--sample-rate", "-q", type=float, help="q = expected batch / N")
    s.add_argument("--steps", "-T", type=int, help="number of steps")
    s.add_argument("--dataset-size", "-N", type=int, help="N, the number of training examples")
    s.add_argument("--batch-size", "-B", type=int,
                   help="B, the expected batch per step over all processes (batch_size × devices)")
    s.add_argument("--epochs", "-E", type=int, help="E, the number of epochs (T = E × round(N/B))")
    p.add_argument("--delta", type=float, required=True, help="δ, well below 1/N")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--noise-multiplier", "--sigma", type=float, help="σ: report ε")
    g.add_argument("--target-epsilon", type=float, help="ε: report the σ each accountant needs")
    p.add_argument(
        "--accountants", nargs="+", default=list(DEFAULT_ACCOUNTANTS), metavar="NAME",
        help="accountants to compare: rdp, pld, prv, integer_rdp or any registered one (default: %(default)s)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw ε against steps into this file, one curve per accountant "
                   "(and per --sign-sgd row), at the given σ or the σ calibrated for the first accountant")
    p.add_argument(
        "--sign-sgd", action="store_true",
        help="add the DP-SignSGD paper's method: integer-order grid AND its 2C sensitivity (it clips the "
        "batch average), next to ours (per-example clipping, sensitivity C); q is then the local rate",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


@dataclass(frozen=True)
class Setting:
    """q and T of the run; with ``derivation`` saying how they came from N, B and E (if they did)."""

    sample_rate: float
    steps: int
    derivation: Optional[str] = None


def resolve_setting(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setting:
    """q and T from ``--sample-rate/--steps`` or from ``--dataset-size/--batch-size/--epochs``
    (``parser.error`` — exit status 2 — when both or neither set is given, or one is incomplete)."""
    direct = {"--sample-rate": args.sample_rate, "--steps": args.steps}
    lightning = {"--dataset-size": args.dataset_size, "--batch-size": args.batch_size, "--epochs": args.epochs}
    given_direct = [k for k, v in direct.items() if v is not None]
    given_lightning = [k for k, v in lightning.items() if v is not None]
    if given_direct and given_lightning:
        parser.error(f"give either --sample-rate and --steps, or --dataset-size, --batch-size and --epochs, "
                     f"not both (got {', '.join(given_direct + given_lightning)})")
    if given_lightning:
        missing = [k for k, v in lightning.items() if v is None]
        if missing:
            parser.error(f"--dataset-size, --batch-size and --epochs go together: missing {', '.join(missing)}")
        return derive_setting(args.dataset_size, args.batch_size, args.epochs, parser)
    missing = [k for k, v in direct.items() if v is None]
    if len(missing) == 2:
        parser.error("give the setting: --sample-rate and --steps, or --dataset-size, --batch-size and --epochs")
    if missing:
        parser.error(f"--sample-rate and --steps go together: missing {missing[0]}")
    return Setting(args.sample_rate, args.steps)


def derive_setting(num_samples: int, batch_size: int, epochs: int, parser: argparse.ArgumentParser) -> Setting:
    """q = B/N and T = E × round(N/B), by the functions ``DPStrategy`` plans its run with."""
    for flag, value in (("--dataset-size", num_samples), ("--batch-size", batch_size), ("--epochs", epochs)):
        if value < 1:
            parser.error(f"{flag} must be a positive integer, got {value}")
    if batch_size > num_samples:
        parser.error(f"--batch-size {batch_size} exceeds --dataset-size {num_samples}: lower the batch size")
    from lightning_dp.privacy.min_sep_sampling import group_sample_rate, min_sep_steps_per_epoch

    q = group_sample_rate(batch_size, num_samples, 1)
    per_epoch = min_sep_steps_per_epoch(q, 1)
    steps = epochs * per_epoch
    text = (f"setting: q = B/N = {batch_size}/{num_samples} = {q:.6g}, "
            f"T = {epochs} epochs × {per_epoch} steps/epoch (round(N/B)) = {steps}")
    return Setting(q, steps, text)


def _progress(label: str, work: Callable[[], _T], quiet: bool) -> _T:
    """Run ``work``, telling stderr what is being computed and how long it took (PLD/PRV take seconds)."""
    if quiet:
        return work()
    print(f"  {label} …", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = work()
    print(f" {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    return out


def _sign_sgd_rows(args: argparse.Namespace, setting: Setting) -> list[tuple[str, str]]:
    """The seed paper's calibration next to ours (docs/algorithms.md §6): its σ protects only σ/2."""
    from lightning_dp.accounting import epsilon

    q, steps, delta = setting.sample_rate, setting.steps, args.delta
    if args.noise_multiplier is not None:
        eps = epsilon(args.noise_multiplier / 2, q, steps, delta, "integer_rdp")
        return [("sign_sgd_paper (true ε of its σ: 2C sensitivity)", f"{eps:.4f}")]
    sigma = _sign_sgd_published_sigma(args, setting)
    return [
        ("sign_sgd_paper as published (integer grid, C)", f"{sigma:.4f}"),
        ("sign_sgd_paper corrected (integer grid, 2C)", f"{2 * sigma:.4f}"),
    ]


def _sign_sgd_published_sigma(args: argparse.Namespace, setting: Setting) -> float:
    from lightning_dp.accounting import calibrate_noise

    return calibrate_noise(args.target_epsilon, args.delta, setting.sample_rate, setting.steps, "integer_rdp")


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    width = max(len(header[0]), *(len(r[0]) for r in rows))
    lines = [f"{header[0]:<{width}}  {header[1]}", f"{'-' * width}  {'-' * len(header[1])}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plot
#: one look per accountant: PLD and PRV (PRV ≈ PLD + 0.01) differ in colour, line style and marker
ACCOUNTANT_STYLES: dict[str, dict[str, Any]] = {
    "rdp": dict(color="tab:blue", linestyle="-", marker="o"),
    "pld": dict(color="tab:green", linestyle="-", marker="s", markerfacecolor="none", linewidth=2.5),
    "prv": dict(color="tab:orange", linestyle=(0, (5, 3)), marker="x", zorder=3),  # dashed, on top of PLD
    "integer_rdp": dict(color="tab:red", linestyle="-.", marker="^", markerfacecolor="none"),
}
_SPARE_STYLES = (
    dict(color="tab:brown", linestyle=(0, (1, 1)), marker="D"),
    dict(color="tab:pink", linestyle=(0, (3, 1, 1, 1, 1, 1)), marker="v"),
    dict(color="tab:olive", linestyle="--", marker="P"),
    dict(color="tab:cyan", linestyle=":", marker="*"),
)
SIGN_SGD_STYLES = (
    dict(color="tab:purple", linestyle=":", marker="d", linewidth=2.0),
    dict(color="black", linestyle=(0, (6, 2, 1, 2)), marker="h", markerfacecolor="none"),
)


def accountant_style(name: str, index: int) -> dict[str, Any]:
    """Colour, line style and marker of accountant ``name`` (the ``index``-th asked for)."""
    return dict(ACCOUNTANT_STYLES.get(name) or _SPARE_STYLES[index % len(_SPARE_STYLES)])


@dataclass
class Curve:
    """One line of the plot: ε at ``steps`` (dense), exact at ``exact_steps`` (the markers)."""

    label: str
    steps: Any
    epsilons: Any
    exact_steps: Any
    exact_epsilons: Any
    style: dict[str, Any] = field(default_factory=dict)


def _grids(steps: int) -> tuple[Any, Any]:
    """(dense, sparse) integer step grids on [1, T]; both hold 1 and T. The sparse one adds
    geometric points where ε(t) bends most (small t)."""
    import numpy as np

    dense = np.unique(np.rint(np.linspace(1, steps, DENSE_POINTS)).astype(int))
    half = EXPENSIVE_POINTS // 2
    sparse = np.unique(np.concatenate([np.rint(np.geomspace(1, steps, half)), np.rint(np.linspace(1, steps, half))]))
    return dense, sparse.astype(int)


def epsilon_curve(
    label: str, sigma: float, q: float, steps: int, delta: float, accountant: str, style: dict[str, Any], quiet: bool
) -> Curve:
    """ε(t) for t = 1..T: every dense-grid step for the RDP accountants; for the others at
    :data:`EXPENSIVE_POINTS` steps joined by a monotone cubic (PCHIP) — ε(t) is increasing."""
    import numpy as np

    from lightning_dp.accounting import epsilon

    dense, sparse = _grids(steps)
    at = dense if accountant in CHEAP_ACCOUNTANTS else sparse
    exact = _progress(f"ε curve: {label}", lambda: np.array([epsilon(sigma, q, int(t), delta, accountant) for t in at]),
                      quiet)
    if at is dense:
        marks = np.unique(np.rint(np.linspace(0, len(dense) - 1, 12)).astype(int))
        return Curve(label, dense, exact, dense[marks], exact[marks], style)
    dense = np.union1d(dense, at)  # the line passes through every exact value
    if len(at) >= 3:
        from scipy.interpolate import PchipInterpolator

        smooth = PchipInterpolator(at, exact)(dense)
    else:
        smooth = np.interp(dense, at, exact)
    return Curve(label, dense, smooth, at, exact, style)


def plot_curves(
    args: argparse.Namespace, setting: Setting, sigma: float, quiet: bool = True
) -> list[Curve]:
    """The plot's curves: each accountant at σ; with ``--sign-sgd`` the paper's method (integer
    grid, 2C sensitivity): at σ, or — for a target ε — its published σ and the corrected 2σ."""
    q, steps, delta = setting.sample_rate, setting.steps, args.delta
    curves = [
        epsilon_curve(name, sigma, q, steps, delta, name, accountant_style(name, i), quiet)
        for i, name in enumerate(args.accountants)
    ]
    if args.sign_sgd:
        if args.noise_multiplier is not None:
            sign = [(f"sign_sgd_paper at σ = {sigma:.4g} (2C sensitivity)", sigma / 2)]
        else:
            published = _sign_sgd_published_sigma(args, setting)
            sign = [(f"sign_sgd_paper as published, σ = {published:.4g} (its true ε)", published / 2),
                    (f"sign_sgd_paper corrected, σ = {2 * published:.4g}", published)]
        curves += [epsilon_curve(label, s, q, steps, delta, "integer_rdp", SIGN_SGD_STYLES[i], quiet)
                   for i, (label, s) in enumerate(sign)]
    return curves


def draw(path: str, curves: Sequence[Curve], title: str, delta: float, target: Optional[float] = None) -> None:
    """Save the curves as a PNG (matplotlib, Agg): lines through the dense grid, markers where ε is exact."""
    from lightning_dp._extras import require

    matplotlib = require("matplotlib", "report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        style = dict(c.style)
        marker = style.pop("marker", None)
        face = style.pop("markerfacecolor", None)
        final = f"{float(c.epsilons[-1]):.3f}"
        (line,) = ax.plot(c.steps, c.epsilons, label=f"{c.label}: ε_T = {final}", marker=marker,
                          markevery=[int(i) for i in _mark_indices(c)], markerfacecolor=face, **style)
        line.set_markersize(6)
    if target is not None:
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label=f"target ε = {target:g}")
    ax.set(xlabel="steps", ylabel=f"ε (δ = {delta:g})", title=title)
    ax.set_xlim(left=0)
    finals = [float(c.epsilons[-1]) for c in curves if float(c.epsilons[-1]) > 0]
    if finals and max(finals) > LOG_SCALE_RATIO * min(finals):
        ax.set_yscale("log")  # e.g. the sign-SGD paper's true ε next to ours: keep every curve readable
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_indices(curve: Curve) -> Any:
    import numpy as np

    return np.searchsorted(curve.steps, curve.exact_steps).clip(0, len(curve.steps) - 1)


def plot_epsilon(args: argparse.Namespace, setting: Setting, sigma: float) -> list[Curve]:
    """Draw ε against steps into ``args.plot``; returns the curves drawn."""
    curves = plot_curves(args, setting, sigma, args.quiet)
    title = f"σ = {sigma:.4g}, q = {setting.sample_rate:.4g}, T = {setting.steps}"
    draw(args.plot, curves, title, args.delta, args.target_epsilon)
    return curves


# ----------------------------------------------------------------------------- command
def main(argv: Optional[list[str]] = None) -> int:
    """Run ``lightning-dp budget``; returns the exit status (2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from lightning_dp.accounting import available_accountants, calibrate_noise, epsilon  # not for --help

    unknown = [name for name in args.accountants if name not in available_accountants()]
    if unknown:
        parser.error(f"argument --accountants: unknown {', '.join(map(repr, unknown))} "
                     f"(choose from {', '.join(available_accountants())})")
    setting = resolve_setting(args, parser)
    q, steps, delta = setting.sample_rate, setting.steps, args.delta

    try:
        if setting.derivation:
            print(setting.derivation)
        if args.noise_multiplier is not None:
            sigma = args.noise_multiplier
            rows = [
                (name, f"{_progress(f'ε by {name}', lambda: epsilon(sigma, q, steps, delta, name), args.quiet):.4f}")
                for name in args.accountants
            ]
            rows += _sign_sgd_rows(args, setting) if args.sign_sgd else []
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
            rows = [(n, f"{s:.4f}") for n, s in sigmas.items()]
            rows += _sign_sgd_rows(args, setting) if args.sign_sgd else []
            print(_table(("accountant", "noise_multiplier"), rows))
        if args.plot:
            plot_epsilon(args, setting, sigma)
            print(f"plot written to {args.plot}")
    except ValueError as err:
        print(f"lightning-dp budget: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
