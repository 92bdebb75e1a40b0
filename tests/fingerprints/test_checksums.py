"""The contents of parameters and floating buffers, compared at every fingerprint (fingerprints/checksums.py): on the
CPU bit for bit against a copy, so a write through ``.data`` or a NumPy view (neither moves the version counter) shows
whatever it writes — a sign flip, a swap, the lowest bit of a mantissa — where the L2 norms compared before missed
the first three."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from lightning_dp.fingerprints import checksums
from lightning_dp.fingerprints.checksums import _Contents, norm_tokens
from lightning_dp.validators.kept_state import StateFingerprint


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    model.register_buffer("mean", torch.randn(5))
    return model


def _weight(model: nn.Module) -> torch.Tensor:
    return model[0].weight.data  # a fresh version counter: the write moves none the fingerprint keys on


def _low_bit(model: nn.Module) -> None:
    _weight(model).view(torch.int32)[2, 3] ^= 1


def _sign_flip(model: nn.Module) -> None:
    _weight(model)[1, 1].neg_()


def _swap(model: nn.Module) -> None:
    w = _weight(model)
    a, b = w[0, 0].item(), w[5, 6].item()
    w[0, 0], w[5, 6] = b, a


def _same_sum(model: nn.Module) -> None:
    w = _weight(model)
    w[0, 0] += 0.5
    w[0, 1] -= 0.5


def _nan(model: nn.Module) -> None:
    _weight(model)[4, 4] = float("nan")


def _through_numpy(model: nn.Module) -> None:
    view = model[0].weight.detach().numpy()  # shares the version counter, and a NumPy write moves none
    view[3, 3] = -view[3, 3]


WRITES: dict[str, Callable[[nn.Module], None]] = {
    "lowest mantissa bit": _low_bit, "sign flip": _sign_flip, "two elements swapped": _swap,
    "sum and norm kept": _same_sum, "NaN": _nan, "through a NumPy view": _through_numpy,
}


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_every_write_to_a_weight_between_two_fingerprints_shows(write: str) -> None:
    model = _model()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    version = model[0].weight._version
    with torch.no_grad():
        WRITES[write](model)
    assert model[0].weight._version == version  # only the contents can tell
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of parameter 0.weight"]


def test_a_zero_made_negative_shows() -> None:
    model = _model()
    _weight(model)[6, 6] = 0.0
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    _weight(model)[6, 6] = -0.0
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of parameter 0.weight"]


def test_a_write_to_a_float_buffer_through_data_names_the_buffer_only() -> None:
    model = _model()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    model.mean.data[2] = -model.mean.data[2]
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of buffer mean"]


def test_unchanged_contents_compare_equal_even_holding_a_nan() -> None:
    model = _model()
    _weight(model)[0, 0] = float("nan")  # a NaN equals itself bit for bit: no refusal every step after a divergence
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    assert StateFingerprint.changed(before, fingerprint.take()) == []


def test_the_optimizer_step_shows_and_its_result_is_the_next_baseline() -> None:
    model = _model()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    after = fingerprint.take()
    changed = StateFingerprint.changed(before, after)
    assert {"contents of parameter 0.weight", "contents of parameter 1.bias"} <= set(changed)
    assert StateFingerprint.changed(after, fingerprint.take()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_compare_by_their_bits(dtype: torch.dtype) -> None:
    weight = torch.randn(4, 4).to(dtype)
    before = norm_tokens([("parameter w", weight)])
    weight.view({2: torch.int16, 8: torch.int64}[weight.element_size()])[1, 2] ^= 1
    after = norm_tokens([("parameter w", weight)])
    assert isinstance(after["contents of parameter w"], _Contents)
    assert before != after
    assert after == norm_tokens([("parameter w", weight)])


def test_a_token_compares_with_another_layout_by_its_own_bits() -> None:
    a, b = torch.randn(3), torch.randn(4)
    one = norm_tokens([("parameter a", a), ("parameter b", b)])
    alone = norm_tokens([("parameter b", b)])  # b's span is elsewhere in a snapshot of another layout
    assert one["contents of parameter b"] == alone["contents of parameter b"]
    assert one["contents of parameter a"] != alone["contents of parameter b"]


def test_past_the_snapshot_size_the_norms_are_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "SNAPSHOT_BYTES", 0)
    model = _model()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    assert isinstance(before["contents of parameter 0.weight"], float)
    model[0].weight.data.mul_(2.0)
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of parameter 0.weight"]


def test_contents_as_copied_last_are_held_by_that_copy_and_a_later_write_still_shows() -> None:
    model = _model()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    again = fingerprint.take()  # nothing written: the copy of the first is held again, none made
    assert again["contents of parameter 0.weight"].snapshot is before["contents of parameter 0.weight"].snapshot
    _sign_flip(model)
    assert StateFingerprint.changed(again, fingerprint.take()) == ["contents of parameter 0.weight"]
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of parameter 0.weight"]


@pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "numpy"])
def test_a_write_shows_to_either_comparison_and_on_a_strided_parameter(memcmp: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if not memcmp:
        monkeypatch.setattr(checksums, "_MEMCMP", None)
    model = _model()
    model[1].weight = nn.Parameter(torch.randn(8, 3).t())  # not contiguous: compared through a copy
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    model[1].weight.data[2, 5] = -model[1].weight.data[2, 5]
    _low_bit(model)
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of parameter 0.weight",
                                                                    "contents of parameter 1.weight"]


@pytest.mark.parametrize("change", ["data of another shape", "data of the same shape", "set_ to another size",
                                    "parameter replaced"])
def test_a_group_layout_kept_between_fingerprints_still_sees_a_swap_or_a_new_parameter(change: str) -> None:
    """:func:`norm_tokens` keeps each group's names, snapshot key and tokens (``Checksums.layouts``) while it holds
    the same tensors with the same shapes: a ``.data`` swap (same identity and version counter; another shape with
    the same bytes, or other bytes), a ``set_`` to another size and a parameter replaced in its slot are each seen."""
    model = _model()
    fingerprint = StateFingerprint(model)
    fingerprint.take()
    before = fingerprint.take()  # from the kept layout
    kept = dict(fingerprint._sums.layouts)
    weight = model[0].weight
    with torch.no_grad():
        if change == "data of another shape":
            weight.data = weight.data.clone().reshape(4, 16)  # the same bits, laid out otherwise
        elif change == "data of the same shape":
            weight.data = weight.data.clone().neg()
        elif change == "set_ to another size":
            weight.set_(torch.zeros(3, 3))
        else:
            model[0].weight = nn.Parameter(weight.detach().clone())  # the same bits in a new parameter
    changed = StateFingerprint.changed(before, fingerprint.take())
    contents = change != "parameter replaced"  # a new parameter with the same bits: only its identity differs
    assert "parameter 0.weight" in changed and ("contents of parameter 0.weight" in changed) == contents, changed
    assert not [c for c in changed if "0.weight" not in c], changed
    # made anew where the tensors or shapes differ; kept for other bytes in the same shape (the copy tells those)
    assert (fingerprint._sums.layouts == kept) == (change == "data of the same shape")


@pytest.mark.parametrize("where", [0, 17, 39, "empty"])
def test_the_copy_compared_in_c_loops_still_sees_a_write_to_any_tensor(where: object) -> None:
    """perf31: a copy of many contiguous tensors is compared with them in C loops (``memcmp`` per tensor, no Python
    per tensor); the lowest bit of any one of them written through ``.data`` (no version counter moves) shows, and with
    an empty tensor among them the comparison tensor by tensor runs instead, seeing the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(40)))
    if where == "empty":
        model.append(nn.Linear(0, 4, bias=False))
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    snapshot = before["contents of parameter 0.weight"].snapshot
    assert fingerprint.take()["contents of parameter 0.weight"].snapshot is snapshot  # held: every tensor compared
    assert snapshot._places is not None and all(snapshot._places[1]) == (where != "empty")  # which comparison ran
    index = 20 if where == "empty" else int(where)  # type: ignore[call-overload]
    model[index].weight.data.view(torch.int32)[3, 1] ^= 1
    assert StateFingerprint.changed(before, fingerprint.take()) == [f"contents of parameter {index}.weight"]
