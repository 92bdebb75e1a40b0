"""Closed-form rules of grad_sample/conv_rules.py and prelu_rule.py against the per-example loop (float64).

Random convolutions (1-3 spatial dimensions, plain and transposed, groups, stride, dilation, padding of every kind
and mode, output_padding and output_size), each called twice in one step, one of the calls on flattened examples:
the ghost engine (ghost norm and materialised paths forced, scaled with squares) and the vmap engine, with the
per-example replay disabled so that the rules alone answer.
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_dp.grad_sample.conv_rules as conv_rules
import lightning_dp.grad_sample.functorch_vmap as functorch_vmap
import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample.capture.activations import ActivationCapture
from lightning_dp.grad_sample.base import make_engine
from lightning_dp.grad_sample.prelu_rule import prelu_record_grads
from lightning_dp.grad_sample.rules import rule_for
from gs_cases import assert_close_batch, per_example_grads, random_scale, reference, run_engine

N = 3  # examples
K = 2  # frames per example in the flattened call


def _conv(rng: random.Random, dims: int, transposed: bool) -> tuple[nn.Module, list[int]]:
    """A random convolution and an input size per spatial dimension that it accepts."""
    groups = rng.choice([1, 2])
    c_in, c_out = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    kernel = [rng.randint(1, 3) for _ in range(dims)]
    stride = [rng.randint(1, 2) for _ in range(dims)]
    dilation = [rng.randint(1, 2) for _ in range(dims)]
    size = [rng.randint(3, 5) for _ in range(dims)]
    bias = rng.random() < 0.7
    kind = {1: (nn.Conv1d, nn.ConvTranspose1d), 2: (nn.Conv2d, nn.ConvTranspose2d),
            3: (nn.Conv3d, nn.ConvTranspose3d)}[dims][transposed]
    if transposed:
        padding = [rng.randint(0, min(dl * (k - 1), ((n - 1) * s + dl * (k - 1)) // 2))  # an output ≥ 1 wide
                   for k, s, dl, n in zip(kernel, stride, dilation, size)]
        out_pad = [rng.randint(0, max(s, dl) - 1) for s, dl in zip(stride, dilation)]
        return kind(c_in, c_out, kernel, stride, padding, out_pad, groups, bias, dilation), size
    mode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    padding: object = [rng.randint(0, 2) for _ in range(dims)]
    if rng.random() < 0.3:
        padding, stride = rng.choice(["same", "valid"]), [1] * dims
    if mode == "reflect" and not isinstance(padding, str):
        padding = [min(p, s - 1) for p, s in zip(padding, size)]
    size = [max(s, dl * (k - 1) + 1) for s, k, dl in zip(size, kernel, dilation)]  # at least one window
    return kind(c_in, c_out, kernel, stride, padding, dilation, groups, bias, mode), size


class TwoCalls(nn.Module):
    """The layer on the examples, then on their K frames flattened (``[N·K, C, …]``, a view), both reaching the
    loss; with ``output_size``, a strided transposed convolution is asked for its largest output (its own
    output_padding ignored)."""

    def __init__(self, layer: nn.Module, size: list[int], flattened: bool = True, output_size: bool = False) -> None:
        super().__init__()
        self.layer, self.size, self.flattened = layer, size, flattened
        self.output_size: Optional[list[int]] = None
        if output_size and isinstance(layer, conv_rules.TRANSPOSED) and max(layer.stride) > 1:
            self.output_size = [_largest(layer, s, j) for j, s in enumerate(size)]

    def _call(self, x: Tensor) -> Tensor:
        if self.output_size is not None:
            return self.layer(x, output_size=self.output_size)
        return self.layer(x)

    def forward(self, x: Tensor) -> Tensor:
        first = self._call(x[:, 0]).flatten(1)
        if not self.flattened:
            return torch.cat([first, self._call(torch.tanh(x[:, 1])).flatten(1)], 1)
        frames = torch.tanh(x).flatten(0, 1)  # [N·K, C, …], a view of a contiguous tensor
        second = self._call(frames)
        return torch.cat([first, second.reshape(x.shape[0], -1)], 1)


def _largest(m: nn.Module, size: int, j: int) -> int:
    """The largest output size a transposed convolution accepts for ``output_size`` along spatial dimension j."""
    s, p, k, dl = m.stride[j], m.padding[j], m.kernel_size[j], m.dilation[j]
    return (size - 1) * s - 2 * p + dl * (k - 1) + 1 + s - 1


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return ((model(x) - y) ** 2).sum(1).mean()


def _case(seed: int, dims: int, transposed: bool, flattened: bool = True):
    rng = random.Random(1000 * seed + 10 * dims + transposed)
    torch.manual_seed(seed)
    layer, size = _conv(rng, dims, transposed)
    model = TwoCalls(layer, size, flattened, output_size=seed % 2 == 1).double()
    x = torch.randn(N, K, layer.in_channels, *size, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


@pytest.fixture
def rules_only(monkeypatch):
    """No per-example replay of a convolution or PReLU: the test fails if one runs."""
    def refusing(replay):
        def run(calls, *args, **kwargs):
            if isinstance(calls.module, (*conv_rules.CONVOLUTIONS, *conv_rules.TRANSPOSED, nn.PReLU)):
                raise AssertionError(f"the per-example replay ran for {type(calls.module).__name__}")
            return replay(calls, *args, **kwargs)
        return run

    monkeypatch.setattr(ghost, "fallback_stats", refusing(ghost.fallback_stats))
    monkeypatch.setattr(functorch_vmap, "_layer_grads", refusing(functorch_vmap._layer_grads))


def _check(model: nn.Module, x: Tensor, y: Tensor, engine_name: str, scaled: bool, with_squares: bool) -> None:
    params = list(model.parameters())
    scale = random_scale(params) if scaled else None
    grads = per_example_grads(model, _loss, x, y, params, scale)
    norms = reference(grads, params, float("inf")).norms
    C = float(norms.sort().values[: 2].mean())  # all but one example clipped
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        engine.begin_step(x.shape[0])
        got = run_engine(engine, model, _loss, x, y, params, C, scale, with_squares=with_squares)
    finally:
        engine.detach()
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-9)


CONFIGS = [(seed, dims, transposed) for dims in (1, 2, 3) for transposed in (False, True) for seed in range(6)]


@pytest.mark.parametrize("seed,dims,transposed", CONFIGS)
@pytest.mark.parametrize("path", ["ghost", "materialised", "patches", "scaled", "vmap"])
def test_random_convolutions_match_the_per_example_loop(seed, dims, transposed, path, monkeypatch, rules_only):
    """``materialised``: per-example gradients by the examples-as-groups convolution; ``patches``: by products over
    patch columns (depthwise layers' way)."""
    model, x, y = _case(seed, dims, transposed)
    if path in ("ghost", "materialised", "patches"):
        monkeypatch.setattr(conv_rules, "prefer_conv_ghost", lambda *a: path == "ghost")
        monkeypatch.setattr(conv_rules, "by_patch_products", lambda m: path == "patches")
    _check(model, x, y, "vmap" if path == "vmap" else "ghost", scaled=path == "scaled", with_squares=path == "scaled")


@pytest.mark.parametrize("force", [True, False])
def test_chunked_patch_columns_match(monkeypatch, rules_only, force):
    """Patch columns unfolded one example at a time give the same norms and sums."""
    monkeypatch.setattr(conv_rules, "_MIN_PATCH_CHUNK", 1)
    monkeypatch.setattr(conv_rules, "prefer_conv_ghost", lambda *a: force)
    monkeypatch.setattr(conv_rules, "by_patch_products", lambda m: True)
    for dims, transposed in ((1, False), (2, True), (3, False)):
        model, x, y = _case(11, dims, transposed)
        _check(model, x, y, "ghost", scaled=False, with_squares=False)


def test_the_rule_serves_torch_convolutions_and_subclasses_keeping_their_forward():
    class Std(nn.Conv2d):
        def forward(self, x):
            w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    class Plain(nn.ConvTranspose1d):
        pass

    for m in (nn.Conv1d(2, 2, 3), nn.Conv3d(2, 2, 1), nn.ConvTranspose2d(2, 2, 3), Plain(2, 2, 3)):
        assert rule_for(m) is not None, m
    assert rule_for(Std(2, 2, 3)) is None
    assert rule_for(nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3))) is None


