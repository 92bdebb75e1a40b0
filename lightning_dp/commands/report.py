"""``lightning-dp report``: the bias-correction seed's Table 1 and Figure 2 for your own run.

    lightning-dp report                        # the latest monitored run under lightning_logs/
    lightning-dp report lightning_logs/version_0   # writes lightning_logs/version_0/report.png
    lightning-dp report lightning_logs/version_0 --out elsewhere.png

Reads only the TensorBoard event files written by
:class:`~lightning_dp.callbacks.second_moment_monitor.SecondMomentMonitor`
(tensorboard's ``EventAccumulator``). Prints, as markdown, the summary statistics of
the second moment at an early and a late logged step (dp-adam-bias-correction.txt,
Table 1: rows clean v — only when the run opted in to ``diagnostics="non_private"`` —,
private v̂ and corrected v̂ − Φ; columns min, Q1, median, Q3, max, mean), and draws a
Figure-2-like PNG: histograms of m, v and the update (clean vs private vs corrected)
at the late step, plus median v̂ against Φ over training, into the run's folder (the one holding its event files;
``--out`` for another path) and prints where.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

EVENT_GLOB = "events.out.tfevents.*"
DEFAULT_NAME = "report.png"
"""The figure's file name in the run's folder (without ``--out``)."""


class _Tags(ModuleType):
    """:mod:`lightning_dp.callbacks._monitor_tags`, imported on first use: importing the
    ``lightning_dp.callbacks`` package loads Lightning, which ``lightning-dp report --help`` does not need."""

    def __getattr__(self, name: str) -> Any:
        from lightning_dp.callbacks import _monitor_tags

        return getattr(_monitor_tags, name)


tags = _Tags("tags")


class ReportError(ValueError):
    """The log directory cannot be turned into a report (the message names the fix)."""


# ----------------------------------------------------------------------------- reading
def find_run(logdir: Path) -> tuple[Path, Any]:
    """The folder of the one run under ``logdir`` with monitor tags (the folder of its event files) and its loaded
    ``EventAccumulator``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not logdir.is_dir():
        raise ReportError(f"{logdir} is not a directory: pass the logger's run directory, "
                          "e.g. lightning_logs/version_0.")
    dirs = sorted({f.parent for f in logdir.rglob(EVENT_GLOB)})
    if not dirs:
        raise ReportError(f"no TensorBoard event files ({EVENT_GLOB}) under {logdir}: train with "
                          f"logger=TensorBoardLogger(...) and callbacks=[SecondMomentMonitor()].")
    runs = []
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        if _median_tag(tags.V) in acc.Tags()["scalars"]:
            runs.append((d, acc))
    if not runs:
        raise ReportError(f"event files under {logdir} hold no SecondMomentMonitor tags ({_median_tag(tags.V)}): "
                          f"add callbacks=[SecondMomentMonitor(every_n_steps=...)] to the Trainer.")
    if len(runs) > 1:
        names = ", ".join(str(d) for d, _ in runs)
        raise ReportError(f"several monitored runs under {logdir} ({names}): pass one of them (or no path: the "
                          "latest run under lightning_logs/).")
    return runs[0]


def latest_run(root: Path) -> Path:
    """The run directory under ``root`` whose newest event file is the most recent and that holds
    SecondMomentMonitor tags (``lightning-dp report`` without a path)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not root.is_dir():
        raise ReportError(f"no {root}/ here: run from the directory you trained in, or pass the run directory.")
    newest: dict[Path, float] = {}
    for f in root.rglob(EVENT_GLOB):
        newest[f.parent] = max(newest.get(f.parent, 0.0), f.stat().st_mtime)
    for d in sorted(newest, key=newest.__getitem__, reverse=True):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        if _median_tag(tags.V) in acc.Tags()["scalars"]:
            return d
    raise ReportError(f"no run under {root}/ holds SecondMomentMonitor tags ({_median_tag(tags.V)}): add "
                      "callbacks=[SecondMomentMonitor()] to the Trainer (configs/digits.yaml has it).")


def _median_tag(family: str) -> str:
    return tags.stat_tag(family, "all", "median")


def scalar_series(acc: Any, tag: str) -> dict[int, float]:
    """``{step: value}`` of a scalar tag (empty if absent)."""
    if tag not in acc.Tags()["scalars"]:
        return {}
    return {int(e.step): float(e.value) for e in acc.Scalars(tag)}


def histogram_at(acc: Any, tag: str, step: int) -> Optional[tuple[list[float], list[float]]]:
    """``(edges, counts)`` of histogram ``tag`` at the logged step nearest ``step`` (None if absent).

    TensorBoard keeps right bucket limits only; its first bucket is an empty
    left sentinel, so bucket i > 0 spans ``(limit[i-1], limit[i]]``.
    """
    if tag not in acc.Tags()["histograms"]:
        return None
    events = acc.Histograms(tag)
    event = min(events, key=lambda e: abs(int(e.step) - step))
    h = event.histogram_value
    limits, counts = list(h.bucket_limit), list(h.bucket)
    if len(limits) < 2:
        return [h.min, h.max], [float(h.num)]
    return limits, counts[1:]


# ----------------------------------------------------------------------------- table
def rows() -> tuple[tuple[str, str], ...]:
    """The table's series: (label, tag family)."""
    return (
        ("clean v (NOT private)", tags.CLEAN_V),
        ("private v̂", tags.V),
        ("corrected v̂ − Φ", tags.V_MINUS_PHI),
    )


