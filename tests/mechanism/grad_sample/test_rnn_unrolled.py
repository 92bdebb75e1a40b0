"""The unrolled RNN rule (rnn_unrolled.py) against one backward per example, over the configurations
the zoo does not cover: bidirectional, a given initial state, no bias, relu, time-major."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_dp.mechanism.capture import LayerCalls, Record
from lightning_dp.mechanism.grad_sample.functorch_vmap import loop_layer_grads
from lightning_dp.mechanism.grad_sample.rnn_unrolled import unrolled_rnn_grads, unrolled_supported

N, T, D, H = 5, 4, 3, 6


def _case(kind: str, batch_first: bool, with_state: bool, outputs: tuple[int, ...] = (0, 1, 2), **kwargs):
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(D, H, batch_first=batch_first, **kwargs).double()
    x = torch.randn(N, T, D, dtype=torch.float64) if batch_first else torch.randn(T, N, D, dtype=torch.float64)
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    args: tuple = (x,)
    if with_state:
        h0 = torch.randn(layers, N, H, dtype=torch.float64)
        args = (x, (h0, torch.randn(layers, N, H, dtype=torch.float64)) if kind == "LSTM" else h0)
    leaves = tree_flatten(rnn(*args))[0]
    grad_outs = [torch.randn_like(leaf) if k in outputs else None for k, leaf in enumerate(leaves)]  # None: unused
    calls = LayerCalls("rnn", rnn, [Record(args, {}, grad_outs)])
    return rnn, calls


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
])
def test_unrolled_equals_one_backward_per_example(kind, batch_first, with_state, kwargs):
    rnn, calls = _case(kind, batch_first, with_state, **kwargs)
    assert unrolled_supported(rnn, calls.records[0])
    wanted = list(rnn.named_parameters())
    fast, slow = unrolled_rnn_grads(calls, wanted, N), loop_layer_grads(calls, wanted, N)
    assert fast.keys() == slow.keys() == {name for name, _ in wanted}
    for name in fast:
        assert fast[name].shape == (N, *dict(wanted)[name].shape)
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


def test_projections_and_training_dropout_keep_the_loop():
    lstm = nn.LSTM(D, H, proj_size=2)
    gru = nn.GRU(D, H, num_layers=2, dropout=0.5).train()
    record = Record((torch.randn(T, N, D),), {}, [None])
    assert not unrolled_supported(lstm, record) and not unrolled_supported(gru, record)
    assert unrolled_supported(gru.eval(), record)
