"""The ghost engine's taped RNN forward (recurrent_forward.py, recurrent_tape.py): torch's outputs and input /
initial-state gradients exactly, the weights' forms left for the clipping (no recomputation there), and every call
it does not serve on the module's own forward."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample import recurrent_forward, rnn_unrolled
from lightning_dp.grad_sample.recurrent_forward import taped_forward
from lightning_dp.grad_sample.capture.recurrent_tape import RecurrentTape, tape_of

N, T, D, H = 5, 4, 3, 6

GRID = list(itertools.product(["LSTM", "GRU", "RNN", "LSTMP"], [1, 2], [False, True], [True, False], [True, False]))
"""(kind, layers, bidirectional, batch_first, with a given state); ``LSTMP``: an LSTM with ``proj_size``."""


def _rnn(kind: str, layers: int, bidirectional: bool, batch_first: bool, bias: bool = True, **kw) -> nn.RNNBase:
    torch.manual_seed(0)
    if kind == "LSTMP":
        kind, kw = "LSTM", {**kw, "proj_size": 2}
    return getattr(nn, kind)(D, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                             bias=bias, **kw).double()


def _inputs(rnn: nn.RNNBase, with_state: bool):
    g = torch.Generator().manual_seed(1)
    shape = (N, T, D) if rnn.batch_first else (T, N, D)
    x = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True)
    if not with_state:
        return x, None
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    widths = [getattr(rnn, "proj_size", 0) or H, H][:2 if isinstance(rnn, nn.LSTM) else 1]  # h (P), c
    states = [torch.randn(layers, N, w, dtype=torch.float64, generator=g, requires_grad=True) for w in widths]
    return x, (tuple(states) if isinstance(rnn, nn.LSTM) else states[0])


def _grads_of(out, leaves, seed: int = 2):
    """Gradients of leaves for random output gradients on every output tensor (output, h_n, c_n)."""
    g = torch.Generator().manual_seed(seed)
    outs = tree_flatten(out)[0]
    return torch.autograd.grad(outs, leaves, [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs],
                               allow_unused=True, retain_graph=True)  # a packing before the call is shared


@pytest.mark.parametrize("kind,layers,bidirectional,batch_first,with_state", GRID)
def test_outputs_and_input_gradients_are_torchs(kind, layers, bidirectional, batch_first, with_state):
    rnn = _rnn(kind, layers, bidirectional, batch_first)
    x, hx = _inputs(rnn, with_state)
    leaves = [x, *([] if hx is None else tree_flatten(hx)[0])]
    rnn._update_flat_weights()
    taped = taped_forward(rnn, (x, hx), {})
    assert taped is not None and tape_of(taped[0]) is not None
    own = rnn(x, hx)
    for a, b in zip(tree_flatten(taped)[0], tree_flatten(own)[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads_of(taped, leaves), _grads_of(own, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


PACKED = list(itertools.product(["LSTM", "GRU", "RNN", "LSTMP"], [1, 2], [False, True], [False, True], [True, False]))


def _packed(rnn: nn.RNNBase, enforce_sorted: bool, with_state: bool):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, T, D, dtype=torch.float64, generator=g)
    lengths = torch.tensor([4, 4, 3, 2, 1] if enforce_sorted else [2, 4, 1, 4, 3])
    data = x.requires_grad_(True)
    packed = pack_padded_sequence(data, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    _, hx = _inputs(rnn, with_state)
    return data, packed, hx


@pytest.mark.parametrize("kind,layers,bidirectional,enforce_sorted,with_state", PACKED)
def test_a_packed_call_gives_torchs_outputs_and_gradients(kind, layers, bidirectional, enforce_sorted, with_state):
    """The packed data, h_n (and c_n) in the batch's order, and the gradients of the padded input and the initial
    state (given in the batch's order), over sorted and unsorted packing."""
    rnn = _rnn(kind, layers, bidirectional, True)
    x, packed, hx = _packed(rnn, enforce_sorted, with_state)
    leaves = [x, *([] if hx is None else tree_flatten(hx)[0])]
    rnn._update_flat_weights()
    taped = taped_forward(rnn, (packed, hx), {})
    assert taped is not None and isinstance(taped[0], PackedSequence) and tape_of(taped[0].data) is not None
    own = rnn(packed, hx)
    flat_taped, flat_own = tree_flatten(taped)[0], tree_flatten(own)[0]
    for a, b in zip(flat_taped, flat_own):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    outs = lambda f: [t for t in f if t is not None and t.is_floating_point()]  # noqa: E731  (data and states)
    for a, b in zip(_grads_of(outs(flat_taped), leaves), _grads_of(outs(flat_own), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN", "LSTMP"])
@pytest.mark.parametrize("used", [(0,), (1,), (2,), (0, 1)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_tape_holds_the_forms_the_recomputation_gives(kind, used, packed):
    """The backward's forms, × n, are the clipping's recomputed forms from the same output gradients (any subset
    of the outputs reached by a gradient), padded or packed (unsorted); a frozen weight is left out of both."""
    if kind in ("GRU", "RNN") and 2 in used:
        return
    rnn = _rnn(kind, 2, True, True)
    rnn.weight_hh_l1.requires_grad_(False)
    x, hx = _inputs(rnn, True)
    if packed:
        x = pack_padded_sequence(x.detach(), torch.tensor([2, 4, 1, 4, 3]), batch_first=True, enforce_sorted=False)
    rnn._update_flat_weights()
    out = taped_forward(rnn, (x, hx), {})
    outs = [t for t in tree_flatten(out)[0] if t is not None and t.is_floating_point()]
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=g) if k in used else None for k, o in enumerate(outs)]
    torch.autograd.backward([o for o, d in zip(outs, grads) if d is not None], [d for d in grads if d is not None])
    tape = tape_of(outs[0])
    names = {name for name, p in rnn.named_parameters() if p.requires_grad}
    assert tape.names == frozenset(names)

    class Rec:  # what the capture records of the call
        args, kwargs, grad_outs, output, flattened = (x if packed else x.detach(), hx), {}, grads, outs[0].detach(), False

    Rec.tape = None
    recomputed = rnn_unrolled._record_forms(rnn, Rec, names, N)
    Rec.tape = tape
    taped = rnn_unrolled._record_forms(rnn, Rec, names, N)
    assert len(taped) == len(recomputed) > 0
    for a, b in zip(taped, recomputed):
        assert a.weights == b.weights and a.biases == b.biases
        torch.testing.assert_close(a.a, b.a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.d, b.d, rtol=1e-10, atol=1e-12)
    fewer = names - {"weight_ih_l0", "bias_hh_l1_reverse"}
    assert sorted(f.weights.keys() | set(f.biases) for f in tape.forms_of(fewer)) == sorted(
        f.weights.keys() | set(f.biases) for f in rnn_unrolled._record_forms(rnn, Rec, fewer, N)
        if f.weights or f.biases)
    assert tape.forms_of(names | {"weight_hh_l1"}) is None  # not computed: frozen at the call


def test_a_second_backward_spends_the_tape():
    tape = RecurrentTape(frozenset({"w"}))
    assert tape.forms_of({"w"}) is None
    tape.receive([])
    assert tape.forms_of({"w"}) == []
    tape.receive([])
    assert tape.spent and tape.forms_of({"w"}) is None


def _ghost_step(model: nn.Module, x, y, retain: bool = False):
    eng = make_engine("ghost")
    eng.attach(model)
    eng.begin_step(x.shape[0])
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    out = eng.clip_and_sum(params, 1e9)
    eng.detach()
    return params, out


def _per_example_sum(model: nn.Module, x, y, params, times: int = 1):
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        for t, g in zip(total, torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                                   params)):
            t += times * g
    return total


class _OnFeatures(nn.Module):
    """An RNN on the data itself: nothing before it requires grad (``packed``: on a PackedSequence of it, read at
    h_n)."""

    def __init__(self, kind: str, packed: bool = False, **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.packed = packed
        self.rnn, self.head = getattr(nn, kind)(D, H, batch_first=True, **kw), nn.Linear(H, 3)

    def forward(self, x):
        if self.packed:
            lengths = (T - (x[:, 0, 0] > 0).long()).cpu()  # each example's length from its own data
            h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))[1]
            return self.head((h[0] if isinstance(h, tuple) else h)[-1])
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_the_clipping_reads_the_tape_and_recomputes_nothing(kind, packed, monkeypatch):
    model = _OnFeatures(kind, packed, num_layers=2).double()
    x, y = torch.randn(N, T, D, dtype=torch.float64), torch.randint(0, 3, (N,))

    def refuse(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(rnn_unrolled, "_layer_values", refuse)
    params, out = _ghost_step(model, x, y)
    for p, ref in zip(params, _per_example_sum(model, x, y, params)):
        torch.testing.assert_close(out.sums[p], ref, rtol=1e-9, atol=1e-12)
        assert p.grad is None  # the weights' backward is the clipping's


def test_a_second_backward_through_the_call_recomputes_from_both(monkeypatch):
    model = _OnFeatures("LSTM", num_layers=2).double()
    x, y = torch.randn(N, T, D, dtype=torch.float64), torch.randint(0, 3, (N,))
    params, out = _ghost_step(model, x, y, retain=True)
    for p, ref in zip(params, _per_example_sum(model, x, y, params, times=2)):
        torch.testing.assert_close(out.sums[p], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["packed-dropout", "dropout", "no-grad", "functional", "autocast", "kwargs"])
def test_calls_it_does_not_serve_keep_the_modules_forward(case):
    kw = {"num_layers": 2, "dropout": 0.5} if "dropout" in case else {}
    rnn = nn.LSTM(D, H, batch_first=True, **kw)
    x = torch.randn(N, T, D)
    rnn._update_flat_weights()
    if case == "packed-dropout":
        args, kwargs = (pack_padded_sequence(x, torch.tensor([4, 3, 3, 2, 1]), batch_first=True),), {}
    elif case == "kwargs":
        args, kwargs = (x,), {"hx": None, "extra": 1}
    else:
        args, kwargs = (x,), {}
    if case == "no-grad":
        with torch.no_grad():
            assert taped_forward(rnn, args, kwargs) is None
        return
    if case == "functional":
        rnn._flat_weights = [w.detach().clone() for w in rnn._flat_weights]  # what functional_call swaps in
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert taped_forward(rnn, args, kwargs) is None
        return
    assert taped_forward(rnn, args, kwargs) is None


def test_a_state_of_another_shape_or_dtype_is_left_to_the_modules_own_error():
    rnn = nn.GRU(D, H, batch_first=True)
    rnn._update_flat_weights()
    x = torch.randn(N, T, D)
    assert taped_forward(rnn, (x, torch.zeros(1, N + 1, H)), {}) is None
    assert taped_forward(rnn, (x, torch.zeros(1, N, H, dtype=torch.float64)), {}) is None
    assert taped_forward(rnn, (x, torch.zeros(1, N, H)), {}) is not None
    assert recurrent_forward._state_ok(rnn, x, None, None)


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_the_clipped_sums_and_norms_carry_no_graph(kind, engine):
    """An RNN behind a layer that requires grad (an embedding): its per-example norms and clipped sums are detached
    (a GRU's forms held its input x_t itself, with the graph of the call's input: the probe's float() of them warned,
    and the graph was kept alive with its memory)."""
    torch.manual_seed(0)
    emb, rnn, out = nn.Embedding(20, D), getattr(nn, kind)(D, H, batch_first=True), nn.Linear(H, 2)
    model = nn.ModuleDict({"emb": emb, "rnn": rnn, "out": out})
    eng = make_engine(engine)
    eng.attach(model)
    params = list(model.parameters())
    eng.begin_step(N)
    x, y = torch.randint(0, 20, (N, T)), torch.randint(0, 2, (N,))
    torch.nn.functional.cross_entropy(out(rnn(emb(x))[0].mean(1)), y).backward()
    batch = eng.clip_and_sum(params, 1.0)
    assert not batch.norms.requires_grad
    assert not any(batch.sums[p].requires_grad for p in params)
