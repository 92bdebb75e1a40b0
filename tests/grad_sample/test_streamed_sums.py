"""StreamedSums: the ghost engine's clipped sums one layer at a time (the sharded privatizer's input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.streamed_sums import StreamedSums
from lightning_dp.models.tiny_transformer import TinyTransformerLM


def _tied() -> nn.Module:
    model = TinyTransformerLM(vocab_size=11, max_len=5, d_model=8, n_layers=1, n_heads=2).double()
    model.head = nn.Linear(8, 11, bias=False).double()
    model.head.weight = model.tok.weight
    return model


def _sums(model: nn.Module, stream: bool, C: float = 0.1):
    torch.manual_seed(0)
    engine = make_engine("ghost")
    engine.stream_sums = stream
    engine.attach(model)
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    engine.begin_step(4)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1)).backward()
    batch = engine.clip_and_sum(params, C)
    engine.detach()
    return params, batch


def test_popping_one_parameter_at_a_time_gives_the_eager_sums_and_releases_layers():
    for make in (lambda: TinyTransformerLM(vocab_size=11, max_len=5, d_model=8, n_layers=2, n_heads=2).double(),
                 _tied):
        torch.manual_seed(1)
        model = make()
        params, eager = _sums(model, stream=False)
        _, streamed = _sums(model, stream=True)
        assert isinstance(streamed.sums, StreamedSums) and not isinstance(eager.sums, StreamedSums)
        torch.testing.assert_close(streamed.norms, eager.norms, rtol=0, atol=0)
        layers = len(streamed.sums._layers)
        for k, p in enumerate(params):
            torch.testing.assert_close(streamed.sums.pop(p), eager.sums[p], rtol=1e-12, atol=1e-15)
            assert len(streamed.sums) == len(params) - k - 1
        assert layers > 1 and not streamed.sums._layers, "every layer's captured tensors are released"
        assert not streamed.sums._ready, "nothing is held after the last pop"


def test_reading_everything_is_the_eager_mapping():
    model = _tied()
    params, eager = _sums(model, stream=False)
    _, streamed = _sums(model, stream=True)
    assert list(streamed.sums) == params
    for p, v in streamed.sums.items():
        torch.testing.assert_close(v, eager.sums[p], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(streamed.sums[params[0]], eager.sums[params[0]])  # read twice: still there


def test_an_unused_parameter_streams_a_zero_sum():
    """A spare head the loss never reads: zero clipped sum, streamed like the others (the sharded path)."""
    model = TinyTransformerLM(vocab_size=11, max_len=5, d_model=8, n_layers=1, n_heads=2).double()
    model.spare = nn.Linear(8, 3).double()
    params, eager = _sums(model, stream=False)
    _, streamed = _sums(model, stream=True)
    spare = [p for p in params if any(p is q for q in model.spare.parameters())]
    assert len(spare) == 2
    for p in params:
        torch.testing.assert_close(streamed.sums.pop(p), eager.sums[p], rtol=1e-12, atol=1e-15)
    assert all(not eager.sums[p].any() for p in spare)
