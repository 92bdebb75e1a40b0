"""The release index and the sampling plan are the mechanism's own (lightning_dp/validators/step_index.py): a plain
loop cannot pass an index of its own (red team p1, p1b), a restored state cannot replace the loader's plan (p7), and a
resumed banded loader continues the ledger's group cycle (p12)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import ledger_epsilon
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep

torch.set_num_threads(1)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _step(model: nn.Module, bands: int = 1, sigma=1.0, **kwargs) -> tuple[PrivateStep, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = BandedToeplitzNoise(bands=bands, seed=0) if bands > 1 else GaussianNoise(seed=0)
    step = PrivateStep(sigma, 1.0, noise, sampler_seed=0, **kwargs)
    step.attach(model, opt)
    return step, opt


def _verify(step: PrivateStep, model: nn.Module) -> None:
    step.verify(lambda b: F.cross_entropy(model(b[0]), b[1]))


def _train(step, model, opt, batches, **release):
    """The honest loop over ``batches``; returns (index, groups of the batch, rounds charged) per release."""
    seen = []
    for x, y in batches:
        if step.begin():
            F.cross_entropy(model(x), y).backward()
        index, drawn = step.steps_taken, step.loop.indices
        before = sum(e.steps for e in step.ledger.entries)
        step.release(optimizer=opt, **release)
        opt.step()
        opt.zero_grad()
        sampler = step._batches.inner
        groups = {sampler.group_of(i) for i in drawn} if hasattr(sampler, "group_of") else set()
        seen.append((index, groups, sum(e.steps for e in step.ledger.entries) - before))
    return seen


def _epochs(loader, n):
    for _ in range(n):
        yield from loader


def _rounds(step) -> int:
    return sum(e.steps for e in step.ledger.entries)


# ---------------------------------------------------------------- p1, p1b: the index is the mechanism's count
def test_a_loop_passing_its_own_index_is_refused():
    model = _model()
    step, opt = _step(model, bands=2)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))
    _verify(step, model)
    x, y = next(iter(loader))
    step.begin()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyConfigurationError, match=r"release\(step=1\): the next release is step 0"):
        step.release(step=1, optimizer=opt)  # rounds_at(1) = 0: every such release would be charged nothing
    assert step.ledger.steps == 0
    with pytest.raises(PrivacyConfigurationError, match=r"refusal\(step=1\)"):
        step.refusal(1)  # a ceiling asked about another step's rounds would never refuse
    assert step.refusal(0) is None and step.refusal() is None  # its own index may be named


def test_a_target_epsilon_stops_a_banded_loop_at_its_own_index():
    """p1b: a target ε = 1 calibrated for 8 steps: the ceiling refuses by the ledger's own count."""
    model = _model()
    step, opt = _step(model, bands=2, sigma=None, target_epsilon=1.0, target_delta=1e-3)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))
    step.calibrate(8)
    _verify(step, model)
    with pytest.raises(PrivacyConfigurationError, match=r"affordable\(step=3\)"):
        step.affordable(3)
    released = 0
    with pytest.raises(PrivacyConfigurationError, match="not released"):
        for x, y in _epochs(loader, 6):
            if step.begin():
                F.cross_entropy(model(x), y).backward()
            step.release(optimizer=opt)
            opt.step()
            opt.zero_grad()
            released += 1
    assert 8 <= released < 48
    assert _rounds(step) == math.ceil(released / 2)
    assert ledger_epsilon(step.ledger, 1e-3) <= 1.0 + 1e-9


def test_the_honest_banded_loop_charges_one_round_per_cycle():
    model = _model()
    step, opt = _step(model, bands=2)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))
    _verify(step, model)
    seen = _train(step, model, opt, _epochs(loader, 2))
    assert [index for index, _, _ in seen] == list(range(len(seen)))
    assert [rounds for _, _, rounds in seen] == [1 - t % 2 for t in range(len(seen))]
    assert all(groups <= {t % 2} for t, groups, _ in seen)
    assert _rounds(step) == step.ledger.steps == math.ceil(len(seen) / 2) and step.steps_taken == len(seen)


# ---------------------------------------------------------------- p7: the plan is the loader's
def _state_of_larger_run() -> dict:
    model = _model()
    step, _ = _step(model)
    step.poisson_loader(DataLoader(_data(640), batch_size=8))  # q = 0.0125
    state = step.state_dict()
    step.detach()
    return state


