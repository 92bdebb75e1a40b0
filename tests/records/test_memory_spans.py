"""Byte ranges of tensors and NumPy arrays (lightning_dp/records/memory_spans.py): views of either stride sign lie
inside their base's range, disjoint slices do not overlap, the whole buffer covers every view."""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.records.memory_spans import memory_owner, memory_span


def _overlap(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def test_tensor_views_lie_inside_their_base_and_disjoint_slices_do_not_overlap():
    base = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    whole = memory_span(base)
    assert whole[2] - whole[1] == 40 * 4
    top, bottom = memory_span(base[:5]), memory_span(base[5:])
    assert not _overlap(top, bottom)
    assert _overlap(top, whole) and _overlap(bottom, whole)
    column = memory_span(base[:, 1])
    assert whole[1] < column[1] and column[2] < whole[2]
    assert memory_span(base[5:], whole_storage=True) == whole  # the storage of the slice is the base's


def test_numpy_negative_strides_and_root_buffer():
    base = np.arange(40, dtype=np.float64).reshape(10, 4)
    flipped = base[::-1, ::-1]
    assert memory_span(flipped) == memory_span(base)
    half = base[5:]
    assert memory_span(half)[1] == memory_span(base)[1] + 5 * 4 * 8
    assert memory_span(half, whole_storage=True) == memory_span(base, whole_storage=True)
    assert memory_owner(half[1:][::2]) is memory_owner(base) is base.base


def test_other_values_have_no_span_and_empty_ones_a_range():
    assert memory_span([1.0, 2.0]) is None
    empty = torch.empty(0)
    span = memory_span(empty)
    assert span[2] > span[1]
    assert memory_owner(torch.ones(3)[1:])._base is None
