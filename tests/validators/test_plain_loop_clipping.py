"""A plain loop's own gradient clipping (lightning_dp/validators/plain_loop.py): between begin() and release() the
step's gradients are the mechanism's (``p.grad`` is ``None``), so ``torch.nn.utils``'s clipping of them is refused with
the fix (max_grad_norm; a clip of the noised update after release()); torch's functions are back after the release."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep

ORIGINALS = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_)


@pytest.fixture
def plain(request):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    public = getattr(request, "param", ())
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0, public_state=public)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    yield step, model, opt, loader
    step.detach()


@pytest.mark.parametrize("clip", [lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
                                  lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
                                  lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(list(ps), 1.0)],
                         ids=["clip_grad_value_", "clip_grad_norm_", "clip_grad.clip_grad_norm_"])
def test_a_clip_between_backward_and_release_is_refused_with_the_fix(plain, clip):
    step, model, opt, loader = plain
    x, y = next(b for b in loader if len(b[0]))
    step.begin(len(x))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyConfigurationError, match="Clipping is the mechanism's: set max_grad_norm") as info:
        clip(model.parameters())
    assert "after step.release()" in str(info.value)
    assert step.ledger.steps == 0


@pytest.mark.parametrize("plain", [["p.grad"]], indirect=True)
def test_a_clip_of_the_released_update_and_of_another_models_gradients_train(plain):
    """The neighbours: a clip after release() (post-processing of the noised update, declared as the refusal says)
    and, inside the step, a clip of a model the step does not release; torch's own functions run once the step is
    released (still watched until detach: test_plain_loop_post_clip.py) and are back after detach."""
    step, model, opt, loader = plain
    other = nn.Linear(4, 1)  # a model of public data's (its gradients set here)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    for x, y in loader:
        if step.begin():
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        step.release(optimizer=opt)
        assert tuple(getattr(f, "original", f) for f in (torch.nn.utils.clip_grad_norm_,
                                                         torch.nn.utils.clip_grad_value_)) == ORIGINALS
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        assert all(p.grad.abs().max() <= 0.01 for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch
    assert torch.cat([p.grad.flatten() for p in other.parameters()]).norm() <= 1.0 + 1e-6
    step.detach()
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_) == ORIGINALS
