"""The Lightning-free private step (privacy/private_step.py), driven as a plain PyTorch loop."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import ledger_epsilon
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism
from lightning_dp.privacy.release import Release
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.losses import mean_loss
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.optim import DPSignSGD
from lightning_dp.errors import PrivacyConfigurationError


class ZeroNoise(NoiseMechanism):
    """z = 0: the release is the clipped mean itself (tests the arithmetic, never private)."""

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        return [torch.zeros_like(t) for t in like]


def _setup(noise: NoiseMechanism, n: int = 40, batch_size: int = 8, optimizer_cls=torch.optim.SGD, c: float = 0.3):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(n, 5), torch.randint(0, 3, (n,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    step = PrivateStep(1.0, c, noise, sampler_seed=0)
    step.attach(model, optimizer)
    loader = step.poisson_loader(DataLoader(data, batch_size=batch_size))
    return step, model, optimizer, loader, data


def _loss(model: nn.Module, batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_release_is_the_mean_of_clipped_per_example_gradients():
    step, model, optimizer, loader, data = _setup(ZeroNoise())
    step.verify(lambda batch: _loss(model, batch))
    batch = next(iter(loader))
    n = step.begin()
    assert n == len(batch[0])
    _loss(model, batch).backward()
    step.release(optimizer=optimizer)
    step.detach()  # the reference below is plain autograd
    params = list(model.parameters())
    expected = [torch.zeros_like(p) for p in params]
    for x, y in zip(*batch):  # the per-example loop, clipped to C, summed, divided by the expected batch
        grads = torch.autograd.grad(_loss(model, (x[None], y[None])), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for e, g in zip(expected, grads):
            e.add_(g * min(1.0, step.max_grad_norm / float(norm)))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e / 8.0, rtol=1e-5, atol=1e-7)
    assert step.ledger.steps == 1 and step.steps_taken == 1


def test_a_release_before_verify_is_refused():
    step, model, optimizer, loader, _ = _setup(GaussianNoise(0))
    batch = next(iter(loader))
    step.begin()
    _loss(model, batch).backward()
    with pytest.raises(RuntimeError, match="verify"):
        step.release()
    assert step.ledger.steps == 0


def test_verify_refuses_a_summed_loss():
    step, model, _, _, _ = _setup(GaussianNoise(0))
    with pytest.raises(PrivacyConfigurationError, match="mean"):
        step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1], reduction="sum"))


def test_the_noise_mechanism_charges_the_ledger():
    step, model, _, loader, _ = _setup(BandedToeplitzNoise(3, seed=0), n=60, batch_size=5)
    step.verify(lambda batch: _loss(model, batch))
    for t, batch in zip(range(7), loader):
        if step.begin():
            _loss(model, batch).backward()
        step.release()
    assert step.ledger.steps == 3  # rounds opened at steps 0, 3, 6
    assert [step.rounds_at(t) for t in range(4)] == [1, 0, 0, 1]


def test_sign_vote_is_chosen_by_the_optimizer_and_returns_a_release():
    step, model, optimizer, loader, _ = _setup(GaussianNoise(0), optimizer_cls=DPSignSGD)
    assert step.mechanism == "sign_vote"
    step.verify(lambda batch: _loss(model, batch))
    batch = next(iter(loader))
    step.begin()
    _loss(model, batch).backward()
    release = step.release()
    assert isinstance(release, Release) and release.noise_std == pytest.approx(1.0 * 0.3 / 8.0)
    assert all(set(p.grad.unique().tolist()) <= {-1.0, 0.0, 1.0} for p in model.parameters())
    assert step.ledger.steps == 1


def test_state_dict_round_trip_keeps_the_privacy_state():
    step, model, _, loader, _ = _setup(GaussianNoise(0))
    step.verify(lambda batch: _loss(model, batch))
    for _, batch in zip(range(3), loader):
        if step.begin():
            _loss(model, batch).backward()
        step.release()
    fresh = PrivateStep(2.0, 0.3, GaussianNoise(1))
    fresh.load_state_dict(step.state_dict())
    assert fresh.noise_multiplier == 1.0 and fresh.steps_taken == 3 and fresh.plan == step.plan
    assert ledger_epsilon(fresh.ledger, 1e-5) == ledger_epsilon(step.ledger, 1e-5) > 0
    assert fresh.changes_from(step.state_dict(), 2.0) == ["noise_multiplier (σ): checkpoint 1.0, this run 2.0"]


def test_calibration_meets_the_target_over_the_planned_steps():
    noise = GaussianNoise(0)
    step = PrivateStep(None, 1.0, noise, target_epsilon=2.0, target_delta=1e-5)
    model = nn.Linear(3, 2)
    step.attach(model)
    step.poisson_loader(DataLoader(TensorDataset(torch.randn(1000, 3)), batch_size=50))
    sigma = step.calibrate(200)
    assert sigma is not None and step.noise_multiplier == sigma
    from lightning_dp.accounting import epsilon

    assert epsilon(sigma, 0.05, 200, 1e-5) == pytest.approx(2.0, rel=1e-3)


def test_the_ceiling_sees_releases_charged_outside_release():
    """A caller that privatises clipped_sums() itself charges the ledger (its documented contract): the ceiling's
    cached count of rounds left must not outlive that charge."""
    step = PrivateStep(None, 1.0, GaussianNoise(0), target_epsilon=2.0, target_delta=1e-5)
    step.attach(nn.Linear(3, 2))
    step.poisson_loader(DataLoader(TensorDataset(torch.randn(1000, 3)), batch_size=50))
    step.fit_target(0, 200)
    assert step.affordable()  # the count of rounds left is cached now
    step.ledger.record(step.noise_multiplier, 0.05, steps=200)
    assert not step.affordable() and "would spend more than target_epsilon" in step.refusal()


def test_a_second_private_step_on_the_same_model_continues_its_ledger():
    step, model, _, loader, _ = _setup(GaussianNoise(0))
    step.verify(lambda batch: _loss(model, batch))
    for _, batch in zip(range(3), loader):
        if step.begin():
            _loss(model, batch).backward()
        step.release()
    step.detach()
    second = PrivateStep(1.0, 0.3, GaussianNoise(1))
    second.attach(model)
    assert second.ledger.steps == 3 and "already made 3 private release(s)" in second.adopted
    step.ledger.record(1.0, 0.2)  # the first step's ledger, reused elsewhere, is not the model's any more
    assert second.ledger.steps == 3


def test_mean_loss_convention():
    assert mean_loss(torch.tensor([1.0, 3.0]), 2) == 2.0
    assert mean_loss({"loss": torch.tensor([1.0, 3.0])}, 2)["loss"] == 2.0
    with pytest.raises(PrivacyConfigurationError, match="3 entries for a batch of 2"):
        mean_loss(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_one_model_takes_one_engine_at_a_time():
    """A second private step on a model that still carries the first one's hooks is refused (the two
    engines would capture each other's calls); after detach() the model can be attached again."""
    model = nn.Linear(3, 2)
    first = PrivateStep(1.0, 1.0, GaussianNoise(0))
    first.attach(model)
    with pytest.raises(PrivacyConfigurationError, match="already attached"):
        PrivateStep(1.0, 1.0, GaussianNoise(1)).attach(model)
    first.detach()
    PrivateStep(1.0, 1.0, GaussianNoise(1)).attach(model)


