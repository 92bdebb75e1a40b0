"""A record's fingerprint (records/record_fingerprint.py): equal values, equal digests; anything else differs."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from lightning_dp.records.record_fingerprint import fingerprint


def _digest(value):
    return fingerprint(value).digest


def test_equal_values_have_equal_digests_however_they_are_laid_out():
    x = torch.arange(12.0).view(3, 4)
    assert _digest((x.t().contiguous().t(), 1)) == _digest((x.clone(), 1))  # strides do not matter
    assert _digest({"a": x, "b": "text"}) == _digest({"b": "text", "a": x.clone()})  # nor a mapping's order
    assert _digest(np.arange(6).reshape(2, 3)[:, ::2]) == _digest(np.array([[0, 2], [3, 5]]))
    assert _digest({1, "a", b"b"}) == _digest({b"b", "a", 1})
    assert _digest(Image.new("L", (3, 2), 7)) == _digest(Image.new("L", (3, 2), 7))


@dataclass
class _Sample:
    text: str
    label: int


def test_different_values_types_or_shapes_differ():
    x = torch.arange(6.0)
    variants = [x, x.view(2, 3), x.double(), x.long(), x.numpy(), x.tolist(), tuple(x.tolist()), 1, 1.0, True,
                "1", b"1", None, [1, 2], [[1], 2], [1, [2]], ("ab", "c"), ("a", "bc"), np.float32(1.0),
                torch.tensor(1.0), torch.tensor(1.0).to(torch.bfloat16), _Sample("a", 1), _Sample("a", 2),
                namedtuple("P", "a b")(1, 2), (1, 2), {"a": 1}, {"a": 2}, {"b": 1}, -0.0, 0.0,
                Image.new("L", (3, 2), 7), Image.new("L", (2, 3), 7)]
    digests = [_digest(v) for v in variants]
    assert len(set(digests)) == len(digests)


def test_opaque_values_have_no_fingerprint():
    class Slots:
        __slots__ = ("v",)

    assert fingerprint((torch.zeros(2), Slots())) is None
    deep: list = []
    for _ in range(40):
        deep = [deep]
    assert fingerprint(deep) is None


def test_places_are_views_into_a_larger_buffer_only():
    data = torch.randn(5, 3)
    array = np.arange(15.0).reshape(5, 3)
    assert fingerprint((data[2], array[1])).places and len(fingerprint((data[2], array[1])).owners) == 2
    assert fingerprint(data[2]).places == fingerprint(data[2]).places != fingerprint(data[3]).places
    assert fingerprint((data[2].clone(), array[1].copy(), data)).places == ()  # fresh copies, a whole tensor
