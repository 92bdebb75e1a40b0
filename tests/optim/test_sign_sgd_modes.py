"""DP-SignSGD's round past the model's backward runs outside the user's torch modes (lightning_dp/mode_free.py): a
TorchDispatchMode entered around VirtualWorkersSignSGD.step that scales the workers' stacked clipped sums (so the
noise σC no longer covers them: sign(10⁶·S_m + σCz) is the sign of the un-noised sum) or flips the vote changes
nothing the workers release."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dp.optim.sign_sgd import VirtualWorkersSignSGD


class ScaleStacked(TorchDispatchMode):
    """Answers ``aten.stack`` (the workers' sums, stacked) multiplied by 10⁶."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 1e6 if func is torch.ops.aten.stack.default and out.is_floating_point() else out


class FlipSigns(TorchDispatchMode):
    """Answers ``aten.sign`` negated (every worker's released sign turned around)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return -out if func is torch.ops.aten.sign.default else out


def _workers(m: int = 3, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(m):
        x = torch.randn(n, 3, generator=g)
        out.append((x, (x[:, :1] > 0).float()))
    return out


def _votes(mode: Any, rounds: int = 6) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    runner = VirtualWorkersSignSGD(nn.Linear(3, 1), F.binary_cross_entropy_with_logits, _workers(), 0.5, 0.1,
                                   noise_multiplier=30.0, max_grad_norm=1.0, generator=torch.Generator().manual_seed(3))
    votes, agreement = [], []
    for _ in range(rounds):
        with mode:
            step = runner.step()
        votes.append(step.vote.clone())
        agreement.append(step.agreement)
    runner.detach()
    return votes, agreement


@pytest.mark.parametrize("mode", [ScaleStacked, FlipSigns])
def test_a_mode_around_the_round_changes_nothing_released(mode: type) -> None:
    from contextlib import nullcontext

    plain = _votes(nullcontext())
    hostile = _votes(mode())
    assert all(torch.equal(a, b) for a, b in zip(plain[0], hostile[0]))
    assert plain[1] == hostile[1]
