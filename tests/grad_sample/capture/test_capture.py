"""Activation capture (grad_sample/capture/activations.py): keyword binding, example dimension, broadcast lookups."""

from __future__ import annotations

import torch
from conftest import at_freed_address
from torch import nn

from lightning_dp.grad_sample.capture.activations import ActivationCapture, bind_call


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x, scale=None, *, shift=None):
        out = x * self.w
        out = out if scale is None else out * scale
        return out if shift is None else out + shift


def test_keyword_and_positional_calls_record_alike():
    m = Scaled()
    x, s = torch.randn(2, 3), torch.randn(2, 3)
    args, kwargs = bind_call(m, (), {"x": x, "scale": s})
    assert len(args) == 2 and args[0] is x and args[1] is s and kwargs == {}
    args, kwargs = bind_call(m, (x,), {"shift": s})
    assert len(args) == 1 and args[0] is x and list(kwargs) == ["shift"]


def _captured(m: nn.Module, n, *inputs, **kw):
    capture = ActivationCapture()
    capture.attach([("m", m)])
    capture.begin_step(n)
    out = m(*inputs, **kw)
    out.sum().backward()
    return capture, out


def test_calls_with_another_example_dimension_are_refused_not_recorded():
    m = nn.Linear(3, 2)
    capture, _ = _captured(m, 4, torch.randn(12, 3))  # [B·T, d] with B = 4, a copy: no verified flattening
    assert capture.unserved() == {"m": [(12, 2)]}  # taken for a shared table, never broadcast over the examples
    assert not capture.any_recorded()
    capture.clear()
    capture, _ = _captured(m, 4, torch.randn(8, 4, 3))  # [T, B, d] with T ≠ B: time-major
    assert capture.mismatched() == {"m": [(8, 4, 2)]}
    capture.clear()


def test_a_one_row_lookup_is_recorded_per_example_where_it_meets_the_batch():
    """A [1, T] position lookup: the model gets its [1, T, d] output unchanged (a .repeat(B, 1, 1) or .view(B, …)
    of it keeps working); it is recorded as n rows, with example i's gradient from the broadcast site."""
    m = nn.Embedding(5, 3)
    capture = ActivationCapture()
    capture.attach([("m", m)])
    capture.begin_step(4)
    out = m(torch.arange(3)[None])
    assert out.shape == (1, 3, 3)
    h = torch.randn(4, 3, 3)
    (out + h).pow(2).sum().backward()
    rec = capture.completed()[id(m)].records[0]
    assert rec.args[0].shape == (4, 3) and rec.grad_out.shape == (4, 3, 3)
    torch.testing.assert_close(rec.grad_out, 2 * (out.detach() + h))  # row i: example i's own gradient
    assert capture.mismatched() == {}
    capture.clear()


def test_a_one_row_lookup_used_otherwise_than_broadcast_is_a_mismatch():
    m = nn.Embedding(5, 3)
    capture, out = _captured(m, 4, torch.arange(3)[None])  # out.sum(): never meets the examples
    assert capture.unserved() == {"m": [(1, 3, 3)]} and capture.mismatched() == {}
    capture.clear()


def test_arguments_seen_unbatched_are_never_sliced_later():
    m = Scaled()
    gate = torch.randn(3)  # [3]: the same length as a batch of 3
    capture = ActivationCapture()
    capture.attach([("m", m)])
    for n in (1, 3):
        capture.begin_step(n)
        m(torch.randn(n, 3), scale=gate).sum().backward()
    calls = capture.completed()[id(m)]
    assert calls.slot_dims(calls.records[0], 3) == ([0, None], {})


def test_begin_step_drops_what_an_earlier_forward_left():
    m = nn.Linear(3, 2)
    capture = ActivationCapture()
    capture.attach([("m", m)])
    m(torch.randn(2, 3)).sum().backward()  # e.g. a validation_step that differentiated
    capture.begin_step(5)
    assert capture.completed() == {}
    m(torch.randn(5, 3)).sum().backward()
    assert [r.grad_out.shape[0] for r in capture.completed()[id(m)].records] == [5]


def test_suspended_capture_records_nothing():
    m = nn.Linear(3, 2)
    capture = ActivationCapture()
    capture.attach([("m", m)])
    capture.begin_step(4)
    with capture.suspended():
        out = m(torch.randn(1, 3))
    assert out.shape == (1, 2) and not capture.any_recorded()


