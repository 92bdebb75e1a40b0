"""The main job (`make demo` = `lightning-dp fit --config configs/digits.yaml`), shortened to a few
steps: what a user opens TensorBoard for is in the event files, and the console stays quiet."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_dp._warnings import filter_upstream_noise
from lightning_dp.callbacks import _monitor_tags as tags
from lightning_dp.callbacks._tb_layout import CONFIG_TAG, EPSILON, NOISE_MULTIPLIER, TARGET_EPSILON
from lightning_dp.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"
STEPS, EVERY = 4, 2


def _callback(config: dict, name: str) -> dict:
    return next(c for c in config["trainer"]["callbacks"] if c["class_path"] == f"lightning_dp.{name}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The main job's config, run for STEPS steps (monitor every EVERY steps, validation every EVERY
    steps instead of every epoch of 20): (log dir, stdout, warnings raised)."""
    root = tmp_path_factory.mktemp("main_job")
    config = yaml.safe_load(CONFIG.read_text())
    assert _callback(config, "PrivacyBudget")["init_args"]["target_epsilon"] == \
        config["trainer"]["strategy"]["init_args"]["target_epsilon"]
    assert config["data"]["init_args"]["val_fraction"] > 0  # a real validation split
    _callback(config, "SecondMomentMonitor")["init_args"]["every_n_steps"] = EVERY
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
    short = root / "digits_short.yaml"
    short.write_text(yaml.safe_dump(config, allow_unicode=True))
    args = ["fit", "--config", str(short), f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={EVERY}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        mp.chdir(root)
        # What `lightning-dp fit` prints: Python's default filters (deprecations are shown only to
        # __main__), each warning every time; lightning_dp's callbacks add its narrow filter at setup.
        warnings.simplefilter("always")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        mp.setattr(sys, "argv", ["lightning-dp", *args])  # as from the command line
        out = io.StringIO()
        mp.setattr(sys, "stdout", out)
        lines = _Lines()
        # Lightning's rank-zero messages go to whichever of its two packages was imported last
        # (lightning_utilities keeps one logger for both): listen to both, at INFO as a fresh process has.
        lightning_logs = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch")]
        levels = [lg.level for lg in lightning_logs]
        for lg in lightning_logs:
            lg.addHandler(lines)
            lg.setLevel(logging.INFO)
        try:
            assert main(args) == 0
        finally:
            for lg, level in zip(lightning_logs, levels):
                lg.removeHandler(lines)
                lg.setLevel(level)
    (log_dir,) = (root / "lightning_logs").iterdir()
    return log_dir, out.getvalue(), caught, lines.messages


class _Lines(logging.Handler):
    """Every record Lightning's loggers emit (what the console would show on stderr)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def events(run):
    acc = EventAccumulator(str(run[0]), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_epsilon_and_target_are_logged(events):
    scalars = set(events.Tags()["scalars"])
    assert {EPSILON, TARGET_EPSILON, NOISE_MULTIPLIER} <= scalars
    epsilon = [e.value for e in events.Scalars(EPSILON)]
    assert 0 < epsilon[0] < epsilon[-1] <= 3.0 + 1e-9  # climbing, never past the target
    assert {e.value for e in events.Scalars(TARGET_EPSILON)} == {3.0}


def test_v_t_quartiles_phi_and_histograms_are_logged(events):
    scalars = set(events.Tags()["scalars"])
    for family in (tags.V, tags.V_MINUS_PHI):
        for stat in ("q1", "median", "q3"):
            tag = tags.stat_tag(family, "all", stat)
            assert tag in scalars, tag
            assert [e.step for e in events.Scalars(tag)] == [1, 2, 4]
    assert {tags.PHI, tags.FRAC_NEGATIVE} <= scalars
    histograms = set(events.Tags()["histograms"])
    assert {tags.HIST_V, tags.HIST_V_MINUS_PHI, tags.HIST_LOG10_V, tags.HIST_LOG10_V_OVER_PHI} <= histograms
    assert [h.step for h in events.Histograms(tags.HIST_LOG10_V_OVER_PHI)] == [2, 4]  # not the first-step log


def test_validation_accuracy_is_logged(events):
    acc = events.Scalars("val/acc")
    assert len(acc) == STEPS // EVERY  # every validation run (every epoch in the full job)
    assert all(0 <= e.value <= 1 for e in acc)


def test_the_custom_layout_puts_privacy_first(events):
    assert CONFIG_TAG in events.Tags()["tensors"]
    (event,) = events.Tensors(CONFIG_TAG)  # written once, though both callbacks write it
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["privacy", "training", "v_t"]
    privacy, training, v_t = layout.category
    assert [t for c in training.chart for t in c.multiline.tag if re.match(t, "val/acc")]
    epsilon_chart = privacy.chart[0]  # unsmoothed: margin series whose band is the value itself
    assert [(s.value, s.lower, s.upper) for s in epsilon_chart.margin.series] == [(EPSILON,) * 3, (TARGET_EPSILON,) * 3]
    phi_chart = v_t.chart[0]
    assert [s.value for s in phi_chart.margin.series] == [tags.stat_tag(tags.V, "all", "median"), tags.PHI]
    scalars = set(events.Tags()["scalars"])
    for category in layout.category:  # every chart draws tags that exist
        for chart in category.chart:
            if chart.HasField("multiline"):
                for pattern in chart.multiline.tag:
                    assert any(re.match(pattern, t) for t in scalars), pattern
            else:
                for series in chart.margin.series:
                    assert {series.value, series.lower, series.upper} <= scalars


def test_privacy_section_sorts_before_the_monitor_and_nothing_is_left_in_old_families(events):
    sections = sorted({t.split("/")[0] for t in events.Tags()["scalars"]})
    assert sections.index("privacy") < sections.index("vt")
    assert "hp_metric" not in sections  # the config turns off the placeholder chart
    assert not [t for t in events.Tags()["scalars"] if t.startswith(("v_stats", "v_minus_phi", "update/"))]


def test_the_console_is_quiet_and_ends_with_the_summary(run):
    _, out, caught, _ = run
    found = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert found == [], "\n".join(found)
    assert "test/acc:" in out and f"after {STEPS} steps" in out


def test_only_lightnings_leafspec_deprecation_is_filtered():
    message = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_upstream_noise()
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="pytorch_lightning.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "trees.py", 1, module="my_project.trees")  # not Lightning's
        warnings.warn_explicit("other", FutureWarning, "_pytree.py", 22, module="pytorch_lightning.utilities._pytree")
    assert [(w.filename, str(w.message)[:5]) for w in caught] == [("trees.py", message[:5]), ("_pytree.py", "other")]


def test_importing_lightning_dp_silences_lightnings_leafspec_warning(pytorch_lightning_imported_first):
    """In a fresh process (as `lightning-dp fit` or a user's script): the filter set at registration. The process,
    `import pytorch_lightning` then `import lightning_dp`, is tests/test_registry.py's of that order (conftest)."""
    _, result = pytorch_lightning_imported_first
    assert result.returncode == 0, result.stderr
    assert "LeafSpec" not in result.stderr and "a warning of our own" in result.stderr


def test_console_has_no_lightning_adverts(run):
    """Lightning's "💡 Tip: try litlogger/litmodels" lines are dropped by lightning-dp; its other
    information (the accelerator lines) still reaches the console."""
    messages = run[3]
    assert any("available" in m for m in messages), messages  # "GPU available: False ..." still shown
    assert not [m for m in messages if "💡" in m or "litlogger" in m or "litmodels" in m]


def test_the_run_ends_by_saying_where_to_look(run):
    log_dir, out = run[0], run[1]
    assert f"tensorboard --logdir {log_dir.parent}" in out
    assert f"lightning-dp report {log_dir}" in out
