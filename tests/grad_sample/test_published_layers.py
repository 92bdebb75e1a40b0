"""Layers of published speech-separation and generative projects, written here after their public patterns: every
layer served in closed form (no per-example replay), exact against the per-example loop, engine-level and through
DPStrategy.

- Conv-TasNet (Luo & Mesgarani): a Conv1d encoder, 1×1 and depthwise dilated Conv1d blocks with PReLU and a global
  layer norm ``gamma * (y - mean) / torch.pow(var + EPS, 0.5) + beta`` (γ, β [1, C, 1]), a ConvTranspose1d decoder;
- DPRNN's ``GlobalLayerNorm`` (``weight * (x - mean) / torch.sqrt(var + eps) + bias``, weight and bias [C, 1]), and a
  Conv1d on flattened rows (a view ``[B·2, C/2, L]``);
- a DCGAN-style ConvTranspose2d decoder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import lightning_dp.grad_sample.functorch_vmap as functorch_vmap
import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample.base import make_engine
from gs_cases import assert_close_batch, per_example_grads, random_scale, reference, run_engine

sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))

import zoo  # noqa: E402


class GlobLN(nn.Module):
    """Conv-TasNet's gLN, γ and β of shape [1, C, 1]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(1 + 0.3 * torch.randn(1, channels, 1))
        self.beta = nn.Parameter(0.3 * torch.randn(1, channels, 1))

    def forward(self, y: Tensor) -> Tensor:
        mean = y.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        var = (torch.pow(y - mean, 2)).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class DualPathGLN(nn.Module):
    """DPRNN's GlobalLayerNorm, weight and bias of shape [C, 1]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(channels, 1))
        self.bias = nn.Parameter(0.3 * torch.randn(channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        mean = torch.mean(x, (1, 2), keepdim=True)
        var = torch.mean((x - mean) ** 2, (1, 2), keepdim=True)
        return self.weight * (x - mean) / torch.sqrt(var + 1e-8) + self.bias


class Separator(nn.Module):
    """Conv-TasNet-like: encoder, one block (its gLN called twice), a Conv1d on flattened rows, mask, decoder."""

    def __init__(self, filters: int = 6, hidden: int = 4, kernel: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Conv1d(1, filters, kernel, stride=kernel // 2, bias=False)
        self.inp, self.act = nn.Conv1d(filters, hidden, 1), nn.PReLU()
        self.norm = GlobLN(hidden)
        self.depth = nn.Conv1d(hidden, hidden, 3, dilation=2, padding=2, groups=hidden)
        self.act2, self.out = nn.PReLU(hidden), nn.Conv1d(hidden, filters, 1)
        self.chunk_norm, self.chunk_mix = DualPathGLN(filters), nn.Conv1d(filters // 2, filters // 2, 3, padding=1)
        self.decoder = nn.ConvTranspose1d(filters, 1, kernel, stride=kernel // 2, bias=False)

    def forward(self, wave: Tensor) -> Tensor:
        w = torch.relu(self.encoder(wave))  # [B, F, L]
        h = self.norm(self.act(self.inp(w)))
        h = self.out(self.norm(self.act2(self.depth(h))))
        b, f, L = h.shape
        mixed = self.chunk_mix(h.view(b * 2, f // 2, L)).view(b, f, L)  # two channel groups as rows: [B·2, F/2, L]
        m = torch.sigmoid(self.chunk_norm(mixed + h))
        return self.decoder(w * m)


class Decoder(nn.Module):
    """DCGAN's generator: latent [3, 1, 1] → ConvTranspose2d ×3 → image."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.ConvTranspose2d(3, 4, 2, 1, 0, bias=False)
        self.up1, self.act, self.up2 = nn.ConvTranspose2d(4, 3, 4, 2, 1), nn.PReLU(3), nn.ConvTranspose2d(3, 1, 4, 2, 1)

    def forward(self, z: Tensor) -> Tensor:
        return torch.tanh(self.up2(self.act(self.up1(torch.relu(self.project(z[:, :, None, None]))))))


N = 4
WAVE = 22  # samples: 10 encoder frames, two chunks of 5


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return ((model(x) - y) ** 2).flatten(1).sum(1).mean()


@pytest.fixture
def no_replay(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a layer was replayed per example")

    monkeypatch.setattr(ghost, "fallback_stats", refuse)
    for replay in ("vmap", "loop_layer_grads", "replayed_layer_grads"):
        monkeypatch.setattr(functorch_vmap, replay, refuse)


def _batch(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return x, torch.randn_like(model(x))


CASES = {"separator": (Separator, (1, WAVE)), "decoder": (Decoder, (3,))}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("engine_name", ["ghost", "vmap"])
@pytest.mark.parametrize("scaled", [False, True])
def test_every_layer_in_closed_form_matches_the_per_example_loop(name, engine_name, scaled, no_replay):
    torch.manual_seed(0)
    make, shape = CASES[name]
    model = make().double()
    x, y = _batch(model, torch.randn(N, *shape, dtype=torch.float64))
    params = list(model.parameters())
    scale = random_scale(params) if scaled else None
    grads = per_example_grads(model, _mse, x, y, params, scale)
    C = float(reference(grads, params, float("inf")).norms.median())
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        engine.begin_step(N)
        got = run_engine(engine, model, _mse, x, y, params, C, scale, with_squares=scaled)
    finally:
        engine.detach()
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-9)


class SeparatorModule(zoo.Base):
    def __init__(self) -> None:
        super().__init__()
        self.net = Separator()

    def loss(self, batch):
        wave, target = batch
        return F.mse_loss(self.net(wave), target)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_the_separator_trains_exactly_under_dp_strategy(engine):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(zoo.N, 1, WAVE, generator=g), torch.randn(zoo.N, 1, WAVE, generator=g))
    zoo.assert_exact(SeparatorModule, data, per_sample=engine)
