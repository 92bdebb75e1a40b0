"""A plain loop's clip of the released update (validators/plain_loop.py, ``_watched_clip``; the release boundary's
``post_processed``): ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` of ĝ_t to constants between
``release()`` and ``optimizer.step()`` is post-processing and trains undeclared while the loop has not read the
loss's value (qa39 p05); a bound from the loss, a total norm passed in, or a gradient changed before the clip is
still refused before the update."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep

REFUSED = "The released gradient ĝ_t was changed before the optimizer stepped with it"


@pytest.fixture
def plain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    yield step, model, opt, loader
    step.detach()


def _loop(plain: Any, after_release: Callable[[nn.Module, torch.Tensor], None], steps: int = 3) -> None:
    """``steps`` releases; ``after_release(model, loss)`` runs between each release and its ``optimizer.step()``."""
    step, model, opt, loader = plain
    for i, (x, y) in enumerate(loader):
        loss = torch.zeros(())
        if step.begin():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        step.release(optimizer=opt)
        after_release(model, loss)
        opt.step()
        opt.zero_grad()
        if i + 1 == steps:
            break


@pytest.mark.parametrize("clip", [lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
                                  lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm=0.05, norm_type=2.0),
                                  lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(list(ps), 0.05, "inf"),
                                  lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01)],
                         ids=["norm", "norm_keywords", "clip_grad.norm_inf", "value"])
def test_a_clip_of_the_released_update_to_a_constant_trains_undeclared(plain, clip):
    step, model, opt, _ = plain
    steps = []

    def clipped(model: nn.Module, loss: torch.Tensor) -> None:
        before = [p.grad.clone() for p in model.parameters()]
        clip(model.parameters())
        after = [p.grad.clone() for p in model.parameters()]
        steps.append(any(not torch.equal(b, a) for b, a in zip(before, after)))

    _loop(plain, clipped)
    assert step.ledger.steps == 3
    assert any(steps), "the clip never changed ĝ: the test does not exercise the post-processing"


def _clip_to_loss(model: nn.Module, loss: torch.Tensor) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3 * float(loss))  # reads the loss: a bound from the data


def _clip_to_tensor(model: nn.Module, loss: torch.Tensor) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), loss.detach().clone() * 1e-3)  # a tensor bound


def _total_norm_passed(model: nn.Module, loss: torch.Tensor) -> None:
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 0.05, torch.tensor(1e3))  # a norm of its own


def _written_then_clipped(model: nn.Module, loss: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad.add_(1.0)  # a change of ĝ before the clip: not a function of ĝ alone as far as the check knows
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


@pytest.mark.parametrize("after_release", [_clip_to_loss, _clip_to_tensor, _total_norm_passed,
                                           _written_then_clipped],
                         ids=["bound_from_loss", "tensor_bound", "total_norm_passed", "written_then_clipped"])
def test_a_clip_that_is_not_of_the_released_update_to_a_constant_is_still_refused(plain, after_release):
    step, model, opt, _ = plain
    with pytest.raises(PrivacyConfigurationError, match=REFUSED):
        _loop(plain, after_release)
    assert step.ledger.steps == 1  # refused before the first update


def test_a_bound_kept_from_an_earlier_steps_loss_is_still_refused(plain):
    """The loss read at the first step (nothing set from it there), the bound it gave used at the next: refused."""
    step, model, opt, _ = plain
    kept: list[float] = []

    def kept_then_clipped(model: nn.Module, loss: torch.Tensor) -> None:
        if kept:
            torch.nn.utils.clip_grad_norm_(model.parameters(), kept[0])
        else:
            kept.append(1e-3 * float(loss))

    with pytest.raises(PrivacyConfigurationError, match=REFUSED):
        _loop(plain, kept_then_clipped)
    assert step.ledger.steps == 2  # the first update was made, the second refused


def test_a_clip_after_the_loss_was_printed_is_still_refused(plain):
    """Read once, the loss may have chosen the bound (as for a rate set by hand): refused, as before."""
    step, model, opt, _ = plain

    def printed_then_clipped(model: nn.Module, loss: torch.Tensor) -> None:
        print(f"loss {loss.item():.3f}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    with pytest.raises(PrivacyConfigurationError, match=REFUSED):
        _loop(plain, printed_then_clipped)


def test_a_bound_that_moves_with_the_batch_is_refused_from_the_second_step(plain):
    """A bound computed from each step's batch reads no loss; it moves between steps, and a public constant does
    not: the second step's clip, with another bound than the first's, is refused before its update."""
    step, model, opt, loader = plain
    with pytest.raises(PrivacyConfigurationError, match=REFUSED):
        for x, y in loader:
            if step.begin():
                F.cross_entropy(model(x), y).backward()
            step.release(optimizer=opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2 * float(x.abs().mean()))  # from the batch
            opt.step()
            opt.zero_grad()
    assert step.ledger.steps == 2  # the first update was made, the second refused
