"""Augmentation multiplicity: an example's K views give ONE clipped gradient, the mean of theirs
(per-example loop in float64, every engine that accepts it); engines that cannot are refused."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.data import AugmentedViews, RandomShift
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.privacy.private_step import PrivateStep

K, N, B, C = 3, 24, 6, 0.05


class ZeroNoise(NoiseMechanism):
    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        return [torch.zeros_like(t) for t in like]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 8 * 8, 4)).double()


def _views() -> AugmentedViews:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (N,), generator=g))
    return AugmentedViews(data, RandomShift(1, fill=0.0), K, identity_first=True)


def _loss(model: nn.Module, batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("engine", ["vmap", "opacus_hooks"])
def test_views_give_the_clipped_mean_of_their_gradients(engine):
    model = _model()
    step = PrivateStep(1.0, C, ZeroNoise(), engine=engine, sampler_seed=3, views_per_example=K)
    step.attach(model)
    loader = step.poisson_loader(DataLoader(_views(), batch_size=B, collate_fn=AugmentedViews.collate))
    step.verify(lambda batch: _loss(model, batch))
    torch.manual_seed(5)
    batch = next(b for b in loader if len(b[0]) > 0)  # the views drawn here are the ones differentiated
    n = step.begin()
    assert len(batch[0]) == n * K
    _loss(model, batch).backward()
    step.release()
    step.detach()
    params = list(model.parameters())
    expected = [torch.zeros_like(p) for p in params]
    clipped = 0
    for i in range(n):  # example i = its K consecutive rows; its loss the mean over them
        rows = slice(i * K, (i + 1) * K)
        grads = torch.autograd.grad(_loss(model, (batch[0][rows], batch[1][rows])), params)
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        clipped += norm > C
        for e, g in zip(expected, grads):
            e.add_(g * min(1.0, C / (norm + 1e-6)))  # clip_factors (base.py)
    assert clipped > 0  # clipping is exercised: a per-view clip would differ
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e / B, rtol=1e-9, atol=1e-12)


def test_rows_that_are_not_k_views_per_example_are_refused():
    model = _model()
    step = PrivateStep(1.0, C, ZeroNoise(), engine="vmap", sampler_seed=3, views_per_example=K)
    step.attach(model)
    plain = TensorDataset(torch.randn(N, 1, 8, 8, dtype=torch.float64), torch.randint(0, 4, (N,)))
    loader = step.poisson_loader(DataLoader(plain, batch_size=B))  # the views wrapper forgotten
    with pytest.raises(PrivacyConfigurationError):
        step.verify(lambda batch: _loss(model, batch))


def test_an_engine_without_views_is_refused_and_auto_picks_one_that_has_them():
    with pytest.raises(PrivacyConfigurationError, match="views|multiplicity"):
        PrivateStep(1.0, C, ZeroNoise(), engine="ghost", views_per_example=K).attach(_model())
    step = PrivateStep(1.0, C, ZeroNoise(), views_per_example=K)
    assert step.attach(_model()) in ("vmap", "opacus_hooks")
    assert PrivateStep(1.0, C, ZeroNoise()).attach(_model()) == "ghost"  # K = 1: today's path


def test_views_are_consecutive_and_the_first_is_the_example():
    views = _views()
    batch = AugmentedViews.collate([views[0], views[1]])
    assert batch[0].shape == (2 * K, 1, 8, 8)
    assert torch.equal(batch[0][0], views.dataset[0][0]) and torch.equal(batch[0][K], views.dataset[1][0])
    assert batch[1][:K].eq(views.dataset[0][1]).all() and batch[1][K:].eq(views.dataset[1][1]).all()


def _view_major(batch):
    """A collate that lays views out view-major (all first views, then all second views, ...): the rows
    are n·K as expected, but rows i·K … i·K + K − 1 are no longer one example's views."""
    from torch.utils.data._utils.collate import default_collate

    return default_collate([views[k] for k in range(K) for views in batch])


def test_views_not_consecutive_per_example_are_refused_by_the_probe():
    model = _model()
    step = PrivateStep(1.0, C, ZeroNoise(), engine="vmap", sampler_seed=3, views_per_example=K)
    step.attach(model)
    step.poisson_loader(DataLoader(_views(), batch_size=B, collate_fn=_view_major))
    with pytest.raises(PrivacyConfigurationError, match="interact"):
        step.verify(lambda batch: _loss(model, batch))
