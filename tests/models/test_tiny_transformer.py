"""TinyTransformerLM: causal, batch-first, and exact under the ghost per-example engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.auto import select_engine, unsupported_by_engine
from lightning_dp.models.tiny_transformer import TinyTransformerLM, evaluate_loss, parameter_count


def small(**kw) -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(**{"vocab_size": 11, "max_len": 6, "d_model": 8, "n_heads": 2, **kw})


def test_shapes_and_default_size() -> None:
    model = small()
    ids = torch.randint(0, 11, (3, 6))
    assert model(ids).shape == (3, 6, 11)
    d, v, t, layers = 128, 256, 64, 2
    block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * (2 * d)  # qkv, out, fc1, fc2, LNs
    expected = v * d + t * d + layers * block + 2 * d + d * v + v
    assert parameter_count(TinyTransformerLM()) == expected  # ~0.47 M
    assert not any(isinstance(m, nn.MultiheadAttention) for m in TinyTransformerLM().modules())


def test_logits_are_causal() -> None:
    model = small().eval()
    ids = torch.randint(0, 11, (2, 6))
    changed = ids.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 11
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-4)


def test_every_engine_supports_it_and_auto_picks_ghost() -> None:
    model = small()
    assert all(problems == [] for problems in unsupported_by_engine(model).values())
    assert select_engine(model) == "ghost"


def test_ghost_clipped_sums_match_per_example_autograd() -> None:
    model = small()
    ids, targets = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    params = [p for p in model.parameters()]
    per_example = []
    for i in range(4):
        loss = model.loss((ids[i : i + 1], targets[i : i + 1]))
        per_example.append(torch.autograd.grad(loss, params))
    norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per_example])
    C = float(norms.median())  # some examples clipped, some not
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    expected = [sum(f * gs[k] for f, gs in zip(factors, per_example)) for k in range(len(params))]
    engine = make_engine("ghost")
    engine.attach(model)
    try:
        model.loss((ids, targets)).backward()
        batch = engine.clip_and_sum(params, C)
    finally:
        engine.detach()
    assert torch.allclose(batch.norms, norms, rtol=1e-4)
    for p, e in zip(params, expected):
        assert torch.allclose(batch.sums[p], e, atol=1e-5, rtol=1e-4)


def test_sgd_and_adam_and_evaluate_loss() -> None:
    assert isinstance(small(optimizer="sgd", lr=0.1).configure_optimizers(), torch.optim.SGD)
    assert isinstance(small().configure_optimizers(), torch.optim.Adam)
    model = small()
    ds = torch.utils.data.TensorDataset(torch.randint(0, 11, (5, 6)), torch.randint(0, 11, (5, 6)))
    x, y = ds.tensors
    logits = model.eval()(x)
    assert evaluate_loss(model, ds, batch_size=2) == pytest.approx(
        float(F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))), rel=1e-5)


@pytest.mark.parametrize("kwargs, match", [({"optimizer": "rmsprop"}, "optimizer"), ({"n_heads": 3}, "divisible")])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        small(**kwargs)
    with pytest.raises(ValueError, match="max_len"):
        small()(torch.zeros(1, 7, dtype=torch.long))
