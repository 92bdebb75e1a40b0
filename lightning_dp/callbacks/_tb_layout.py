"""One TensorBoard dashboard for lightning_dp's callbacks (TensorBoard's ``custom_scalars`` plugin).

:class:`~lightning_dp.callbacks.PrivacyBudget` and
:class:`~lightning_dp.callbacks.SecondMomentMonitor` call :func:`write_layout` at fit start;
the layout is built from *all* lightning_dp callbacks of the trainer and written once per
TensorBoard writer, whichever callback comes first. It shows, in TensorBoard's "Custom Scalars"
tab:

* ``privacy``: ε spent against the target ε (PrivacyBudget), the noise multiplier σ, and the
  clip fraction when the monitor's non-private diagnostics are on (labelled NOT private);
* ``training``: the module's own validation accuracy, train loss and validation loss, each its own chart, matched by
  Lightning's usual names (``val/acc``, ``val_acc``, ``val/top1_acc``…, ``train/loss``, ``val_loss``);
* ``v_t``: the median v̂ with its Q1–Q3 band against Φ, the median v̂ − Φ̄, and the share of coordinates with
  v̂ − Φ̄ < 0 (SecondMomentMonitor).

What the layout proto (``tensorboard/plugins/custom_scalar/layout.proto``) allows, and what follows from it:

* **Smoothing**: a chart has no smoothing setting. The dashboard's smoothing slider (0.6 by default) applies to
  ``Multiline`` charts only; a ``Margin`` chart is drawn unsmoothed (its card passes no smoothing to the line
  chart). ε, its target, σ and Φ are therefore ``Margin`` series whose band is the value itself (value = lower =
  upper): each chart shows the true values, e.g. ε ending at 3.00, not a smoothed 2.75.
* **Colours**: a chart has no colour setting either; the dashboard colours every line by its *run*, and tells a
  run's series apart by marker only (◼ ◆ ▲ ★ ✚, in the order the series are listed). Series that share a chart are
  therefore few and unlike (ε climbing to its flat target; v̂ and its band against Φ), and the others have their
  own charts (train and validation loss, v̂ − Φ̄).

Multiline charts take regular expressions (matched from the start of a tag): every tag here is
escaped and anchored, so ``vt/v/all/median`` does not also pick up ``nonprivate/vt/v/all/median``. Margin series
name tags exactly.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Iterable

from lightning_fabric.loggers.tensorboard import TensorBoardLogger as _TensorBoardLoggerBase

import lightning_dp.callbacks._monitor_tags as tags

BUDGET, MONITOR = "budget", "monitor"
"""The ``layout_role`` of :class:`~lightning_dp.callbacks.PrivacyBudget` and
:class:`~lightning_dp.callbacks.SecondMomentMonitor`: what each contributes to the layout (a class attribute, so
this module needs not import the callbacks that call it)."""

#: PrivacyBudget's tags (written by :mod:`lightning_dp.callbacks.privacy_budget`)
EPSILON = "privacy/epsilon"
TARGET_EPSILON = "privacy/target_epsilon"
NOISE_MULTIPLIER = "privacy/noise_multiplier"

#: the user's metrics the dashboard draws (regular expressions, matched from a tag's start)
VAL_ACCURACY = r"val[/_].*acc"
TRAIN_LOSS = r"train[/_]loss"
VAL_LOSS = r"val[/_]loss"

#: the tag TensorBoard stores a custom-scalars layout under
CONFIG_TAG = "custom_scalars__config__"

_written: "weakref.WeakSet[Any]" = weakref.WeakSet()  # writers that already hold a layout


def _exact(tag: str) -> str:
    return f"{re.escape(tag)}$"


def _unsmoothed(*series: str) -> list[Any]:
    """A ``Margin`` chart drawing each tag as a line with no band (value = lower = upper): TensorBoard draws margin
    charts without smoothing, so the line is the logged values."""
    return ["Margin", [[tag, tag, tag] for tag in series]]


def layout_for(callbacks: Iterable[Any]) -> dict[str, dict[str, list[Any]]]:
    """The layout (``SummaryWriter.add_custom_scalars`` format) for the lightning_dp callbacks among ``callbacks``."""
    callbacks = list(callbacks)
    budgets = [c for c in callbacks if getattr(c, "layout_role", None) == BUDGET]
    monitors = [c for c in callbacks if getattr(c, "layout_role", None) == MONITOR]
    layout: dict[str, dict[str, list[Any]]] = {}
    privacy: dict[str, list[Any]] = {}
    if budgets:
        if any(b.target_epsilon is not None for b in budgets):
            privacy["ε spent ◼ and target ε ◆ (unsmoothed)"] = _unsmoothed(EPSILON, TARGET_EPSILON)
        else:
            privacy["ε spent (unsmoothed)"] = _unsmoothed(EPSILON)
        privacy["noise multiplier σ (unsmoothed)"] = _unsmoothed(NOISE_MULTIPLIER)
    if any(m.non_private for m in monitors):
        privacy["clip fraction (NOT private)"] = ["Multiline", [_exact(tags.CLIP_FRACTION)]]
    if privacy:
        layout["privacy"] = privacy
    if budgets or monitors:  # the user's own metrics, by Lightning's usual names, beside what the noise does
        layout["training"] = {
            "validation accuracy (val/…acc…)": ["Multiline", [VAL_ACCURACY]],
            "train loss (train/loss)": ["Multiline", [TRAIN_LOSS]],
            "validation loss (val/loss)": ["Multiline", [VAL_LOSS]],
        }
    if monitors:
        v_stat = lambda stat: tags.stat_tag(tags.V, "all", stat)  # noqa: E731
        layout["v_t"] = {
            "median v̂ ◼ (band: Q1–Q3) and Φ ◆ (unsmoothed)": [
                "Margin", [[v_stat("median"), v_stat("q1"), v_stat("q3")], [tags.PHI, tags.PHI, tags.PHI]]],
            "median v̂ − Φ̄": ["Multiline", [_exact(tags.stat_tag(tags.V_MINUS_PHI, "all", "median"))]],
            "share of coordinates with v̂ − Φ̄ < 0": ["Multiline", [_exact(tags.FRAC_NEGATIVE)]],
        }
    return layout


def layout_summary(layout: dict[str, dict[str, list[Any]]]) -> Any:
    """The ``custom_scalars__config__`` summary of ``layout``: what ``SummaryWriter.add_custom_scalars`` writes, except
    that a ``Margin`` chart may hold several series (``[[value, lower, upper], ...]``), which the layout proto allows
    and ``add_custom_scalars`` does not (one series per margin chart)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for title, charts in layout.items():
        drawn = []
        for name, (kind, content) in charts.items():
            if kind == "Margin":
                series = [layout_pb2.MarginChartContent.Series(value=v, lower=lo, upper=hi) for v, lo, hi in content]
                drawn.append(layout_pb2.Chart(title=name, margin=layout_pb2.MarginChartContent(series=series)))
            else:
                drawn.append(layout_pb2.Chart(title=name, multiline=layout_pb2.MultilineChartContent(tag=content)))
        categories.append(layout_pb2.Category(title=title, chart=drawn))
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout_pb2.Layout(category=categories).SerializeToString()],
                         tensor_shape=TensorShapeProto())
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    return Summary(value=[Summary.Value(tag=CONFIG_TAG, tensor=tensor, metadata=metadata)])


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
        if writer in _written or not hasattr(writer, "_get_file_writer"):
            continue
        writer._get_file_writer().add_summary(layout_summary(layout))  # as add_custom_scalars does
        _written.add(writer)
