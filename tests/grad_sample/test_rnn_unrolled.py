"""The unrolled RNN rule (rnn_unrolled.py) against one backward per example, over the configurations
the zoo does not cover: bidirectional, a given initial state, no bias, relu, time-major; and on a
PackedSequence, against each example run alone with its own length."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_dp import PrivacyConfigurationError
from lightning_dp.grad_sample.capture.activations import ActivationCapture, LayerCalls, Record
from lightning_dp.grad_sample.functorch_vmap import loop_layer_grads, vmap_layer_grads
from lightning_dp.grad_sample.rnn_unrolled import unrolled_rnn_grads, unrolled_supported

N, T, D, H = 5, 4, 3, 6


def _case(kind: str, batch_first: bool, with_state: bool, outputs: tuple[int, ...] = (0, 1, 2), **kwargs):
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(D, H, batch_first=batch_first, **kwargs).double()
    x = torch.randn(N, T, D, dtype=torch.float64) if batch_first else torch.randn(T, N, D, dtype=torch.float64)
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    args: tuple = (x,)
    if with_state:
        h0 = torch.randn(layers, N, getattr(rnn, "proj_size", 0) or H, dtype=torch.float64)
        args = (x, (h0, torch.randn(layers, N, H, dtype=torch.float64)) if kind == "LSTM" else h0)
    leaves = tree_flatten(rnn(*args))[0]
    grad_outs = [torch.randn_like(leaf) if k in outputs else None for k, leaf in enumerate(leaves)]  # None: unused
    calls = LayerCalls("rnn", rnn, [Record(args, {}, grad_outs)])
    return rnn, calls, leaves[0].detach()


@pytest.mark.parametrize("kind,batch_first,with_state,kwargs", [
    ("LSTM", True, True, dict(num_layers=2, bidirectional=True)),
    ("GRU", False, True, dict(num_layers=2, bias=False)),
    ("RNN", True, False, dict(nonlinearity="relu", bidirectional=True)),
    ("LSTM", False, False, dict(num_layers=3)),
    ("GRU", True, False, dict(num_layers=2, bidirectional=True)),
    ("RNN", False, True, dict(num_layers=2)),
    ("LSTM", True, False, dict(num_layers=2, outputs=(1,))),  # only h_n used
    ("LSTM", False, True, dict(bidirectional=True, outputs=(2,))),  # only c_n used
    ("GRU", True, True, dict(num_layers=2, outputs=(0,))),  # only the output sequence
    ("RNN", True, True, dict(bidirectional=True, bias=False, outputs=(1,))),
    ("LSTM", True, True, dict(num_layers=2, bidirectional=True, proj_size=2)),  # h_t = W_hr m_t
    ("LSTM", False, False, dict(proj_size=4, outputs=(1, 2))),
])
def test_unrolled_equals_one_backward_per_example(kind, batch_first, with_state, kwargs):
    rnn, calls, output = _case(kind, batch_first, with_state, **kwargs)
    assert unrolled_supported(rnn, calls.records[0])
    wanted = list(rnn.named_parameters())
    slow = loop_layer_grads(calls, wanted, N)
    recomputed = unrolled_rnn_grads(calls, wanted, N)  # every layer recomputed
    calls.records[0].output = output  # as the capture records it: the last layer's values are the call's own
    for fast in (recomputed, unrolled_rnn_grads(calls, wanted, N)):
        assert fast.keys() == slow.keys() == {name for name, _ in wanted}
        for name in fast:
            assert fast[name].shape == (N, *dict(wanted)[name].shape)
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


def test_training_dropout_keeps_the_loop_and_projections_are_served():
    lstm = nn.LSTM(D, H, proj_size=2)
    gru = nn.GRU(D, H, num_layers=2, dropout=0.5).train()
    record = Record((torch.randn(T, N, D),), {}, [None])
    assert unrolled_supported(lstm, record) and not unrolled_supported(gru, record)
    assert unrolled_supported(gru.eval(), record)


# ------------------------------------------------------------------ PackedSequence
SPREAD = [3, 7, 1, 5, 2]  # unsorted, far apart: a mask off by one step, or a reversal over all T, shows
TP = max(SPREAD)


def _packed_loss(rnn, x, lengths, hx, rows, loss_on, weights, batch_first, sort):
    """Per-example losses ``[len(rows)]`` of the examples ``rows`` (x, lengths, hx: theirs), on the padded output
    (pad_packed_sequence), on h_n, or on c_n."""
    p = pack_padded_sequence(x if batch_first else x.transpose(0, 1), lengths, batch_first=batch_first,
                             enforce_sorted=sort)
    out, hidden = rnn(p) if hx is None else rnn(p, hx)
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    w_out, w_h, w_c = weights
    loss = x.new_zeros(len(rows))
    if "out" in loss_on:
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=TP)
        loss = loss + (torch.tanh(padded) * w_out[rows]).sum((1, 2))
    if "h" in loss_on:
        loss = loss + (torch.tanh(states[0]) * w_h[:, rows]).sum((0, 2))
    if "c" in loss_on:
        loss = loss + (torch.tanh(states[1]) * w_c[:, rows]).sum((0, 2))
    return loss


def _packed_vs_alone(kind, lengths, loss_on=("out", "h"), with_state=False, batch_first=True, sort=False,
                     served=unrolled_rnn_grads, **kwargs):
    """Per-example grads of the mean loss on a PackedSequence (capture + ``served``) against each example packed
    alone with its own length and initial state: g_i = ∇ loss_i."""
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(D, H, batch_first=batch_first, **kwargs).double()
    layers, width = rnn.num_layers * (2 if rnn.bidirectional else 1), rnn.proj_size or H
    x = torch.randn(N, TP, D, dtype=torch.float64)
    lengths = torch.tensor(lengths)
    hx = None
    if with_state:
        h0 = torch.randn(layers, N, width, dtype=torch.float64)
        hx = (h0, torch.randn(layers, N, H, dtype=torch.float64)) if kind == "LSTM" else h0
    weights = (torch.randn(N, TP, width * (2 if rnn.bidirectional else 1), dtype=torch.float64),
               torch.randn(layers, N, width, dtype=torch.float64), torch.randn(layers, N, H, dtype=torch.float64))
    capture = ActivationCapture()
    capture.attach([("rnn", rnn)])
    capture.begin_step(N)
    _packed_loss(rnn, x, lengths, hx, list(range(N)), loss_on, weights, batch_first, sort).mean().backward()
    calls = capture.completed()[id(rnn)]
    capture.detach()
    wanted = list(rnn.named_parameters())
    assert served is not unrolled_rnn_grads or unrolled_supported(rnn, calls.records[0])
    got = served(calls, wanted, N)
    assert got.keys() == {name for name, _ in wanted}
    if served is unrolled_rnn_grads:  # the last layer recomputed too, as for a record without its output
        calls.records[0].output = None
        for name, g in served(calls, wanted, N).items():
            torch.testing.assert_close(g, got[name], rtol=1e-10, atol=1e-12)
    for i in range(N):
        hx_i = None if hx is None else tuple(t[:, i:i + 1] for t in hx) if isinstance(hx, tuple) else hx[:, i:i + 1]
        loss = _packed_loss(rnn, x[i:i + 1], lengths[i:i + 1], hx_i, [i], loss_on, weights, batch_first, sort).sum()
        alone = torch.autograd.grad(loss, [p for _, p in wanted], allow_unused=True)
        for (name, p), want in zip(wanted, alone):
            torch.testing.assert_close(got[name][i], torch.zeros_like(p) if want is None else want,
                                       rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}, example {i}: {m}")


@pytest.mark.parametrize("kind,lengths,loss_on,with_state,batch_first,sort,kwargs", [
    ("LSTM", SPREAD, ("out", "h"), False, True, False, {}),
    ("LSTM", SPREAD, ("out", "h", "c"), True, True, False, dict(num_layers=2, bidirectional=True)),
    ("LSTM", [7, 5, 3, 2, 1], ("h",), False, False, True, dict(bidirectional=True)),  # enforce_sorted=True
    ("LSTM", SPREAD, ("c",), True, True, False, dict(num_layers=2, bias=False)),
    ("GRU", SPREAD, ("out", "h"), True, False, False, dict(num_layers=2, bidirectional=True)),
    ("GRU", [2, 7, 1, 6, 4], ("out",), False, True, False, dict(bidirectional=True)),
    ("RNN", SPREAD, ("out", "h"), False, True, False, dict(nonlinearity="relu", num_layers=2, bidirectional=True)),
    ("RNN", [1, 1, 7, 1, 2], ("h",), True, True, False, dict(num_layers=3, bias=False)),
], ids=["lstm", "lstm-2l-bi-state-c", "lstm-sorted-bi-hn", "lstm-cn-nobias", "gru-2l-bi-tm", "gru-bi-out",
        "rnn-relu-2l-bi", "rnn-3l-hn"])
def test_packed_sequence_equals_each_example_alone(kind, lengths, loss_on, with_state, batch_first, sort, kwargs):
    _packed_vs_alone(kind, lengths, loss_on, with_state, batch_first, sort, **kwargs)


@pytest.mark.parametrize("served", [unrolled_rnn_grads, vmap_layer_grads], ids=["unrolled", "vmap-engine"])
def test_packed_projections_are_exact(served):
    _packed_vs_alone("LSTM", SPREAD, ("out", "h", "c"), True, served=served, proj_size=2, num_layers=2,
                     bidirectional=True)


def test_packed_training_dropout_and_other_layers_are_refused_by_name():
    x = pack_padded_sequence(torch.randn(N, TP, D), torch.tensor(SPREAD), batch_first=True, enforce_sorted=False)
    for layer, match in [(nn.GRU(D, H, num_layers=2, dropout=0.5, batch_first=True), r"dropout=0.5.*F.dropout"),
                         (_PackedLinear(), r"only nn.LSTM, nn.GRU and nn.RNN.*pad_packed_sequence")]:
        capture = ActivationCapture()
        capture.attach([("layer", layer)])
        capture.begin_step(N)
        with pytest.raises(PrivacyConfigurationError, match=match):
            layer(x)
        capture.detach()


def test_packed_sequences_are_counted_as_the_steps_examples():
    """The examples of a packed call are its sequences: another count is a mismatch, refused by name later."""
    gru = nn.GRU(D, H, batch_first=True)
    capture = ActivationCapture()
    capture.attach([("gru", gru)])
    capture.begin_step(N + 1)
    out, h = gru(pack_padded_sequence(torch.randn(N, TP, D), torch.tensor(SPREAD), batch_first=True,
                                      enforce_sorted=False))
    assert capture.mismatched() == {"gru": [(1, N, H)]} and not capture.any_recorded()


class _PackedLinear(nn.Linear):
    """A custom layer taking a PackedSequence: its rows are time steps of all examples."""

    def __init__(self) -> None:
        super().__init__(D, H)

    def forward(self, p):  # type: ignore[override]
        return super().forward(p.data)