LAYERS = [
    lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="reflect"),
    lambda: nn.Conv2d(4, 4, (4, 3), padding="same", groups=2),
    lambda: nn.Conv3d(3, 2, 2, stride=2, padding=1, padding_mode="circular"),
    lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
    lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, groups=2, dilation=2),
    lambda: nn.ConvTranspose3d(2, 3, 2, stride=(1, 2, 2), padding=1),
]


@pytest.mark.parametrize("make", LAYERS)
def test_input_gradient_only_forward_equals_the_module(make):
    """Ghost's forward for torch's convolutions: the module's output and input gradient, no weight gradient."""
    torch.manual_seed(0)
    layer = make().double()
    shape = (2, layer.in_channels, *[6] * (layer.weight.dim() - 2))
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    gx, = torch.autograd.grad(out, x, torch.ones_like(out))
    engine = make_engine("ghost")
    engine.attach(layer)
    try:
        assert "forward" in layer.__dict__
        out2 = layer(x)
        out2.backward(torch.ones_like(out2))
    finally:
        engine.detach()
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=1e-12)
    assert layer.weight.grad is None


@pytest.mark.parametrize("channels,shape", [(1, (5,)), (1, (3, 4)), (3, (3, 4, 2)), (3, (3,))])
def test_prelu_input_gradient_only_forward_equals_the_module(channels, shape):
    """Ghost's forward for nn.PReLU: the module's output and input gradient (zeros in x included), no slope gradient."""
    torch.manual_seed(0)
    act = nn.PReLU(channels, init=0.3).double()
    x = torch.randn(4, *shape, dtype=torch.float64)
    x[0].view(-1)[:2] = 0.0
    x.requires_grad_(True)
    out = act(x)
    g = torch.randn_like(out)
    gx, = torch.autograd.grad(out, x, g)
    engine = make_engine("ghost")
    engine.attach(act)
    try:
        assert "forward" in act.__dict__
        out2 = act(x)
        out2.backward(g)
    finally:
        engine.detach()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=1e-15)
    assert act.weight.grad is None