def test_a_restored_state_does_not_replace_the_loaders_plan():
    state = _state_of_larger_run()
    model = _model()
    step, opt = _step(model)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))  # q = 0.125
    drawn = step.plan
    step.load_state_dict(state)
    assert step.plan == drawn
    _verify(step, model)
    _train(step, model, opt, _epochs(loader, 2))
    assert {e.sample_rate for e in step.ledger.entries} == {drawn.sample_rate} == {0.125}


def test_a_state_restored_before_the_loader_is_planned_by_the_loader():
    state = _state_of_larger_run()
    model = _model()
    step, opt = _step(model)
    step.load_state_dict(state)
    assert step.plan is not None and step.plan.sample_rate == 0.0125  # a report before any loader
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))
    assert (step.plan.sample_rate, step.plan.num_samples, step.plan.expected_batch_size) == (0.125, 64, 8.0)
    _verify(step, model)
    _train(step, model, opt, loader)
    assert {e.sample_rate for e in step.ledger.entries} == {0.125}


# ---------------------------------------------------------------- p12: a resumed banded cycle continues the ledger's
def _banded_run(releases: int):
    model = _model()
    step, opt = _step(model, bands=2)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=4))
    _verify(step, model)
    batches = iter(loader)
    seen = _train(step, model, opt, (next(batches) for _ in range(releases)))
    state, weights = step.state_dict(), copy.deepcopy(model.state_dict())
    step.detach()
    return seen, state, weights


@pytest.mark.parametrize("order", ["loader_then_load", "load_then_loader"])
def test_a_resumed_banded_loop_continues_the_group_cycle(order):
    before, state, weights = _banded_run(5)
    model = _model()
    model.load_state_dict(weights)
    step, opt = _step(model, bands=2)
    if order == "loader_then_load":
        loader = step.poisson_loader(DataLoader(_data(64), batch_size=4))
        step.load_state_dict(state)
    else:
        step.load_state_dict(state)
        loader = step.poisson_loader(DataLoader(_data(64), batch_size=4))
    _verify(step, model)
    after = _train(step, model, opt, loader)
    seen = before + after
    assert [index for index, _, _ in seen] == list(range(len(seen)))
    assert all(groups <= {t % 2} for t, groups, _ in seen)  # index 5 draws group 1, not group 0 again
    assert [rounds for _, _, rounds in seen] == [1 - t % 2 for t in range(len(seen))]
    assert _rounds(step) == math.ceil(len(seen) / 2)


def test_a_state_restored_within_a_pass_is_refused_at_the_release():
    _, state, weights = _banded_run(5)
    model = _model()
    model.load_state_dict(weights)
    step, opt = _step(model, bands=2)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=4))
    _verify(step, model)
    batches = iter(loader)
    x, y = next(batches)  # drawn at index 0 of the cycle
    step.load_state_dict(state)  # the ledger's next release is 5
    step.begin()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyConfigurationError, match="drawn at step 0"):
        step.release(optimizer=opt)
    assert (step.steps_taken, step.ledger.steps) == (5, 3)  # nothing more charged


def test_a_start_step_off_the_ledger_is_refused():
    _, state, _ = _banded_run(5)
    step, _ = _step(_model(), bands=2)
    step.load_state_dict(state)
    with pytest.raises(PrivacyConfigurationError, match=r"start_step=0\): the ledger's next release is step 5"):
        step.poisson_loader(DataLoader(_data(64), batch_size=4), start_step=0)
    step.poisson_loader(DataLoader(_data(64), batch_size=4), start_step=5)


def test_a_resumed_plain_loop_charges_each_release_once():
    model = _model()
    step, opt = _step(model)
    loader = step.poisson_loader(DataLoader(_data(64), batch_size=8))
    _verify(step, model)
    first = _train(step, model, opt, loader)
    state = step.state_dict()
    step.detach()
    step2, opt2 = _step(model)
    loader2 = step2.poisson_loader(DataLoader(_data(64), batch_size=8))
    step2.load_state_dict(state)
    _verify(step2, model)
    second = _train(step2, model, opt2, loader2)
    assert [index for index, _, _ in first + second] == list(range(len(first) + len(second)))
    assert step2.ledger.steps == _rounds(step2) == len(first) + len(second)
    assert {e.sample_rate for e in step2.ledger.entries} == {0.125}
