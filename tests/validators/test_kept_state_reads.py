"""How the release boundary's fingerprint (validators/kept_state.py) reads a layer's parameter table: once per slot, by
the table's plain lookup, so a table the engine watches (grad_sample/capture/root_parameters.py: its ``__getitem__``
inspects the caller's frame) costs no frame inspection per parameter a fingerprint (issue 38); the values read, and
the entries, are the same."""

from __future__ import annotations

import sys

import torch
from torch import nn

from lightning_dp.validators.kept_state import StateFingerprint


class CountingTable(dict):
    reads: list[str] = []  # the files whose code read a slot by ``table[key]``

    def __getitem__(self, key):
        type(self).reads.append(sys._getframe(1).f_code.co_filename)
        return super().__getitem__(key)


def test_a_watched_table_is_read_without_its_getitem():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = StateFingerprint(model).take()
    for layer in (model[0], model[2]):
        layer._parameters = CountingTable(layer._parameters)
    fingerprint = StateFingerprint(model)
    after = fingerprint.take()
    assert not [f for f in CountingTable.reads if f.endswith("kept_state.py")]
    assert before == after and {"parameter 0.weight", "parameter 2.bias"} <= set(after)
    with torch.no_grad():
        model[2].bias.add_(1.0)  # a write still shows
    assert "parameter 2.bias" in StateFingerprint.changed(after, fingerprint.take())
