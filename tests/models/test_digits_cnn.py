"""DigitsCNN, the main job's model, as Lightning's model summary shows it."""

from __future__ import annotations

from pytorch_lightning.utilities.model_summary import ModelSummary

from lightning_dp.models import DigitsCNN


def test_the_model_summary_shows_the_models_flops_and_sizes():
    """An example input (zeros: no data) lets Lightning's summary count FLOPs ('Total FLOPs: 0' before, issue 35)."""
    summary = ModelSummary(DigitsCNN(), max_depth=1)
    assert summary.total_flops > 100_000
    assert summary.in_sizes[0] == [1, 1, 8, 8] and summary.out_sizes[1] == [1, 10]
