"""Whether a value holds the training records (lightning_dp/records/held_records.py): row digests and the match."""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.records.held_records import DIGESTED_DTYPES, holds_records, row_digest_array, row_digests
from lightning_dp.record_checks.outside_records import _FLOAT_BITS, _INT_BITS


def test_the_digested_dtypes_are_those_the_exchange_can_flip():
    assert DIGESTED_DTYPES == set(_FLOAT_BITS) | set(_INT_BITS)


def test_every_row_has_its_digest_in_order_repeats_included():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    digests = row_digest_array(torch.cat([x, x[1:2]]))
    assert digests.shape == (5,) and digests.dtype == np.uint64
    assert len(set(digests[:4].tolist())) == 4 and digests[4] == digests[1]
    assert np.array_equal(row_digest_array(x.clone()), digests[:4])
    assert set(row_digests(x)) == set(digests[:4].tolist())


def test_rows_a_float16_copy_and_an_affine_image_hold_the_records_and_a_statistic_does_not():
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    rows = row_digests(x)
    assert rows is not None and len(rows) == 64
    assert holds_records(x[10:30].clone(), x, rows)
    assert holds_records(x.half(), x, rows)
    assert holds_records(x.numpy() * 2.0 + 1.0, x, rows)
    assert holds_records(torch.cat([x, torch.ones(64, 1)], 1), x, rows)
    assert not holds_records(x.mean(0, keepdim=True).repeat(8, 1), x, rows)
    assert not holds_records(torch.randn(16, 5), x, rows)


def test_a_row_many_records_share_is_nobodys_and_labels_match_only_whole():
    one_hot = torch.eye(3)[torch.arange(30) % 3]
    assert row_digests(one_hot) == set()
    y = torch.arange(40) % 4
    assert row_digests(y) is None
    assert holds_records(y.clone(), y, None)
    assert not holds_records(y[:20].clone(), y, None)
    assert not holds_records(np.zeros((4, 5), np.float32), torch.zeros(8, 5), row_digests(torch.zeros(8, 5)))
