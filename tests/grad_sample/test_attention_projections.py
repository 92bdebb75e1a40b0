"""Self-attention's projections from autograd's record (attention_projections.py, attention_nodes.py): the per-example
gradients of an nn.MultiheadAttention call read from the nodes its own forward made, against the replay rule
(attention.py, the same dropout masks) and against one backward per example; and the calls that must keep the replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.grad_sample.capture.activations import ActivationCapture
from lightning_dp.grad_sample.attention import attention_grads
from lightning_dp.grad_sample.attention_projections import projection_forms
from lightning_dp.grad_sample.linear_forms import form_grads

N, T, E = 4, 5, 6


def _calls(m: nn.MultiheadAttention, x: torch.Tensor, kv=None, calls: int = 1, **kwargs):
    """The layer's captured calls (``calls`` of them in one step) after a backward of a random per-example loss."""
    capture = ActivationCapture()
    capture.attach([("attn", m)])
    capture.begin_step(N)
    torch.manual_seed(1)
    loss = 0
    for _ in range(calls):
        out, weights = m(x, x if kv is None else kv, x if kv is None else kv, **kwargs)
        loss = loss + (torch.tanh(out) * torch.randn_like(out)).sum()
        if weights is not None:
            loss = loss + (weights * torch.randn_like(weights)).sum()
    (loss / N).backward()
    recorded = capture.completed()[id(m)]
    capture.detach()
    return recorded


@pytest.mark.parametrize("ctor,call", [
    (dict(batch_first=True), dict(need_weights=False)),
    (dict(batch_first=False, bias=False), dict(need_weights=True)),
    (dict(batch_first=True, dropout=0.4), dict(need_weights=True, average_attn_weights=False)),
    (dict(batch_first=True), dict(need_weights=False, attn_mask="causal", is_causal=True)),
    (dict(batch_first=False, dropout=0.3), dict(key_padding_mask="pad")),
])
@pytest.mark.parametrize("calls", [1, 2])
def test_self_attention_projections_equal_the_replay(ctor, call, calls):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, 2, **ctor).double().train()
    x = torch.randn((N, T, E) if m.batch_first else (T, N, E), dtype=torch.float64, requires_grad=True)
    call = dict(call)
    if call.get("attn_mask") == "causal":
        call["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    if call.get("key_padding_mask") == "pad":
        call["key_padding_mask"] = torch.zeros(N, T, dtype=torch.bool).index_fill_(1, torch.tensor([T - 1]), True)
    recorded = _calls(m, x, calls=calls, **call)
    wanted = list(m.named_parameters())
    forms = projection_forms(recorded, wanted, N)
    assert forms is not None and all(rec.projections is not None for rec in recorded.records)
    got = form_grads(forms, wanted, N)
    want = attention_grads(recorded, wanted, N)  # the same masks, replayed from the calls' random state
    assert got.keys() == want.keys() == {name for name, _ in wanted}
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")


def test_self_attention_projections_equal_one_backward_per_example():
    torch.manual_seed(2)
    m = nn.MultiheadAttention(E, 3, batch_first=True).double()
    x = torch.randn(N, T, E, dtype=torch.float64)
    target = torch.randn(N, T, E, dtype=torch.float64)
    capture = ActivationCapture()
    capture.attach([("attn", m)])
    capture.begin_step(N)
    (m(x, x, x, need_weights=False)[0] * target).sum(dim=(1, 2)).mean().backward()
    recorded = capture.completed()[id(m)]
    capture.detach()
    wanted = list(m.named_parameters())
    got = form_grads(projection_forms(recorded, wanted, N), wanted, N)
    for i in range(N):
        loss = (m(x[i:i + 1], x[i:i + 1], x[i:i + 1], need_weights=False)[0] * target[i:i + 1]).sum()
        for (name, p), g in zip(wanted, torch.autograd.grad(loss, [p for _, p in wanted])):
            torch.testing.assert_close(got[name][i], g, rtol=1e-10, atol=1e-12)


def test_calls_other_than_packed_self_attention_keep_the_replay():
    """Cross-attention (two in-projection nodes), add_bias_kv, kdim/vdim: no projections recorded."""
    torch.manual_seed(3)
    x = torch.randn(N, T, E, dtype=torch.float64)
    cross = nn.MultiheadAttention(E, 2, batch_first=True).double()
    assert _calls(cross, x, kv=torch.randn(N, T + 1, E, dtype=torch.float64)).records[0].projections is None
    bias_kv = nn.MultiheadAttention(E, 2, batch_first=True, add_bias_kv=True).double()
    assert _calls(bias_kv, x).records[0].projections is None
    separate = nn.MultiheadAttention(E, 2, batch_first=True, kdim=E, vdim=4).double()
    assert not separate._qkv_same_embed_dim
    kv = torch.randn(N, T, 4, dtype=torch.float64)
    capture = ActivationCapture()
    capture.attach([("attn", separate)])
    capture.begin_step(N)
    separate(x, torch.randn(N, T, E, dtype=torch.float64), kv)[0].sum().backward()
    assert capture.completed()[id(separate)].records[0].projections is None
    capture.detach()


def test_an_output_gradient_laid_out_otherwise_keeps_the_replay():
    """The out-projection's output gradient must equal the module output's gradient laid out [T, B, E]: a record
    whose kept gradient disagrees (as a wrong row layout would) is not served by the forms."""
    torch.manual_seed(4)
    m = nn.MultiheadAttention(E, 2, batch_first=True).double()
    x = torch.randn(N, T, E, dtype=torch.float64)
    recorded = _calls(m, x, need_weights=False)
    wanted = list(m.named_parameters())
    assert projection_forms(recorded, wanted, N) is not None
    rec = recorded.records[0]
    rec.projections.grads[1] = rec.projections.grads[1].view(T, N, E).transpose(0, 1).reshape(T * N, E)  # b·T + t
    assert projection_forms(recorded, wanted, N) is None