HEADERS = {"min": "min", "q1": "Q1", "median": "median", "q3": "Q3", "max": "max", "mean": "mean"}


def table_markdown(acc: Any, steps: Sequence[int]) -> str:
    """Table 1 of the seed as markdown: one row per (step, series) present in the logs."""
    header = "| step | series | " + " | ".join(HEADERS[s] for s in tags.STATS) + " |"
    lines = [header, "|" + "---|" * (len(tags.STATS) + 2)]
    for step in steps:
        for label, family in rows():
            values = [scalar_series(acc, tags.stat_tag(family, "all", s)).get(step) for s in tags.STATS]
            if all(v is None for v in values):
                continue
            cells = " | ".join(_fmt(v) for v in values)
            lines.append(f"| {step} | {label} | {cells} |")
    phi, neg = scalar_series(acc, tags.PHI), scalar_series(acc, tags.FRAC_NEGATIVE)
    notes = [f"- step {s}: Φ = {_fmt(phi.get(s))}, fraction of coordinates with v̂ − Φ < 0 = {_fmt(neg.get(s))}"
             for s in steps]
    return "\n".join(lines + [""] + notes)


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "–"
    return "nan" if math.isnan(value) else f"{value:.4g}"


# ----------------------------------------------------------------------------- figure
def panels() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """The figure's histogram panels: (title, ((tag, label), ...))."""
    return (
        ("first moment m", ((tags.HIST_CLEAN_M, "clean m^c (NOT private)"), (tags.HIST_M, "private m^p"))),
        ("second moment v", ((tags.HIST_CLEAN_V, "clean v^c (NOT private)"), (tags.HIST_V, "private v^p"),
                             (tags.HIST_V_MINUS_PHI, "corrected v^p − Φ"))),
        ("update", ((tags.HIST_CLEAN_UPDATE, "clean m^c/√v^c (NOT private)"), (tags.HIST_UPDATE, "applied m̂/D(v̂)"))),
    )


#: x-axis label of each histogram panel (units of the coordinates shown)
UNITS = ("m per coordinate (gradient units)", "v per coordinate (gradient units²)", "update per coordinate (unitless)")

#: the figure's caption line
CAPTION = ("Φ = (σC/B)² is the per-coordinate variance of the DP noise in each step's gradient: Adam's private v̂ "
           "is biased up by about Φ; v̂ − Φ is the bias-corrected second moment (DP-AdamBC).")


