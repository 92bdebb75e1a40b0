"""records/subset_chain.py: the dataset under its Subset wrappers and the indices of it a selection reads."""

from __future__ import annotations

import torch
from torch.utils.data import Subset, TensorDataset

from lightning_dp.records.subset_chain import selected_rows, subset_levels


def test_nested_subsets_map_positions_down_to_the_base_with_negative_indices_from_the_end():
    base = TensorDataset(torch.arange(10.0)[:, None])
    outer = Subset(Subset(base, [9, 8, -3, 1]), [2, 0])  # -3 is record 7
    levels = subset_levels(outer)
    assert [d for d, _ in levels][-1] is base and len(levels) == 3
    assert levels[-1][1] == [7, 9]
    assert selected_rows(outer) == (base, {7, 9})
    assert selected_rows(outer, [1]) == (base, {9})


def test_a_dataset_without_subsets_reads_all():
    base = TensorDataset(torch.zeros(3, 1))
    assert selected_rows(base) == (base, None) and subset_levels(base) == [(base, None)]


def test_public_overlap_sees_a_training_record_selected_by_a_negative_index():
    from lightning_dp.record_statistics.public_overlap import _subset_chain

    base = TensorDataset(torch.randn(10, 3))
    _, positions = _subset_chain(Subset(base, [-1, 0]))
    assert positions.tolist() == [9, 0]
