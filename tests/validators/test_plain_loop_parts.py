"""A plain loop's parts of a step (lightning_dp/validators/plain_loop.py): σ and C as the step began, a stand-in never
banked, a user's records in one physical batch, and no attribute of the step that switches a check off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.clipping import AdaptiveClipping
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.units import Users
from lightning_dp.units.physical import user_chunks
from lightning_dp.validators.schedule import VerificationSchedule

torch.set_num_threads(1)


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _centred(model, batch):
    x, y = batch
    return F.cross_entropy(model(x - x.mean(0, keepdim=True)), y)


def _plain(step: PrivateStep, loss=None, data=None, batch_size: int = 16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(data or _data(), batch_size=batch_size))
    step.verify((lambda batch: loss(model, batch)) if loss else (lambda b: F.cross_entropy(model(b[0]), b[1])))
    return model, opt, loader


@pytest.fixture
def made():
    steps: list[PrivateStep] = []
    yield steps
    for step in steps:
        step.detach()


def _step(made, **kwargs) -> PrivateStep:
    step = PrivateStep(kwargs.pop("sigma", 1.0), kwargs.pop("C", 1.0), GaussianNoise(seed=0), sampler_seed=0, **kwargs)
    made.append(step)
    return step


def _train(step, model, opt, loader, within=None, loss=None, steps: int = 6):
    for k, (x, y) in enumerate(loader):
        if k >= steps:
            break
        if step.begin():
            losses = F.cross_entropy(model(x), y, reduction="none") if loss is None else loss(model, (x, y))
            losses.mean().backward()
            if within is not None and k == 2:
                within(step, losses.detach())
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------ σ and C as the step began
def test_a_clipping_bound_set_from_the_batch_before_its_release_is_refused(made):
    step = _step(made)
    model, opt, loader = _plain(step)

    def clip_from_loss(step, losses):
        step.max_grad_norm = max(0.1, float(losses.median()))

    with pytest.raises(PrivacyConfigurationError, match=r"changed within the step.*privacy clipping"):
        _train(step, model, opt, loader, clip_from_loss)
    assert {e.noise_multiplier for e in step.ledger.entries} == {1.0} and step.last_release.max_grad_norm == 1.0


@pytest.mark.parametrize("public", [(), ("noise_multiplier",)])
def test_a_noise_multiplier_lowered_from_the_batch_before_its_release_is_refused(made, public):
    step = _step(made, public_state=list(public))
    model, opt, loader = _plain(step)

    def anneal(step, losses):
        step.noise_multiplier = 0.5 if float(losses.mean()) < 10 else 1.0

    with pytest.raises(PrivacyConfigurationError, match=r"changed within the step.*privacy noise_multiplier"):
        _train(step, model, opt, loader, anneal)
    assert all(e.noise_multiplier == 1.0 for e in step.ledger.entries)


def test_a_clipping_policy_moved_by_hand_before_its_release_is_refused(made):
    step = _step(made, C=None, clipping=AdaptiveClipping(initial_norm=1.0))
    model, opt, loader = _plain(step)

    def move(step, losses):
        step.clipping._bound = float(losses.median())

    with pytest.raises(PrivacyConfigurationError, match=r"changed within the step.*privacy clipping state"):
        _train(step, model, opt, loader, move)


def test_an_adaptive_policy_and_a_declared_schedule_between_steps_train(made):
    step = _step(made, C=None, clipping=AdaptiveClipping(initial_norm=1.0), public_state=["noise_multiplier"])
    model, opt, loader = _plain(step)
    for k, (x, y) in enumerate(loader):
        if step.begin():
            F.cross_entropy(model(x), y).backward()
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
        step.noise_multiplier = 1.0 + 0.1 * (k + 1)  # from the step count, between a release and the next begin
    assert step.ledger.steps == step.plan.steps_per_epoch


# ------------------------------------------------------------------ examples alone: derived and verified
def test_examples_alone_cannot_be_set_by_the_loop(made):
    step = _step(made)
    with pytest.raises(AttributeError):
        step.examples_alone = True  # type: ignore[misc]
    assert not step.examples_alone


def _alone_step(made) -> PrivateStep:
    step = PrivateStep.from_config(
        PrivacyConfig(noise_multiplier=1.0, max_grad_norm=0.01, sampler_seed=0),
        ExecutionConfig(max_physical_batch_size=1))
    made.append(step)
    return step


def test_examples_alone_configured_and_a_batch_centred_loop_is_refused(made):
    """max_physical_batch_size=1 skips the interaction checks: a loop running whole batches of a centred loss (examples
    interact) is refused at its first begin()."""
    step = _alone_step(made)
    assert step.examples_alone
    model, opt, loader = _plain(step, loss=_centred)
    with pytest.raises(PrivacyConfigurationError, match="configured for examples alone"):
        _train(step, model, opt, loader, loss=_centred)
    assert step.ledger.steps == 0


def test_examples_alone_one_at_a_time_trains(made):
    step = _alone_step(made)
    model, opt, loader = _plain(step)
    for k, _ in enumerate(loader):
        if k == 4:
            break
        drawn = step.take()
        for i in drawn:
            x, y = step.examples([i])
            step.begin(1, [i])
            F.cross_entropy(model(x), y).backward()
            if i != drawn[-1]:
                step.bank()
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == 4


# ------------------------------------------------------------------ a stand-in never enters a release
def test_a_banked_stand_in_is_refused(made):
    step = _step(made, sigma=1e-9, C=0.01)
    model, opt, loader = _plain(step)
    x, y = next(b for b in loader if len(b[0]) > 1)
    drawn = step.take()
    step.begin(len(drawn), stand_in=True)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyConfigurationError, match="stand-in batch .* was banked"):
        step.bank()
    assert step.ledger.steps == 0


def test_a_discarded_stand_in_then_the_drawn_batch_trains(made):
    step = _step(made)
    model, opt, loader = _plain(step)
    x, y = next(b for b in loader if len(b[0]) > 1)
    step.take()
    step.begin(1, stand_in=True)
    F.cross_entropy(model(x[:1]), y[:1]).backward()
    step.discard()
    opt.zero_grad()
    step.begin(len(x), step.loop.indices)
    F.cross_entropy(model(x), y).backward()
    step.release(optimizer=opt)
    assert step.ledger.steps == 1


# ------------------------------------------------------------------ user-level DP: a user in one physical batch
def _users_step(made):
    uids = [i // 4 for i in range(64)]
    step = _step(made, C=0.01, privacy_unit=Users(uids, users_per_batch=4, max_examples_per_user=4))
    model, opt, loader = _plain(step, batch_size=8)
    return step, model, opt, loader


def _part(step, model, indices, bank):
    x, y = step.examples(indices)
    step.begin(len(indices), indices)
    F.cross_entropy(model(x), y).backward()
    if bank:
        step.bank()


def test_a_user_split_over_two_banked_parts_is_refused_every_time(made):
    step, model, opt, loader = _users_step(made)
    for _ in loader:
        drawn = step.take()
        groups = step.groups_of(drawn)
        if len(drawn) > 1 and bool((groups[0::2].unsqueeze(1) == groups[1::2].unsqueeze(0)).any()):
            break
        if drawn:
            _part(step, model, drawn, bank=False)
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    released = step.ledger.steps
    _part(step, model, drawn[0::2], bank=True)
    with pytest.raises(PrivacyConfigurationError, match="records in another physical batch of the same step"):
        _part(step, model, drawn[1::2], bank=False)
    assert step.ledger.steps == released


def test_users_kept_whole_by_user_chunks_train(made):
    step, model, opt, loader = _users_step(made)
    for _ in loader:
        drawn = step.take()
        chunks = user_chunks(drawn, step.groups_of(drawn), 3) if drawn else []
        for j, chunk in enumerate(chunks):
            _part(step, model, chunk, bank=j < len(chunks) - 1)
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch


# ------------------------------------------------------------------ no attribute switches a check off
def test_the_loop_and_schedule_cannot_be_weakened_by_an_attribute(made):
    step = _step(made, verify="every_step")
    _plain(step)
    with pytest.raises(AttributeError):
        step.loop.plain = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        step.loop.loss_of = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        step.schedule.mode = "first_step"  # type: ignore[misc]
    with pytest.raises(PrivacyConfigurationError, match="checks less than"):
        step.schedule = VerificationSchedule("first_step")
    step.schedule = VerificationSchedule("every_step", 0.5)  # as strict: a test's own clock
    assert step.loop.plain and step.loop.loss_of is not None


# ------------------------------------------------------------------ a tensor outside the model trained on raw gradients
def test_a_loop_local_temperature_trained_on_the_raw_gradient_is_refused(made):
    step = _step(made)
    temperature = torch.ones(1, requires_grad=True)
    model, opt, loader = _plain(step, loss=lambda m, b: F.cross_entropy(m(b[0]) / temperature, b[1]))
    opt_t = torch.optim.SGD([temperature], lr=0.5)
    with pytest.raises(PrivacyConfigurationError, match="outside the model's released parameters"):
        for x, y in loader:
            if step.begin():
                F.cross_entropy(model(x) / temperature, y).backward()
            step.release(optimizer=opt)
            opt.step()
            opt_t.step()
            opt.zero_grad()
            opt_t.zero_grad()
    assert step.ledger.steps <= 2


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
def test_inputs_made_to_require_grad_each_step_train(made, engine):
    """Saliency of the inputs read from the loop's own backward: a fresh leaf each step, not state; every engine's own
    tensors are not flagged."""
    step = _step(made, engine=engine)
    model, opt, loader = _plain(step)
    for x, y in loader:
        if step.begin():
            x = x.clone().requires_grad_(True)
            F.cross_entropy(model(x), y).backward()
            assert x.grad is not None
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch
