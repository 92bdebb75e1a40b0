"""Kept state without a ``__dict__`` (validators/kept_state.py): bytes kept in a ``bytearray``, an ``array.array``, a
``memoryview``, an in-memory ``BytesIO``/``StringIO``, or written to a file the module holds open, are seen when the
step writes them (contents, or a stream's position), where identity alone would miss an in-place write."""

from __future__ import annotations

import array
import io

import pytest
from torch import nn

from lightning_dp.validators.kept_state import StateFingerprint


def _holder(tmp_path) -> nn.Module:
    m = nn.Module()
    m.layer = nn.Linear(2, 2)
    m.raw = bytearray(8)
    m.view = memoryview(bytearray(8))
    m.floats = array.array("f", [0.0, 0.0])
    m.bytes_log = io.BytesIO()
    m.text_log = io.StringIO()
    m.file = open(tmp_path / "kept.bin", "wb")  # noqa: SIM115  (closed by the test)
    return m


WRITES = {
    "raw": lambda m: m.raw.__setitem__(0, 7),
    "view": lambda m: m.view.__setitem__(1, 7),
    "floats": lambda m: m.floats.__setitem__(1, 0.5),
    "bytes_log": lambda m: m.bytes_log.write(b"label=1"),
    "text_log": lambda m: m.text_log.write("label=1"),
    "file": lambda m: m.file.write(b"label=1"),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_an_in_place_write_is_seen(name, tmp_path):
    m = _holder(tmp_path)
    try:
        fingerprint = StateFingerprint(m)
        before = fingerprint.take()
        assert StateFingerprint.changed(before, fingerprint.take()) == []
        WRITES[name](m)
        assert StateFingerprint.changed(before, fingerprint.take()) == [f"attribute {name}"]
    finally:
        m.file.close()


def test_an_overwrite_of_the_same_length_in_memory_is_seen():
    m = nn.Module()
    m.log = io.BytesIO(b"label=0")
    fingerprint = StateFingerprint(m)
    before = fingerprint.take()
    m.log.seek(0)
    m.log.write(b"label=1")  # same position and length afterwards: only the contents differ
    assert StateFingerprint.changed(before, fingerprint.take()) == ["attribute log"]
