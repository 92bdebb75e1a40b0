"""A plain PyTorch loop's contract with PrivateStep (lightning_dp/validators/plain_loop.py): each release is of a batch
the Poisson loader drew and handed the loop, once; physical batches are disjoint parts of it; the loss released is
the one verified; no rate is set from the un-noised loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep


def _plain(n: int = 64, batch_size: int = 16, model: nn.Module | None = None, **kwargs):
    """(step, model, optimizer, loader, dataset), attached and verified on the cross-entropy of the model's output."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0, **kwargs)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(data, batch_size=batch_size))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    return step, model, opt, loader, data


def _nonempty(loader):
    return next(batch for batch in loader if len(batch[0]))


@pytest.fixture
def plain():
    made = []

    def make(**kwargs):
        made.append(_plain(**kwargs))
        return made[-1]

    yield make
    for step, *_ in made:
        step.detach()


# ------------------------------------------------------------------ each release a batch the loader drew, once
def test_the_documented_loop_trains_an_epoch(plain):
    """Positive control: begin() (and begin(len(x))) once per batch the loader yields, empty batches included."""
    step, model, opt, loader, _ = plain()
    for i, (x, y) in enumerate(loader):
        if (step.begin() if i % 2 else step.begin(len(x))):
            F.cross_entropy(model(x), y).backward()
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch


def test_one_drawn_batch_released_twice_is_refused(plain):
    step, model, opt, loader, _ = plain()
    x, y = _nonempty(loader)
    step.begin(len(x))
    F.cross_entropy(model(x), y).backward()
    step.release(optimizer=opt)
    opt.step()
    with pytest.raises(PrivacyConfigurationError, match="no batch the Poisson loader handed to the loop"):
        step.begin(len(x))
    with pytest.raises(PrivacyConfigurationError, match="second release of one batch"):
        step.release(optimizer=opt)
    assert step.ledger.steps == 1


def test_batches_of_a_loader_of_ones_own_are_refused(plain):
    step, model, opt, _, data = plain()
    x, y = next(iter(DataLoader(data, batch_size=64, shuffle=True)))
    with pytest.raises(PrivacyConfigurationError, match="no batch the Poisson loader handed to the loop"):
        step.begin(len(x))
    assert step.ledger.steps == 0


def test_a_release_without_begin_is_refused(plain):
    step, model, opt, loader, _ = plain()
    x, y = _nonempty(loader)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyConfigurationError, match="without a Poisson batch drawn for it"):
        step.release(optimizer=opt)
    assert step.ledger.steps == 0


def test_a_count_other_than_the_drawn_batch_is_refused(plain):
    step, model, opt, loader, _ = plain()
    x, y = _nonempty(loader)
    with pytest.raises(PrivacyConfigurationError, match=f"the Poisson batch drawn for this step holds {len(x)}"):
        step.begin(len(x) + 1)


# ------------------------------------------------------------------ physical batches: disjoint parts of the draw
def _part(step, model, indices):
    x, y = step.examples(indices)
    step.begin(len(indices), indices)
    F.cross_entropy(model(x), y).backward()


def test_disjoint_physical_batches_covering_the_draw_train(plain):
    step, model, opt, loader, _ = plain()
    _nonempty(loader)
    drawn = step.take()
    half = len(drawn) // 2
    _part(step, model, drawn[:half])
    step.bank()
    _part(step, model, drawn[half:])
    step.release(optimizer=opt)
    assert step.ledger.steps == 1


def test_a_record_in_two_banked_physical_batches_is_refused(plain):
    step, model, opt, loader, _ = plain()
    _nonempty(loader)
    drawn = step.take()
    _part(step, model, drawn[:2])
    step.bank()
    with pytest.raises(PrivacyConfigurationError, match="begun already in another physical batch"):
        step.begin(2, drawn[1:3])
    with pytest.raises(PrivacyConfigurationError, match="without the records of a physical batch"):
        step.begin(2)
    assert step.ledger.steps == 0


def test_a_physical_batch_outside_the_draw_or_short_of_it_is_refused(plain):
    step, model, opt, loader, data = plain()
    _nonempty(loader)
    drawn = step.take()
    other = next(i for i in range(len(data)) if i not in drawn)
    with pytest.raises(PrivacyConfigurationError, match="does not hold"):
        step.begin(1, [other])
    _part(step, model, drawn[:1])
    with pytest.raises(PrivacyConfigurationError, match=f"hold 1 of the {len(drawn)} records drawn"):
        step.release(optimizer=opt)


# ------------------------------------------------------------------ the loss released is the loss verified
@pytest.mark.parametrize("loss_name", ["centred", "in_batch_term"])
def test_a_loop_loss_other_than_the_verified_one_is_refused(plain, loss_name):
    step, model, opt, loader, _ = plain(verify="every_step")

    def loss(x, y):
        if loss_name == "centred":
            return F.cross_entropy(model(x - x.mean(0, keepdim=True)), y)
        out = model(x)
        z = F.normalize(out, dim=1)
        return F.cross_entropy(out, y) + 0.1 * F.cross_entropy(z @ z.t() / 0.5, torch.arange(len(x)))

    x, y = _nonempty(loader)
    step.begin()
    loss(x, y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match="not the loss function given to verify"):
        step.release(optimizer=opt)
    assert step.ledger.steps == 0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_loss_scaled_before_its_backward_is_refused_naming_the_scaler(plain):
    """torch.amp.GradScaler's habit, scaler.scale(loss).backward(): the refusal says what the scaling does to the
    clipping and what to write instead, and quotes no norm (the batch's); another loss is refused without that
    advice."""
    step, model, opt, loader, _ = plain(verify="every_step")
    x, y = _nonempty(loader)
    step.begin()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)multiplied by a constant.*GradScaler.*bfloat16") as e:
        step.release(optimizer=opt)
    assert not any(ch.isdigit() for ch in str(e.value).replace("16-mixed", "").replace("bfloat16", "")), str(e.value)
    assert step.ledger.steps == 0
    step, model, opt, loader, _ = plain(verify="every_step")
    x, y = _nonempty(loader)
    step.begin()
    F.cross_entropy(model(x - x.mean(0, keepdim=True)), y).backward()
    with pytest.raises(PrivacyConfigurationError, match="not the loss function given to verify") as e:
        step.release(optimizer=opt)
    assert "GradScaler" not in str(e.value) and not any(ch.isdigit() for ch in str(e.value)), str(e.value)


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


