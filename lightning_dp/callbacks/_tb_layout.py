"""One TensorBoard dashboard for lightning_dp's callbacks (TensorBoard's ``custom_scalars`` plugin).

:class:`~lightning_dp.callbacks.PrivacyBudget` and
:class:`~lightning_dp.callbacks.SecondMomentMonitor` call :func:`write_layout` at fit start;
the layout is built from *all* lightning_dp callbacks of the trainer and written once per
TensorBoard writer, whichever callback comes first. It shows, in TensorBoard's "Custom Scalars"
tab:

* ``privacy``: ε spent against the target ε (PrivacyBudget), the noise multiplier σ, and the
  clip fraction when the monitor's non-private diagnostics are on (labelled NOT private);
* ``training``: the module's own validation accuracy and train/validation loss, matched by
  Lightning's usual names (``val/acc``, ``val_acc``, ``val/top1_acc``…, ``train/loss``, ``val_loss``);
* ``v_t``: Φ against the median v̂ and the median v̂ − Φ̄, the v̂ quartile band and the share of
  coordinates with v̂ − Φ̄ < 0 (SecondMomentMonitor).

Multiline charts take regular expressions (matched from the start of a tag): every tag here is
escaped and anchored, so ``vt/v/all/median`` does not also pick up ``nonprivate/vt/v/all/median``.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Iterable

from lightning_fabric.loggers.tensorboard import TensorBoardLogger as _TensorBoardLoggerBase

from lightning_dp.callbacks import _monitor_tags as tags

#: PrivacyBudget's tags (written by :mod:`lightning_dp.callbacks.privacy_budget`)
EPSILON = "privacy/epsilon"
TARGET_EPSILON = "privacy/target_epsilon"
NOISE_MULTIPLIER = "privacy/noise_multiplier"

#: the user's metrics the dashboard draws (regular expressions, matched from a tag's start)
VAL_ACCURACY = r"val[/_].*acc"
LOSSES = r"(train|val)[/_]loss"

#: the tag TensorBoard stores a custom-scalars layout under
CONFIG_TAG = "custom_scalars__config__"

_written: "weakref.WeakSet[Any]" = weakref.WeakSet()  # writers that already hold a layout


def _exact(tag: str) -> str:
    return f"{re.escape(tag)}$"


def layout_for(callbacks: Iterable[Any]) -> dict[str, dict[str, list[Any]]]:
    """The layout (``SummaryWriter.add_custom_scalars`` format) for the lightning_dp callbacks among ``callbacks``."""
    from lightning_dp.callbacks.privacy_budget import PrivacyBudget
    from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor

    callbacks = list(callbacks)
    budgets = [c for c in callbacks if isinstance(c, PrivacyBudget)]
    monitors = [c for c in callbacks if isinstance(c, SecondMomentMonitor)]
    layout: dict[str, dict[str, list[Any]]] = {}
    privacy: dict[str, list[Any]] = {}
    if budgets:
        epsilon = [_exact(EPSILON)]
        if any(b.target_epsilon is not None for b in budgets):
            epsilon.append(_exact(TARGET_EPSILON))
        privacy["ε spent (and target ε)"] = ["Multiline", epsilon]
        privacy["noise multiplier σ"] = ["Multiline", [_exact(NOISE_MULTIPLIER)]]
    if any(m.non_private for m in monitors):
        privacy["clip fraction (NOT private)"] = ["Multiline", [_exact(tags.CLIP_FRACTION)]]
    if privacy:
        layout["privacy"] = privacy
    if budgets or monitors:  # the user's own metrics, by Lightning's usual names, beside what the noise does
        layout["training"] = {
            "validation accuracy (val/…acc…)": ["Multiline", [VAL_ACCURACY]],
            "loss (train/loss, val/loss)": ["Multiline", [LOSSES]],
        }
    if monitors:
        median = lambda family: tags.stat_tag(family, "all", "median")  # noqa: E731
        layout["v_t"] = {
            "Φ vs median v̂ and median v̂ − Φ̄": [
                "Multiline", [_exact(tags.PHI), _exact(median(tags.V)), _exact(median(tags.V_MINUS_PHI))]],
            "v̂: median and Q1–Q3": [
                "Margin", [median(tags.V), tags.stat_tag(tags.V, "all", "q1"), tags.stat_tag(tags.V, "all", "q3")]],
            "share of coordinates with v̂ − Φ̄ < 0": ["Multiline", [_exact(tags.FRAC_NEGATIVE)]],
        }
    return layout


def write_layout(trainer: Any) -> None:
    """Write :func:`layout_for` ``trainer.callbacks`` to every TensorBoard logger, once per writer (rank 0)."""
    if not getattr(trainer, "is_global_zero", True):
        return
    loggers = [lg for lg in getattr(trainer, "loggers", []) if isinstance(lg, _TensorBoardLoggerBase)]
    if not loggers:
        return
    layout = layout_for(getattr(trainer, "callbacks", []))
    if not layout:
        return
    for logger in loggers:
        writer = logger.experiment
        if writer in _written or not hasattr(writer, "add_custom_scalars"):
            continue
        writer.add_custom_scalars(layout)
        _written.add(writer)
