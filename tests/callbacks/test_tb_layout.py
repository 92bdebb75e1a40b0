"""The TensorBoard custom-scalars layout shared by PrivacyBudget and SecondMomentMonitor."""

from __future__ import annotations

import re

import pytest
import pytorch_lightning as pl
from conftest import TinyClassifier, make_loader, quiet_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_dp import DPStrategy, PrivacyBudget, SecondMomentMonitor
from lightning_dp.callbacks import _monitor_tags as tags
from lightning_dp.callbacks._tb_layout import CONFIG_TAG, EPSILON, NOISE_MULTIPLIER, TARGET_EPSILON, layout_for


def _tags_of(chart: list) -> list[str]:
    """The tags a chart draws: a margin chart's series values, a multiline chart's patterns unescaped."""
    kind, content = chart
    return [value for value, _, _ in content] if kind == "Margin" else [p.rstrip("$").replace("\\", "") for p in content]


def test_privacy_only_without_a_monitor_and_no_target_line_without_a_target():
    layout = layout_for([PrivacyBudget()])
    assert list(layout) == ["privacy", "training"]
    (epsilon, *_) = layout["privacy"].values()
    assert _tags_of(epsilon) == [EPSILON]
    assert _tags_of(next(iter(layout_for([PrivacyBudget(target_epsilon=2.0)])["privacy"].values()))) == [
        EPSILON, TARGET_EPSILON]


def test_v_t_charts_and_the_clip_fraction_only_when_opted_in():
    layout = layout_for([SecondMomentMonitor()])
    assert list(layout) == ["training", "v_t"]
    drawn = {t for kind, content in layout["v_t"].values() for t in
             ([t for series in content for t in series] if kind == "Margin" else _tags_of([kind, content]))}
    assert {tags.PHI, tags.stat_tag(tags.V, "all", "median"), tags.stat_tag(tags.V_MINUS_PHI, "all", "median"),
            tags.stat_tag(tags.V, "all", "q1"), tags.stat_tag(tags.V, "all", "q3"), tags.FRAC_NEGATIVE} <= drawn
    assert not any(tags.CLIP_FRACTION in _tags_of(c) for cat in layout.values() for c in cat.values())
    layout = layout_for([PrivacyBudget(), SecondMomentMonitor(diagnostics="non_private")])
    assert list(layout) == ["privacy", "training", "v_t"]
    assert any(_tags_of(c) == [tags.CLIP_FRACTION] for c in layout["privacy"].values())
    assert layout_for([pl.Callback()]) == {}


def _charts(layout: dict, kind: str) -> list[list]:
    return [content for category in layout.values() for k, content in category.values() if k == kind]


def test_epsilon_its_target_sigma_and_phi_are_drawn_unsmoothed():
    """TensorBoard's smoothing slider (0.6 by default) smooths Multiline charts only; a Margin chart is drawn as logged.
    Each of these is a margin series whose band is the value itself (issue 35: a smoothed ε ended at 2.75 where the
    run had spent 3.00), and none is also in a smoothed chart."""
    layout = layout_for([PrivacyBudget(target_epsilon=3.0), SecondMomentMonitor()])
    margins = {tuple(series) for content in _charts(layout, "Margin") for series in content}
    smoothed = {t for content in _charts(layout, "Multiline") for t in _tags_of(["Multiline", content])}
    for tag in (EPSILON, TARGET_EPSILON, NOISE_MULTIPLIER, tags.PHI):
        assert (tag, tag, tag) in margins and tag not in smoothed, tag


def test_series_of_one_run_share_a_chart_only_where_they_are_told_apart():
    """The dashboard colours lines by run, not by series: a multiline chart draws one tag pattern, and a margin
    chart at most two unlike series (ε and its flat target; v̂'s band and Φ)."""
    layout = layout_for([PrivacyBudget(target_epsilon=3.0), SecondMomentMonitor(diagnostics="non_private")])
    assert all(len(content) == 1 for content in _charts(layout, "Multiline"))
    assert all(len(content) <= 2 for content in _charts(layout, "Margin"))


def test_patterns_are_anchored():
    (_, corrected, _) = layout_for([SecondMomentMonitor()])["v_t"].values()
    (median,) = corrected[1]
    tag = tags.stat_tag(tags.V_MINUS_PHI, "all", "median")
    assert re.match(median, tag)
    assert not re.match(median, "nonprivate/" + tag)
    assert not re.match(median, tag + "_more")


@pytest.mark.parametrize("tag, drawn", [
    ("val/acc", "acc"), ("val_acc", "acc"), ("val/top1_acc", "acc"), ("train/acc", None), ("val/loss", "loss"),
    ("train_loss", "loss"), ("train/loss_step", "loss"), ("test/loss", None), ("privacy/epsilon", None)])
def test_the_training_section_draws_the_modules_usual_metric_names(tag, drawn):
    accuracy, train_loss, val_loss = (chart[1] for chart in layout_for([PrivacyBudget()])["training"].values())
    found = {name for name, patterns in (("acc", accuracy), ("loss", train_loss + val_loss))
             if any(re.match(p, tag) for p in patterns)}
    assert found == ({drawn} if drawn else set())


class _AdamModule(TinyClassifier):
    def configure_optimizers(self):
        import torch

        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.mark.parametrize("callbacks", ["budget", "both"])
def test_written_once_per_run(tmp_path, callbacks):
    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="run")
    chosen = [PrivacyBudget(target_epsilon=50.0)] + ([SecondMomentMonitor(every_n_steps=2)] if callbacks == "both" else [])
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2, logger=logger, callbacks=chosen)
    trainer.fit(_AdamModule(), make_loader())
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    (event,) = acc.Tensors(CONFIG_TAG)
    assert {e.value for e in acc.Scalars(TARGET_EPSILON)} == {50.0}
    written = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    epsilon = written.category[0].chart[0]  # two margin series in one chart: beyond SummaryWriter.add_custom_scalars
    assert [(s.value, s.lower, s.upper) for s in epsilon.margin.series] == [(EPSILON,) * 3, (TARGET_EPSILON,) * 3]


def test_no_tensorboard_logger_no_layout(tmp_path):
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1, logger=logger,
                            callbacks=[PrivacyBudget(), SecondMomentMonitor()])
    trainer.fit(_AdamModule(), make_loader())  # nothing to write the layout to: no error
