"""The nn.MultiheadAttention rule (attention.py: projections moved out, one batched forward and one
ordinary backward, dropout replayed) against the batched-over-examples replay it replaces and
against one backward per example, in float64, over the configurations the zoo does not cover."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample.capture.activations import LayerCalls, Record, bind_call, random_state
from lightning_dp.grad_sample.attention import attention_grads, attention_supported
from lightning_dp.grad_sample.functorch_vmap import loop_layer_grads, replayed_layer_grads, vmap_layer_grads

N, T, S, E = 4, 5, 3, 6


def _record(m: nn.MultiheadAttention, args: tuple, kwargs: dict) -> Record:
    """One call as the capture records it: arguments bound and detached, the random state before the
    call when it draws (dropout in training), a random gradient for each output tensor."""
    rng = random_state(m) if m.training and m.dropout > 0 else None
    leaves = tree_flatten(m(*args, **kwargs))[0]
    grads = [torch.randn_like(t) if isinstance(t, Tensor) else None for t in leaves]
    bound, kw = bind_call(m, args, kwargs)
    return Record(tuple(a.detach() if isinstance(a, Tensor) else a for a in bound), kw, grads, rng=rng)


def _inputs(batch_first: bool, length: int, dim: int = E) -> Tensor:
    return torch.randn((N, length, dim) if batch_first else (length, N, dim), dtype=torch.float64)


CASES = {
    "self, batch-first, dropout, causal": (dict(batch_first=True, dropout=0.5), "self",
                                            dict(need_weights=False, is_causal=True, attn_mask="causal")),
    "self, time-major, dropout, weights": (dict(dropout=0.3), "self", dict(need_weights=True)),
    "self, per-head weights, padding": (dict(batch_first=True, dropout=0.2), "self",
                                        dict(need_weights=True, average_attn_weights=False, key_padding_mask="pad")),
    "cross (k is v), no bias": (dict(batch_first=True, bias=False), "kv", dict(need_weights=False)),
    "q, k, v all different": (dict(dropout=0.4), "qkv", dict()),
    "kdim, vdim": (dict(batch_first=True, kdim=4, vdim=5, dropout=0.5), "qkv", dict(need_weights=False)),
    "add_zero_attn, 3-D mask": (dict(add_zero_attn=True, dropout=0.5), "self", dict(attn_mask="3d")),
}


def _case(name: str) -> tuple[nn.MultiheadAttention, LayerCalls]:
    ctor, sources, call = CASES[name]
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, 2, **ctor).double().train()
    bf = m.batch_first
    q = _inputs(bf, T)
    if sources == "self":
        k = v = q
    elif sources == "kv":
        k = v = _inputs(bf, S)
    else:
        k, v = _inputs(bf, S, m.kdim), _inputs(bf, S, m.vdim)
    src = k.shape[1] if bf else k.shape[0]
    kwargs = dict(call)
    if kwargs.get("attn_mask") == "causal":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    elif kwargs.get("attn_mask") == "3d":
        kwargs["attn_mask"] = torch.randn(N * 2, T, src, dtype=torch.float64)
    if kwargs.get("key_padding_mask") == "pad":
        pad = torch.zeros(N, src, dtype=torch.bool)
        pad[1, -2:] = True
        kwargs["key_padding_mask"] = pad
    records = [_record(m, (q, k, v), kwargs) for _ in range(2)]  # two calls: summed, each with its own masks
    return m, LayerCalls("attn", m, records)


@pytest.mark.parametrize("name", list(CASES))
def test_attention_rule_equals_the_batched_replay(name):
    m, calls = _case(name)
    assert all(attention_supported(m, r) for r in calls.records)
    wanted = list(m.named_parameters())
    fast, slow = attention_grads(calls, wanted, N), replayed_layer_grads(calls, wanted, N)
    assert fast.keys() == slow.keys() == {k for k, _ in wanted}
    for k in fast:
        assert fast[k].shape == (N, *dict(wanted)[k].shape)
        torch.testing.assert_close(fast[k], slow[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_rule_equals_one_backward_per_example(batch_first):
    """Without dropout, against an independent reference: one small backward per example."""
    torch.manual_seed(1)
    m = nn.MultiheadAttention(E, 3, batch_first=batch_first).double()
    x = _inputs(batch_first, T)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    calls = LayerCalls("attn", m, [_record(m, (x, x, x), dict(attn_mask=mask, need_weights=True))])
    wanted = [(k, p) for k, p in m.named_parameters() if k != "out_proj.bias"]  # a frozen parameter is left out
    fast, slow = vmap_layer_grads(calls, wanted, N), loop_layer_grads(calls, wanted, N)
    assert fast.keys() == slow.keys() == {k for k, _ in wanted}
    for k in fast:
        torch.testing.assert_close(fast[k], slow[k], rtol=1e-10, atol=1e-12)


def test_replay_keeps_the_global_random_state():
    m, calls = _case("self, batch-first, dropout, causal")
    before = torch.get_rng_state()
    attention_grads(calls, list(m.named_parameters()), N)
    assert torch.equal(before, torch.get_rng_state())


def test_shared_key_value_rows_keep_the_batched_replay():
    m = nn.MultiheadAttention(E, 2, add_bias_kv=True)
    x = torch.randn(T, N, E)
    assert not attention_supported(m, Record((x, x, x), {}))
    assert attention_supported(nn.MultiheadAttention(E, 2), Record((x, x, x), {}))