def test_convolutions_under_bf16_autocast_give_float32_sums_near_float32_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.PReLU(4), nn.ConvTranspose1d(4, 3, 3, stride=2),
                          nn.Flatten(), nn.Linear(3 * 13, 3))
    x, y = torch.randn(6, 2, 6), torch.randint(0, 3, (6,))
    params = list(model.parameters())

    def clipped(engine_name: str, autocast: bool):
        engine = make_engine(engine_name)
        engine.attach(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        out = engine.clip_and_sum(params, 1.0)
        engine.detach()
        model.zero_grad()
        return out

    for name in ("ghost", "vmap"):
        low, full = clipped(name, True), clipped(name, False)
        assert all(low.sums[p].dtype == torch.float32 and low.sums[p].isfinite().all() for p in params)
        torch.testing.assert_close(low.norms, full.norms, rtol=0.05, atol=0.0)


# ------------------------------------------------------------------------------------------ PReLU
class PReLUTwice(nn.Module):
    """A PReLU on the examples and on their K rows flattened (``[N·K, C, …]``, a view)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = nn.PReLU(channels, init=0.3)
        self.mix = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        first = self.act(self.mix(x[:, 0])).flatten(1)
        second = self.act(self.mix(x).flatten(0, 1)).reshape(x.shape[0], -1)
        return torch.cat([first, second], 1)


@pytest.mark.parametrize("channels,shape", [(1, (4,)), (4, (4,)), (1, (4, 3, 4)), (4, (4, 3, 4)), (4, (4, 2, 2, 4))])
@pytest.mark.parametrize("engine_name", ["ghost", "vmap"])
def test_prelu_matches_the_per_example_loop(channels, shape, engine_name, rules_only):
    torch.manual_seed(0)
    model = PReLUTwice(channels).double()
    x = torch.randn(N, K, *shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    _check(model, x, y, engine_name, scaled=False, with_squares=True)
    _check(model, x, y, engine_name, scaled=True, with_squares=False)


def test_prelu_calls_are_reduced_during_backward():
    """After backward the ghost capture holds only PReLU's [n, C] grads, equal to the per-call formula."""
    torch.manual_seed(0)
    act = nn.PReLU(3).double()
    held, reduced = ActivationCapture(), ActivationCapture()
    held.attach([("act", act)])
    reduced.attach([("act", act)], ghost.reducer_for)
    x = torch.randn(N, 3, 5, dtype=torch.float64, requires_grad=True)
    (act(x) ** 2).sum().backward()
    got, ref = reduced.completed()[id(act)], held.completed()[id(act)]
    assert got.records == [] and len(ref.records) == 1
    torch.testing.assert_close(got.reduced["weight"], prelu_record_grads(act, ref.records[0])["weight"])
    xd = x.detach()
    expect = torch.stack([(xd[i].clamp(max=0) * 2 * act(xd[i:i + 1])[0]).sum(1) for i in range(N)]) * N
    torch.testing.assert_close(got.reduced["weight"], expect)
