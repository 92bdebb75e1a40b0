"""The TensorBoard custom-scalars layout shared by PrivacyBudget and SecondMomentMonitor."""

from __future__ import annotations

import re

import pytest
import pytorch_lightning as pl
from conftest import TinyClassifier, make_loader, quiet_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_dp import DPStrategy, PrivacyBudget, SecondMomentMonitor
from lightning_dp.callbacks import _monitor_tags as tags
from lightning_dp.callbacks._tb_layout import CONFIG_TAG, EPSILON, TARGET_EPSILON, layout_for


def _tags_of(chart: list) -> list[str]:
    kind, patterns = chart
    return patterns if kind == "Margin" else [p.rstrip("$").replace("\\", "") for p in patterns]


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
    drawn = {t for chart in layout["v_t"].values() for t in _tags_of(chart)}
    assert {tags.PHI, tags.stat_tag(tags.V, "all", "median"), tags.stat_tag(tags.V_MINUS_PHI, "all", "median"),
            tags.stat_tag(tags.V, "all", "q1"), tags.stat_tag(tags.V, "all", "q3"), tags.FRAC_NEGATIVE} <= drawn
    assert not any(tags.CLIP_FRACTION in _tags_of(c) for cat in layout.values() for c in cat.values())
    layout = layout_for([PrivacyBudget(), SecondMomentMonitor(diagnostics="non_private")])
    assert list(layout) == ["privacy", "training", "v_t"]
    assert any(_tags_of(c) == [tags.CLIP_FRACTION] for c in layout["privacy"].values())
    assert layout_for([pl.Callback()]) == {}


def test_patterns_are_anchored():
    (phi_chart, *_) = layout_for([SecondMomentMonitor()])["v_t"].values()
    median = phi_chart[1][1]
    assert re.match(median, tags.stat_tag(tags.V, "all", "median"))
    assert not re.match(median, tags.stat_tag(tags.CLEAN_V, "all", "median"))
    assert not re.match(median, tags.stat_tag(tags.V, "all", "median") + "_more")


@pytest.mark.parametrize("tag, drawn", [
    ("val/acc", "acc"), ("val_acc", "acc"), ("val/top1_acc", "acc"), ("train/acc", None), ("val/loss", "loss"),
    ("train_loss", "loss"), ("train/loss_step", "loss"), ("test/loss", None), ("privacy/epsilon", None)])
def test_the_training_section_draws_the_modules_usual_metric_names(tag, drawn):
    accuracy, loss = (chart[1] for chart in layout_for([PrivacyBudget()])["training"].values())
    found = {name for name, patterns in (("acc", accuracy), ("loss", loss)) if any(re.match(p, tag) for p in patterns)}
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
    assert len(acc.Tensors(CONFIG_TAG)) == 1
    assert {e.value for e in acc.Scalars(TARGET_EPSILON)} == {50.0}


def test_no_tensorboard_logger_no_layout(tmp_path):
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1, logger=logger,
                            callbacks=[PrivacyBudget(), SecondMomentMonitor()])
    trainer.fit(_AdamModule(), make_loader())  # nothing to write the layout to: no error