def test_a_finished_step_does_not_broadcast_later_calls():
    """After the step's statistics are taken (clear), a grad-enabled forward of one example, e.g. a
    saliency map in a callback, is the model's own output, not expanded to the last step's batch."""
    from torch.overrides import _get_current_function_mode_stack

    from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites

    m = nn.Embedding(5, 3)
    capture = ActivationCapture()
    capture.attach([("m", m)])
    capture.begin_step(4)
    (m(torch.arange(3)[None]) + torch.randn(4, 3, 3)).sum().backward()
    capture.clear()
    later = m(torch.arange(3)[None])
    assert later.shape == (1, 3, 3)
    assert not any(isinstance(mode, BroadcastSites) for mode in _get_current_function_mode_stack())


class _Owner(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.w, self.child = nn.Parameter(torch.randn(3, 3)), child

    def forward(self, x):
        return self.child(x @ self.w)


def test_a_module_owning_parameters_with_stateless_children_is_one_layer():
    """Mixture-of-experts `experts` (stacked weights, an act_fn child) are hooked as one layer; a child that draws
    (dropout) or mixes the batch (batch norm, even without state) keeps the module out, as does having no child."""
    from lightning_dp.grad_sample.capture.activations import is_unit, leaf_layers

    assert is_unit(_Owner(nn.SiLU())) and is_unit(_Owner(nn.Sequential(nn.GELU(), nn.Identity())))
    assert not is_unit(_Owner(nn.Dropout(0.1)))
    assert not is_unit(_Owner(nn.BatchNorm1d(3, affine=False, track_running_stats=False)))
    assert not is_unit(nn.Linear(3, 3))
    assert [name for name, _ in leaf_layers(nn.Sequential(_Owner(nn.SiLU()), nn.ParameterDict({"a": nn.Parameter(
        torch.ones(3))})))] == ["0"]  # a ParameterDict holds parameters, has no forward: never hooked


def test_a_batched_call_is_not_walked_for_flattened_rows(monkeypatch):
    """A call with the examples in one of its dimensions is no lookup: the autograd walks for flattened rows (which
    only ever tell a lookup apart from rows of examples) are not run for it (issue 38: per-call Python)."""
    import lightning_dp.grad_sample.capture.activations as activations

    walked = []
    monkeypatch.setattr(activations, "flattened_rows", lambda *a: walked.append("rows") or False)
    monkeypatch.setattr(activations, "example_minor_rows", lambda *a: walked.append("minor"))
    m = nn.Linear(3, 2)
    capture = ActivationCapture()
    capture.attach([("m", m)])
    capture.begin_step(4)
    m(torch.randn(4, 3)).sum().backward()
    assert walked == [] and [r.grad_out.shape for r in capture.completed()[id(m)].records] == [(4, 2)]
    capture.begin_step(4)
    m(torch.randn(3)).sum().backward()  # no dimension of 4: the walks decide, as before
    assert walked == ["rows", "minor"]
    capture.end_backward()
    capture.clear()


def test_a_layer_taking_a_freed_layers_id_is_judged_by_its_own_calls():
    """What the capture keeps per layer across detach and attach (arguments seen unbatched, lookups, time-major
    layouts) is kept per layer, not per id: a layer replaced since (a fine-tuning callback's) is freed, and the new
    one CPython may place at its address is not taken for it (its batched ``scale`` would not be sliced)."""
    capture = ActivationCapture()

    def used_and_freed() -> int:
        first = Scaled()
        capture.attach([("m", first)])
        capture.begin_step(1)
        first(torch.randn(1, 3), scale=torch.randn(3)).sum().backward()  # scale unbatched: never sliced for it
        capture.clear()
        capture.detach()
        return id(first)  # freed on return

    second, _ = at_freed_address(used_and_freed, Scaled, tries=30, count=100)
    capture.attach([("m", second)])
    capture.begin_step(3)
    second(torch.randn(3, 3), scale=torch.randn(3, 3)).sum().backward()
    calls = capture.completed()[id(second)]
    assert calls.slot_dims(calls.records[0], 3) == ([0, 0], {})


class _Gated(nn.Module):
    """An elementwise layer (verified as w ⊙ y + b) taking a second positional tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x, gate):
        return x * self.w * gate


def _plain_call_cases() -> list[tuple[nn.Module, tuple, bool]]:
    """(layer, positional arguments, whether the call is a common one) at n = 4."""
    torch.manual_seed(0)
    leaf = torch.randn(4, 3, requires_grad=True)
    return [
        (nn.Linear(3, 2), (torch.randn(4, 3),), True),
        (nn.Linear(3, 2), (leaf,), True),  # a leaf input requiring grad (FGSM's x0)
        (nn.Linear(3, 2), (torch.randn(4, 5, 3),), True),
        (nn.Linear(3, 2), (torch.randn(4, 4, 3),), False),  # n in dimension 1 of a position-wise layer: walked
        (nn.Conv2d(2, 3, 3), (torch.randn(4, 2, 6, 6),), True),
        (nn.LayerNorm(3), (torch.randn(4, 5, 3),), True),
        (nn.GroupNorm(2, 4), (torch.randn(4, 4, 5),), True),
        (_Gated(), (torch.randn(4, 3), torch.randn(3)), True),  # the gate seen without the examples: unbatched
        (_Gated(), (torch.randn(4, 3), torch.randn(4, 3)), True),
    ]


def _capture_of(m: nn.Module, args: tuple, plain: bool, reduced: bool) -> tuple[ActivationCapture, list]:
    capture = ActivationCapture()
    capture.plain_calls = plain
    capture.attach([("m", m)], (lambda layer: lambda rec: {"g": rec.grad_out * 2}) if reduced else lambda layer: None)
    capture.begin_step(4)
    out = m(*args)
    anchors = sorted(capture._anchors.values())
    (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
    return capture, anchors


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_common_calls_take_the_fast_path_and_capture_what_the_general_path_does(monkeypatch):
    """A common call (positional tensors, one output with the step's n examples in dimension 0, no lookup, no
    broadcast site) skips the general tests (issue 38: per-call Python); what it captures is what the general path
    captures: records (arguments, output gradients, the scaled operand, norm statistics), arguments seen unbatched,
    anchors, parameters, leaf inputs, reduced gradients. Any other call still takes the general path."""
    general = []
    original = ActivationCapture._flattened_rows
    monkeypatch.setattr(ActivationCapture, "_flattened_rows", lambda self, *a: general.append(1) or original(self, *a))
    for m, args, common in _plain_call_cases():
        for reduced in (False, True):
            general.clear()
            fast, fast_anchors = _capture_of(m, args, True, reduced)
            assert len(general) == (0 if common else 1), (m, [a.shape for a in args])
            for handle in fast._handles:  # the hooks off, what it captured kept
                handle.remove()
            slow, slow_anchors = _capture_of(m, args, False, reduced)
            assert general, "the general path was taken"
            a, b = fast._calls[id(m)], slow._calls[id(m)]
            assert len(a.records) == len(b.records) == (0 if reduced else 1)
            for x, y in zip(a.records, b.records):
                for field in ("args", "kwargs", "grad_outs", "rng", "generation", "output", "flattened", "projections",
                              "tape", "autocast", "norm_stats"):
                    assert _same(getattr(x, field), getattr(y, field)), field
                assert (x.scaled is None) == (y.scaled is None)
                assert x.scaled is None or _same(vars(x.scaled), vars(y.scaled))
            assert _same(a.reduced, b.reduced) and a.unbatched == b.unbatched and a.mismatches == b.mismatches
            assert fast_anchors == slow_anchors and fast._params.keys() == slow._params.keys()
            assert fast._inputs.keys() == slow._inputs.keys()
            slow.detach()


class _Positions(nn.Module):
    """A position table read without the examples (followed to where it meets them), then a layer on the batch."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.pos, self.lin, self.keep = nn.Embedding(5, 3), nn.Linear(3, 2), keep

    def forward(self, x):
        if self.keep:  # the rows alive (followed) while lin runs
            rows = self.pos(torch.arange(5))
            return self.lin(x + rows) + 0 * rows.sum()
        h = x + self.pos(torch.arange(5))  # the table's rows are no longer alive when lin runs: nothing followed
        return self.lin(h)


def test_a_common_call_after_a_followed_lookup_takes_the_fast_path_once_nothing_is_followed(monkeypatch):
    """With the broadcast sites idle (no followed tensor alive, their mode left), a common call takes the fast path and
    captures what the general path captures; the lookup itself is still delivered per example. While a followed tensor
    is alive the general path records every call."""
    general = []
    original = ActivationCapture._flattened_rows
    monkeypatch.setattr(ActivationCapture, "_flattened_rows", lambda self, *a: general.append(1) or original(self, *a))
    torch.manual_seed(0)
    m, x = _Positions(keep=True), torch.randn(4, 5, 3)
    capture = ActivationCapture()
    capture.attach([("pos", m.pos), ("lin", m.lin)], root=m)
    capture.begin_step(4)
    m(x).sum().backward()
    capture.end_backward()
    assert len(general) == 1  # lin's call: the general path
    capture.detach()
    m.keep = False
    captured = {}
    for plain in (True, False):
        general.clear()
        capture = ActivationCapture()
        capture.plain_calls = plain
        capture.attach([("pos", m.pos), ("lin", m.lin)], root=m)
        capture.begin_step(4)
        out = m(x)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        capture.end_backward()
        assert len(general) == (0 if plain else 1)
        done = capture.completed()
        captured[plain] = ([(r.args, r.grad_outs) for r in done[id(m.lin)].records],
                           [(r.args, r.grad_outs) for r in done[id(m.pos)].records])
        capture.detach()
    assert _same(captured[True], captured[False]) and len(captured[True][1]) == 1