def plot_report(acc: Any, step: int, out: str) -> None:
    """Figure-2-like PNG: histograms at ``step`` (clean series only where logged) + v̂ vs Φ over time."""
    from lightning_dp._extras import require

    matplotlib = require("matplotlib", "report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (title, series), unit in zip(axes.flat, panels(), UNITS):
        hists = [(label, h) for tag, label in series if (h := histogram_at(acc, tag, step)) is not None]
        _draw_histograms(ax, hists)
        ax.set(title=f"{title} (step {step})", ylabel="fraction of coordinates", xlabel=unit)
    _draw_medians(axes.flat[3], acc)
    fig.suptitle("SecondMomentMonitor: DP noise in Adam's moments (cf. dp-adam-bias-correction Fig. 2)")
    fig.text(0.5, 0.01, CAPTION, ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _draw_histograms(ax: Any, hists: list[tuple[str, tuple[list[float], list[float]]]]) -> None:
    """Each series as stairs of its own buckets (fraction of coordinates per bucket), symlog x-axis."""
    import numpy as np

    if not hists:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        return
    for label, (edges, counts) in hists:
        ax.stairs(np.asarray(counts, dtype=float) / max(sum(counts), 1.0), edges, label=label)
    from matplotlib.ticker import FixedLocator, LogFormatterSciNotation

    all_edges = [e for _, (e, _) in hists]
    linthresh = _linthresh(all_edges)
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.xaxis.set_major_locator(FixedLocator(symlog_ticks([x for e in all_edges for x in e], linthresh)))
    ax.xaxis.set_major_formatter(LogFormatterSciNotation(base=10, labelOnlyBase=False, linthresh=linthresh))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8)


def symlog_ticks(values: Sequence[float], linthresh: float, per_side: int = 3) -> list[float]:
    """At most ``per_side`` decades on each side of 0 (evenly spread between the linear threshold and the
    largest |value|), and 0 itself: the labels of a symlog axis near 0 never overlap."""
    ticks = [0.0]
    for sign in (-1.0, 1.0):
        side = [abs(v) for v in values if v * sign > 0]
        if not side:
            continue
        hi = math.ceil(math.log10(max(side)))
        # decades within ~100× of the linear threshold sit next to 0 on screen: 0 labels that region
        lo = min(hi, max(math.floor(math.log10(min(side))), math.floor(math.log10(linthresh)) + 2))
        step = max(1, math.ceil((hi - lo) / per_side))
        ticks += [sign * 10.0**k for k in range(hi, lo - 1, -step)][:per_side]
    return sorted(ticks)


def _linthresh(all_edges: list[list[float]]) -> float:
    """The smallest non-zero |bucket limit|: below it the writer's buckets are linear anyway."""
    magnitudes = [abs(x) for edges in all_edges for x in edges if x != 0]
    return max(min(magnitudes), 1e-30) if magnitudes else 1.0


def _draw_medians(ax: Any, acc: Any) -> None:
    for family, label in ((tags.V, "median private v̂"), (tags.CLEAN_V, "median clean v^c (NOT private)"),
                          (tags.V_MINUS_PHI, "median v̂ − Φ")):
        series = scalar_series(acc, _median_tag(family))
        if series:
            ax.plot(list(series), [abs(v) for v in series.values()], marker=".", label=f"|{label}|")
    phi = scalar_series(acc, tags.PHI)
    if phi:
        ax.plot(list(phi), list(phi.values()), "k--", label="Φ")
    ax.set(title="second moment vs noise variance Φ", xlabel="optimizer step", ylabel="gradient units²",
           yscale="log")
    ax.legend(fontsize=8)


# ----------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    """The ``report`` subcommand's argument parser."""
    p = argparse.ArgumentParser(prog="lightning-dp report", description=__doc__.splitlines()[0])
    p.add_argument("logdir", nargs="?", default=None,
                   help="run directory holding the TensorBoard event files (e.g. lightning_logs/version_0); "
                        "default: the latest monitored run under lightning_logs/")
    p.add_argument("--out", default=None,
                   help=f"PNG to write (default: {DEFAULT_NAME} in the run's folder, beside its event files)")
    p.add_argument("--early", type=int, help="early step for the table (default: the first logged step)")
    p.add_argument("--late", type=int, help="late step for the table and figure (default: the last logged step)")
    return p


def _pick(steps: list[int], wanted: Optional[int], default: int) -> int:
    if wanted is None:
        return default
    return min(steps, key=lambda s: abs(s - wanted))


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``lightning-dp report``; returns the exit status (2 on a log directory it cannot use)."""
    args = build_parser().parse_args(argv)
    try:
        logdir = Path(args.logdir) if args.logdir is not None else latest_run(Path("lightning_logs"))
        if args.logdir is None:
            print(f"run: {logdir} (the latest under lightning_logs/)")
        run, acc = find_run(logdir)
        out = Path(args.out) if args.out is not None else run / DEFAULT_NAME
        steps = sorted(scalar_series(acc, _median_tag(tags.V)))
        early, late = _pick(steps, args.early, steps[0]), _pick(steps, args.late, steps[-1])
        shown = [early] if early == late else [early, late]
        print(f"## Second-moment statistics (early step {early}, late step {late})\n")
        print(table_markdown(acc, shown))
        plot_report(acc, late, str(out))
    except ReportError as err:
        print(f"lightning-dp report: error: {err}", file=sys.stderr)
        return 2
    print(f"\nfigure written to {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
