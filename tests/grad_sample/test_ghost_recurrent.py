"""The ghost engine's RNN rule (recurrent_rule.py, linear_forms.py): squared per-example norms and clipped sums from the linear forms,
by ghost norm and by materialised G alike, against one backward per example; over layouts, directions, a frozen
subset of the weights, several calls of one layer, flattened rows and a PackedSequence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample.capture.activations import ActivationCapture, LayerCalls, Record
from lightning_dp.grad_sample import linear_forms
from lightning_dp.grad_sample.functorch_vmap import loop_layer_grads, packed_loop_grads
from lightning_dp.grad_sample.recurrent_rule import recurrent_served, recurrent_stats
from lightning_dp.grad_sample.linear_forms import FormStats
from lightning_dp.grad_sample.layer_stats import MaterialisedStats

N, T, D, H = 5, 4, 3, 6


def _record(rnn: nn.RNNBase, x, with_state: bool, outputs=(0, 1, 2), generator=None) -> Record:
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    rows = x.shape[0 if rnn.batch_first else 1]
    args: tuple = (x,)
    if with_state:
        h0 = torch.randn(layers, rows, H, dtype=torch.float64, generator=generator)
        args = (x, (h0, torch.randn(layers, rows, H, dtype=torch.float64, generator=generator))
                if isinstance(rnn, nn.LSTM) else h0)
    leaves = tree_flatten(rnn(*args))[0]
    grad_outs = [torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator) if k in outputs else None
                 for k, leaf in enumerate(leaves)]
    rec = Record(args, {}, grad_outs)
    rec.output = leaves[0].detach()  # as the capture records it: the last layer's values are the call's own
    return rec


def _expected(calls: LayerCalls, wanted, n: int, c: torch.Tensor, loop=loop_layer_grads):
    """(squared norms, Σ_i c_i g_i) from one backward per example."""
    g = loop(calls, wanted, n)
    sq = sum(g[name].reshape(n, -1).pow(2).sum(1) for name, _ in wanted)
    return sq, {name: torch.tensordot(c, g[name], dims=1) for name, _ in wanted}


def _check(calls, wanted, n, monkeypatch, loop=loop_layer_grads):
    c = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    sq, sums = _expected(calls, wanted, n, c, loop)
    assert recurrent_served(calls)
    for force in (True, False):  # the ghost norm, and the materialised G_i
        monkeypatch.setattr(linear_forms, "prefer_ghost", lambda *a, f=force: f)
        stats = recurrent_stats(calls, dict(wanted), n, None, False)
        assert isinstance(stats, FormStats)
        torch.testing.assert_close(stats.sq_norms, sq, rtol=1e-10, atol=1e-12)
        got = stats.sums(c)
        assert set(got) == {p for _, p in wanted}
        for name, p in wanted:
            assert got[p].shape == p.shape and got[p].is_contiguous()
            torch.testing.assert_close(got[p], sums[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind,batch_first,with_state,kwargs", [
    ("LSTM", True, True, dict(num_layers=2, bidirectional=True)),
    ("LSTM", False, False, dict(num_layers=3, bias=False)),
    ("GRU", False, True, dict(num_layers=2, bidirectional=True)),
    ("GRU", True, False, dict(bias=False)),
    ("RNN", True, False, dict(nonlinearity="relu", bidirectional=True, num_layers=2)),
    ("LSTM", True, False, dict(num_layers=2, outputs=(1,))),  # only h_n used
])
def test_norms_and_sums_equal_one_backward_per_example(kind, batch_first, with_state, kwargs, monkeypatch):
    torch.manual_seed(0)
    outputs = kwargs.pop("outputs", (0, 1, 2))
    rnn = getattr(nn, kind)(D, H, batch_first=batch_first, **kwargs).double()
    x = torch.randn((N, T, D) if batch_first else (T, N, D), dtype=torch.float64)
    calls = LayerCalls("rnn", rnn, [_record(rnn, x, with_state, outputs)])
    _check(calls, list(rnn.named_parameters()), N, monkeypatch)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_frozen_subset_and_two_calls(kind, monkeypatch):
    """Only some of the weights trained (a's columns narrowed to theirs), and the layer called twice with different
    lengths (each form's calls joined in time): the per-example gradient is the sum over both calls."""
    torch.manual_seed(1)
    rnn = getattr(nn, kind)(D, H, num_layers=2, batch_first=True).double()
    calls = LayerCalls("rnn", rnn, [_record(rnn, torch.randn(N, T, D, dtype=torch.float64), True),
                                    _record(rnn, torch.randn(N, T + 3, D, dtype=torch.float64), False)])
    named = dict(rnn.named_parameters())
    for subset in (["weight_hh_l0", "bias_ih_l1"], ["weight_ih_l1"], ["bias_hh_l0", "weight_ih_l0"]):
        _check(calls, [(k, named[k]) for k in subset], N, monkeypatch)


def test_flattened_rows_sum_each_examples_rows(monkeypatch):
    """A call on n·m rows (sentence-level LSTM): each example's gradient is the sum over its m rows."""
    torch.manual_seed(2)
    rnn = nn.LSTM(D, H, batch_first=True).double()
    m = 3
    rec = _record(rnn, torch.randn(N * m, T, D, dtype=torch.float64), False)
    rec.flattened = True
    calls = LayerCalls("rnn", rnn, [rec])
    wanted = list(rnn.named_parameters())
    rows = loop_layer_grads(LayerCalls("rnn", rnn, [_record_copy(rec)]), wanted, N * m)
    c = torch.rand(N, dtype=torch.float64)
    per_example = {k: g.view(N, m, *g.shape[1:]).sum(1) * (N / (N * m)) for k, g in rows.items()}  # n, not n·m
    sq = sum(g.reshape(N, -1).pow(2).sum(1) for g in per_example.values())
    for force in (True, False):
        monkeypatch.setattr(linear_forms, "prefer_ghost", lambda *a, f=force: f)
        stats = recurrent_stats(calls, dict(wanted), N, None, False)
        torch.testing.assert_close(stats.sq_norms, sq, rtol=1e-10, atol=1e-12)
        for name, p in wanted:
            torch.testing.assert_close(stats.sums(c)[p], torch.tensordot(c, per_example[name], dims=1),
                                       rtol=1e-10, atol=1e-12)


def _record_copy(rec: Record) -> Record:
    copy = Record(rec.args, rec.kwargs, rec.grad_outs)
    copy.output = rec.output
    return copy


def test_packed_sequence(monkeypatch):
    """A PackedSequence (unsorted lengths, bidirectional, two layers), recorded by the capture as in a step."""
    torch.manual_seed(3)
    rnn = nn.GRU(D, H, num_layers=2, bidirectional=True, batch_first=True).double()
    packed = pack_padded_sequence(torch.randn(N, 7, D, dtype=torch.float64), torch.tensor([3, 7, 1, 5, 2]),
                                  batch_first=True, enforce_sorted=False)
    capture = ActivationCapture()
    capture.attach([("rnn", rnn)])
    capture.begin_step(N)
    out, h_n = rnn(packed)
    w = torch.randn(out.data.shape, dtype=torch.float64)
    ((torch.tanh(out.data) * w).sum() + h_n.pow(2).sum()).div(N).backward()
    calls = capture.completed()[id(rnn)]
    capture.detach()
    _check(calls, list(rnn.named_parameters()), N, monkeypatch, loop=packed_loop_grads)


def test_scaled_norms_and_squares_materialise():
    torch.manual_seed(4)
    rnn = nn.LSTM(D, H, batch_first=True).double()
    calls = LayerCalls("rnn", rnn, [_record(rnn, torch.randn(N, T, D, dtype=torch.float64), False)])
    wanted = dict(rnn.named_parameters())
    g = loop_layer_grads(calls, list(wanted.items()), N)
    scale = {p: torch.rand_like(p) for p in wanted.values()}
    for stats in (recurrent_stats(calls, wanted, N, scale, False), recurrent_stats(calls, wanted, N, None, True)):
        assert isinstance(stats, MaterialisedStats)
    stats = recurrent_stats(calls, wanted, N, scale, True)
    want = sum((g[k] * scale[p]).reshape(N, -1).pow(2).sum(1) for k, p in wanted.items())
    torch.testing.assert_close(stats.sq_norms, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("proj_size", [0, 3])
def test_ghost_engine_steps_with_detached_weights_stay_exact(proj_size):
    """Under ghost the RNN runs on its weights detached (no weight gradients in its backward); an LSTM with
    projections is served by one backward per example (functional_call on replacement tensors), which must still
    differentiate them: torch's RNN keeps references to tell a functional_call apart, and the detached forward must
    leave them consistent, step after step (a stale reference once ran the loop on detached weights)."""
    from lightning_dp.grad_sample import make_engine

    torch.manual_seed(5)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, D)
            self.rnn = nn.LSTM(D, H, batch_first=True, proj_size=proj_size)
            self.head = nn.Linear(proj_size or H, 7)

        def forward(self, x):
            return self.head(self.rnn(self.emb(x))[0])

    model = Model().double()
    params = list(model.parameters())
    # the Parameter itself: during a step, model.rnn.weight_hh_l0 read from outside the layer's forward is a followed
    # view (root_parameters.py), whose .grad is always None (and torch warns that it is a non-leaf's)
    weight_hh = dict(model.named_parameters())["rnn.weight_hh_l0"]
    engine = make_engine("ghost")
    engine.attach(model)
    x = torch.randint(0, 7, (N, T))
    for n in (N, 2, N):
        engine.begin_step(n)
        model(x[:n]).pow(2).mean(dim=(1, 2)).mean().backward()
        assert weight_hh.grad is None  # the module's own backward skipped its weight gradients
        got = engine.clip_and_sum(params, float("inf"))
        engine.detach()
        want = [torch.zeros_like(p) for p in params]
        for i in range(n):
            loss = model(x[i:i + 1]).pow(2).mean()
            for w, g in zip(want, torch.autograd.grad(loss, params)):
                w += g
        engine.attach(model)
        for p, w in zip(params, want):
            torch.testing.assert_close(got.sums[p], w, rtol=1e-10, atol=1e-12)