def test_the_verified_loss_with_dropout_trains_every_step(plain):
    """Positive control: the check runs from the generators' state at begin(), so dropout masks match."""
    step, model, opt, loader, _ = plain(model=_Dropped(), verify="every_step")
    for x, y in loader:
        if step.begin():
            F.cross_entropy(model(x), y).backward()
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch


# ------------------------------------------------------------------ decisions from the un-noised loss
def _steps(step, model, opt, loader, after_update, before_update=lambda loss: None, count=4):
    for i, (x, y) in zip(range(count), loader):
        loss = None
        if step.begin():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        step.release(optimizer=opt)
        before_update(loss)
        opt.step()
        opt.zero_grad()
        after_update(i, loss)


def test_a_rate_set_from_the_loss_after_the_update_is_refused_at_the_next_begin(plain):
    step, model, opt, loader, _ = plain()

    def rate_from_loss(i, loss):
        for group in opt.param_groups:
            group["lr"] = 0.1 * float(loss if loss is not None else 1.0)

    with pytest.raises(PrivacyConfigurationError, match=r"param_groups\[0\]\.lr.*after the loop read"):
        _steps(step, model, opt, loader, rate_from_loss)
    assert step.ledger.steps == 1


def test_a_rate_set_from_the_loss_before_the_update_is_refused_at_the_update(plain):
    step, model, opt, loader, _ = plain()

    def rate_from_loss(loss):
        opt.param_groups[0]["lr"] = 0.1 / (1.0 + (loss.item() if loss is not None else 0.0))

    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match="between the release and optimizer.step"):
        _steps(step, model, opt, loader, lambda i, loss: None, before_update=rate_from_loss)
    assert all(torch.equal(b, p) for b, p in zip(weights, model.parameters())), "the update was not made"


def test_a_plateau_rule_on_the_training_loss_is_refused(plain):
    step, model, opt, loader, _ = plain()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)

    def told(i, loss):
        plateau.step(loss if loss is not None else torch.tensor(1.0))
        plateau.step(torch.tensor(9.0) + (loss.detach() if loss is not None else 0.0))

    with pytest.raises(PrivacyConfigurationError, match=r"param_groups\[0\]\.lr"):
        _steps(step, model, opt, loader, told)


def test_schedules_from_the_step_count_train(plain):
    """Positive controls: a rate set by hand without reading the loss; a scheduler while the loss is printed."""
    step, model, opt, loader, _ = plain()
    _steps(step, model, opt, loader, lambda i, loss: opt.param_groups[0].update(lr=0.1 * 0.5 ** i))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    printed = []

    def report_and_schedule(i, loss):
        printed.append(f"{loss:.3f}" if loss is not None else "-")
        scheduler.step()

    _steps(step, model, opt, loader, report_and_schedule)
    assert step.ledger.steps == 8 and len(printed) == 4


# ------------------------------------------------------------------ σ and C: set before training, not from the batch
def _train(step, model, opt, loader, between=lambda step, losses, epoch: None, epochs: int = 1):
    for epoch in range(epochs):
        for x, y in loader:
            losses = torch.zeros(1)
            if step.begin():
                losses = F.cross_entropy(model(x), y, reduction="none")
                losses.mean().backward()
            step.release(optimizer=opt)
            opt.step()
            opt.zero_grad()
            between(step, losses.detach(), epoch)


def test_a_clipping_bound_set_from_the_batch_losses_between_releases_is_refused(plain):
    """Hand-rolled 'adaptive' clipping: C from the median per-example loss (a vector the loop never back-propagates)."""
    step, model, opt, loader, _ = plain()

    def clip_from_loss(step, losses, epoch):
        step.max_grad_norm = max(0.1, float(losses.median()))

    with pytest.raises(PrivacyConfigurationError, match=r"σ or C changed between the last release.*privacy clipping"):
        _train(step, model, opt, loader, clip_from_loss)
    assert step.ledger.steps == 1  # the next release was not made


def test_a_noise_multiplier_lowered_once_the_loss_is_low_is_refused(plain):
    step, model, opt, loader, _ = plain()

    def anneal(step, losses, epoch):
        if float(losses.mean()) < 10:
            step.noise_multiplier = 0.5

    with pytest.raises(PrivacyConfigurationError, match=r"privacy noise_multiplier"):
        _train(step, model, opt, loader, anneal)


def test_a_noise_schedule_declared_public_trains_and_is_charged(plain):
    """Positive control: σ from the epoch number, declared (public_state=['noise_multiplier'])."""
    step, model, opt, loader, _ = plain(public_state=["noise_multiplier"])

    def by_epoch(step, losses, epoch):
        step.noise_multiplier = 1.0 + epoch + 1

    _train(step, model, opt, loader, by_epoch, epochs=2)
    assert {e.noise_multiplier for e in step.ledger.entries} >= {1.0, 2.0}
