"""The entries of layers and parameters put in place since a baseline (fingerprints/replaced_objects.py)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.fingerprints.replaced_objects import replaced_entries
from lightning_dp.validators.kept_state import StateFingerprint


def test_only_the_entries_of_new_objects_are_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2), nn.BatchNorm1d(2)).eval()
    fingerprint = StateFingerprint(model)
    fingerprint.take()
    held = fingerprint.held
    model[3].running_mean.add_(1.0)  # written in place: the same layer, the same buffer
    model[1] = nn.BatchNorm1d(8).eval()  # a new layer: its buffers, parameters and mode are its own
    model[0].weight = nn.Parameter(torch.zeros(8, 4))  # a parameter rebound in a layer that stays
    model[0].weight.note = 1
    names = replaced_entries(held, model, list(fingerprint.take()) + ["global x.y", "class attribute A.b"])
    assert {"parameter 1.weight", "buffer 1.running_mean", "mode 1", "parameter 0.weight",
            "attribute 0.weight.note"} <= set(names)
    assert not [n for n in names if "0.bias" in n or "2." in n or "3." in n or n.startswith(("global", "class"))], names


def test_nothing_is_new_in_an_unchanged_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fingerprint = StateFingerprint(model)
    names = list(fingerprint.take())
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    assert replaced_entries(fingerprint.held, model, names) == []


def test_the_held_objects_kept_between_fingerprints_follow_a_rebound_parameter():
    """A fingerprint's ``held`` (the tree and the parameters in their slots) is the last one again while every slot
    holds the same object: a parameter rebound since is held as the new one by the next fingerprint."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fingerprint = StateFingerprint(model)
    fingerprint.take()
    names = list(fingerprint.take())  # its held objects kept from the first
    held = fingerprint.held
    model[2].bias = nn.Parameter(torch.zeros(2))
    assert replaced_entries(held, model, names) == ["parameter 2.bias", "contents of parameter 2.bias"]
    names = list(fingerprint.take())
    assert replaced_entries(fingerprint.held, model, names) == []