def _toggled_setup(engine: str):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 5), torch.randint(0, 3, (40,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(1.0, 0.3, GaussianNoise(), engine=engine, sampler_seed=0)
    step.attach(model, optimizer)
    batches = iter(step.poisson_loader(DataLoader(data, batch_size=8)))
    step.verify(lambda batch: _loss(model, batch))

    def one_step() -> None:
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if step.begin():
            _loss(model, batch).backward()
        step.release(optimizer=optimizer)
        optimizer.step()

    return step, model, one_step


@pytest.mark.parametrize("engine", ["ghost", "opacus_hooks"])
@pytest.mark.parametrize("then", ["begin", "verify"])
def test_a_parameter_set_back_after_a_refused_begin_is_checked_again_and_trains(engine, then):
    """requires_grad toggled off is refused at begin(); set back, the next begin() checks the set again (it was not
    left as checked by the refused one: the engine stayed attached to the frozen set) and asks for verify() again,
    and verify() re-attaches first: the corrected model trains, every parameter privatised."""
    step, model, one_step = _toggled_setup(engine)
    try:
        one_step()
        model[0].weight.requires_grad_(False)
        with pytest.raises(PrivacyConfigurationError, match=r"parameters changed since verify\(\)"):
            one_step()
        model[0].weight.requires_grad_(True)
        if then == "begin":
            with pytest.raises(PrivacyConfigurationError, match=r"parameters changed since verify\(\)"):
                one_step()
        step.verify(lambda batch: _loss(model, batch))
        before = model[0].weight.detach().clone()
        for _ in range(2):
            one_step()
        assert step.ledger.steps == 3
        assert not step.boundary.parameters_changed()
        assert not torch.equal(before, model[0].weight.detach())
    finally:
        step.detach()
