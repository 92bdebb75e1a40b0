"""The mechanism runs outside the user's torch modes (lightning_dp/mode_free.py): a TorchDispatchMode or
TorchFunctionMode entered around the fit may answer the model's operations, never the noise, the clipping or the
division by the expected batch (zoo35 R08, R07)."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent / "privacy" / "boundary"))
from cases import Classifier, fit, parameters  # noqa: E402

from lightning_dp.mode_free import user_modes, without_user_modes  # noqa: E402
from lightning_dp.privacy.noise import GaussianNoise  # noqa: E402
from lightning_dp.privacy.private_step import PrivateStep  # noqa: E402


class ZeroNormalDispatch(TorchDispatchMode):
    """An "op counter" that zeroes ``aten.normal_`` drawn with a generator (the library's noise draw)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.normal_.default and kwargs.get("generator") is not None:
            return args[0].zero_()
        return func(*args, **kwargs)


class ZeroNormalFunction(TorchFunctionMode):
    """The same at the torch-function level: ``Tensor.normal_`` with a generator answers zeros."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "normal_" and kwargs.get("generator") is not None:
            return args[0].zero_()
        return func(*args, **kwargs)


class HalveEverything(TorchDispatchMode):
    """Answers every floating result halved: the division by B, the scale factors and the noise alike."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and func._schema.is_mutable is False:
            return out * 0.5
        return out


SIGMA, C, N, BATCH = 4.0, 1.0, 64, 8


@pytest.mark.parametrize("mode,around_backward", [(ZeroNormalDispatch, True), (ZeroNormalFunction, True),
                                                  (HalveEverything, False)])
def test_the_release_under_a_users_mode_has_the_noise_variance_sigma_c_over_b_squared(mode: type,
                                                                                      around_backward: bool) -> None:
    """ĝ = (S + σCz)/B: with 10,100 coordinates and ‖S/B‖² ≤ (N/B)²C², the coordinates' empirical variance is
    (σC/B)² within 6 % (four standard errors of the estimate: √(2/d) ≈ 1.4 %); the mode zeroing the draw made it 0,
    the one halving every result a quarter. (Halving the model's own backward too would change the loss the plain
    loop verified: refused there, as another loss than the verified one.)"""
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(SIGMA, C, GaussianNoise(seed=3), engine="ghost", sampler_seed=0)
    step.attach(model, optimizer)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 100, generator=g), torch.randint(0, 100, (N,), generator=g))
    loader = step.poisson_loader(DataLoader(data, batch_size=BATCH))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    batch = next(iter(loader))
    user = mode()
    with user if around_backward else nullcontext():
        step.begin()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    with user:
        step.release(optimizer=optimizer)
        assert user_modes()[-1] is user  # put back after the release
    step.detach()
    released = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    expected = (SIGMA * C / step.plan.expected_batch_size) ** 2
    assert released.var().item() == pytest.approx(expected, rel=0.06)


def test_a_dispatch_mode_zeroing_the_draw_around_the_fit_leaves_the_noise() -> None:
    """zoo35 R08 through Lightning: σ = 100 moves the weights by about σC/B·√d·lr per step whatever the mode does."""
    model = Classifier()
    before = parameters(model)
    with ZeroNormalDispatch():
        fit(model, steps=3, noise_multiplier=100.0)
    drift = torch.cat([(p.detach() - b).reshape(-1) for b, p in zip(before, model.parameters())]).norm().item()
    assert drift > 10.0


def test_a_flop_counter_around_the_fit_trains_and_counts_the_models_flops() -> None:
    counter, model = FlopCounterMode(display=False), Classifier()
    with counter:
        fit(model, steps=3)
    assert model.trainer.global_step == 3 and counter.get_total_flops() > 0


def test_the_modes_are_put_back_in_order_also_after_an_exception() -> None:
    outer, inner, dispatch = ZeroNormalFunction(), ZeroNormalFunction(), ZeroNormalDispatch()
    with outer, inner, dispatch:
        stack = user_modes()
        with pytest.raises(RuntimeError), without_user_modes():
            assert user_modes() == []
            assert torch.empty(1000).normal_(0, 1, generator=torch.Generator().manual_seed(0)).std() > 0.5
            raise RuntimeError
        assert user_modes() == stack == [outer, inner, dispatch]
        assert torch.empty(3).normal_(0, 1, generator=torch.Generator()).abs().sum() == 0  # the user's mode again
