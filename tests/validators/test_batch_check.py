"""Interactions the first step's probe cannot see (validators/batch_check.py): each is refused before the release of
the step where it shows, by the check on the step's own sampled batch; independent examples are never refused."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, unchanged  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.batch_check import batch_tolerance  # noqa: E402


def run(model, data, batch_size=32, steps=2, **kwargs):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, **kwargs)
    quiet_trainer(strategy=strategy, max_steps=steps).fit(model, DataLoader(data, batch_size=batch_size))
    return strategy


def classes(n=128, seed=0, sorted_by_class=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    if sorted_by_class:
        order = torch.argsort(y, stable=True)
        x, y = x[order], y[order]
    return TensorDataset(x, y)


class HardExampleMining(Classifier):
    """The mean of the 8 largest per-example losses of the batch (OHEM): the probe's 6 examples are all kept."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        return losses.topk(min(8, len(losses))).values.mean()


class BatchClassWeights(Classifier):
    """Cross-entropy weighted by the inverse frequency of each class in the batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        counts = torch.bincount(y, minlength=2).clamp_min(1).to(x.dtype)
        return F.cross_entropy(self(x), y, weight=len(y) / (2 * counts))


class CovariancePenalty(Classifier):
    """A small penalty on the batch covariance of the hidden features (below the first probe's 1e-3 tolerance)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.net[0](x))
        ce = F.cross_entropy(self.net[2](h), y)
        centred = h - h.mean(0)
        return ce + 3e-5 * (centred.T @ centred / len(h)).pow(2).sum()


class NegativesAfterWarmup(Classifier):
    """From the third step on, an in-batch contrastive term (every other example is a negative)."""

    def warm(self) -> bool:
        return self.global_step >= 2

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = F.normalize(torch.tanh(self.net[0](x)), dim=1)
        loss = F.cross_entropy(self.net[2](torch.tanh(self.net[0](x))), y)
        if self.warm():
            logits = z @ z.T / 0.5
            loss = loss + F.cross_entropy(logits, torch.arange(len(x)))
        return loss


class NegativesAfterOwnCount(NegativesAfterWarmup):
    """The same, warmed up by a counter of its own (declared public): invisible to the first step's look ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls += 1  # the first step's replays leave it as it was

    def warm(self) -> bool:
        return self.calls >= 3


class MixUp(Classifier):
    """MixUp inside training_step: each example mixed with a random other one of the batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        lam = float(torch.distributions.Beta(0.4, 0.4).sample())
        perm = torch.randperm(len(x))
        logits = self(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])


class NoisyInputs(Classifier):
    """Augmentation inside training_step that keeps examples apart (per-example Gaussian noise): served."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x + 0.1 * torch.randn_like(x)), y)


@pytest.mark.parametrize("factory,sorted_by_class", [(HardExampleMining, False), (BatchClassWeights, True),
                                                     (MixUp, False)])
def test_interactions_the_first_probe_misses_are_refused_before_any_release(factory, sorted_by_class):
    model = factory()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0.*sampled batch"):
        run(model, classes(sorted_by_class=sorted_by_class))
    assert unchanged(before, model), "a release happened"


@pytest.mark.parametrize("batch_check", [True, False])
def test_a_coupling_below_the_old_fixed_tolerance_is_refused_before_any_release(batch_check):
    """A batch-covariance penalty moving each example's gradient by ~1e-4 of its norm passed the first probe's fixed
    1e-3 (float32). Both comparisons now take 64 ulps of the precision the forward computes in: the first probe alone
    refuses it (the batch check off), and so does the whole first step."""
    from lightning_dp.privacy.private_step import PrivateStep

    model = CovariancePenalty()
    before = parameters(model)
    original = PrivateStep.check_batch
    if not batch_check:
        PrivateStep.check_batch = lambda self, *args, **kwargs: None
    try:
        with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
            run(model, classes())
    finally:
        PrivateStep.check_batch = original
    assert unchanged(before, model), "a release happened"


def test_an_interaction_keyed_on_the_step_is_refused_before_any_release():
    """The first step's checks also run as the module would at later steps of the plan (global_step, current_epoch)."""
    model = NegativesAfterWarmup()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0 \(as the model runs at step"):
        run(model, classes(), steps=6)
    assert unchanged(before, model), "a release happened"


class CentresLaterInTheEpoch(Classifier):
    """Centres the batch on its own mean from the third batch of every epoch (``batch_idx >= 2``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx >= 2:
            x = x - x.mean(0, keepdim=True)
        return torch.nn.functional.cross_entropy(self(x), y)


def test_an_interaction_keyed_on_the_batch_index_is_refused_before_any_release():
    """The checks as of a later step run with an epoch's last ``batch_idx`` (4 batches an epoch, 6 steps: the plan's
    last step is an epoch's second batch, which ``step % steps_per_epoch`` would have checked)."""
    model = CentresLaterInTheEpoch()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0 \(as the model runs at step 5"):
        run(model, classes(), steps=6)
    assert unchanged(before, model), "a release happened"


class CentresEveryFifthBatch(Classifier):
    """Centres the batch on its own mean when ``batch_idx % 5 == 2`` only (behaviour that comes and goes)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx % 5 == 2:
            x = x - x.mean(0, keepdim=True)
        return torch.nn.functional.cross_entropy(self(x), y)


def test_an_interaction_on_every_fifth_batch_is_refused_before_any_release():
    """The first step runs training_step once as of each of the next eight steps: where its loss differs (batch 2),
    the batch check runs as of that step."""
    model = CentresEveryFifthBatch()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0 \(.*batch_idx 2\)"):
        run(model, classes(n=1024), steps=40, verify="first_step")
    assert unchanged(before, model), "a release happened"


class CentresFromItsOwnEpochTwo(Classifier):
    """Counts epochs itself (declared public) and centres the batch from its third epoch on."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs_done = 0

    def on_train_epoch_end(self) -> None:
        self.epochs_done += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.epochs_done >= 2:
            x = x - x.mean(0, keepdim=True)
        return torch.nn.functional.cross_entropy(self(x), y)


class CentresAfterValidation(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.validated = False

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

    def on_validation_epoch_end(self) -> None:
        self.validated = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.validated:
            x = x - x.mean(0, keepdim=True)
        return torch.nn.functional.cross_entropy(self(x), y)


def test_an_interaction_switched_on_at_an_epoch_or_after_a_validation_is_refused_at_the_first_step_it_runs():
    """An epoch's first step and the first step after a validation are always checked (``"sampled"``), with a budget
    too small for a random check to land there."""
    model = CentresFromItsOwnEpochTwo()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, verify_budget=1e-6,
                          public_state=["epochs_done"])
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 8"):
        quiet_trainer(strategy=strategy, max_steps=40).fit(model, DataLoader(classes(), batch_size=32))
    assert strategy.ledger.steps == 8
    model = CentresAfterValidation()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, verify_budget=1e-6)
    trainer = quiet_trainer(strategy=strategy, max_steps=40, val_check_interval=2, num_sanity_val_steps=0)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 2"):
        trainer.fit(model, DataLoader(classes(seed=1), batch_size=32), DataLoader(classes(32, seed=5), batch_size=16))
    assert strategy.ledger.steps == 2


class _Ticks:
    """A clock that advances one second per reading: every step lasts a second, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("verify,steps", [("every_step", 12), ("sampled", 40)])
def test_an_interaction_that_starts_after_a_warmup_is_refused_before_its_release(verify, steps):
    """Under "sampled" the later checks land at random steps: with a step of one tick and a budget of half the
    time, the schedule checks most steps, and the first checked step after the warm-up is refused."""
    import random as rand

    from lightning_dp.validators.schedule import VerificationSchedule

    model = NegativesAfterOwnCount()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, verify=verify,
                          public_state=["calls"])
    strategy.private_step.schedule = VerificationSchedule(verify, 0.5, rng=rand.Random(0), clock=_Ticks())
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step (\d+)") as info:
        quiet_trainer(strategy=strategy, max_steps=steps).fit(model, DataLoader(classes(), batch_size=32))
    step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    assert step >= 3 and model.trainer.strategy.ledger.steps == step, "every step before it released, none after"
    if verify == "every_step":
        assert step == 3


def test_an_interaction_after_a_warmup_is_met_in_a_short_run_on_the_default_schedule():
    """The default schedule (sampled, 2 % of the time, the OS clock) in a run too short for the budget to buy a
    check: one random step of each doubling window is checked, so an interaction from step 3 on is met by step 12."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, public_state=["calls"])
    model = NegativesAfterOwnCount()
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step (\d+)") as info:
        quiet_trainer(strategy=strategy, max_steps=30).fit(model, DataLoader(classes(), batch_size=32))
    assert 3 <= int(re.search(r"at step (\d+)", str(info.value)).group(1)) < 12


class RaisesAtStep(Classifier):
    """A NaN guard of the user's own: raises in training_step at a step of its choosing."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise FloatingPointError("loss is NaN")
        return super().training_step(batch, batch_idx)


def test_a_step_that_raises_at_a_checked_later_step_raises_its_own_error():
    """The batch check's passes run the user's step first: at a later step, its own exception is what the fit
    raises (as the step itself would), not a refusal that blames the probe; nothing of that step is released."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, verify="every_step")
    with pytest.raises(FloatingPointError, match="loss is NaN"):
        quiet_trainer(strategy=strategy, max_steps=5).fit(RaisesAtStep(), DataLoader(classes(), batch_size=32))
    assert strategy.ledger.steps == 2


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
@pytest.mark.parametrize("factory", [Classifier, NoisyInputs])
def test_independent_examples_pass_every_step(factory, engine):
    strategy = run(factory(), classes(), steps=12, verify="every_step", per_sample=engine)
    assert strategy.ledger.steps == 12 and strategy.private_step.schedule.checks == 12


def test_the_checks_leave_the_random_stream_as_it_was():
    """Training with a check every step draws the same dropout masks and noise-free updates as with none."""
    def trained(verify):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        module = Classifier()
        module.net = model
        from lightning_dp.privacy.noise import NoiseMechanism

        class Zero(NoiseMechanism):
            def sample(self, like):
                return [torch.zeros_like(t) for t in like]

        run(module, classes(), steps=5, verify=verify, noise=Zero())
        return [p.detach().clone() for p in module.parameters()]

    for a, b in zip(trained("first_step"), trained("every_step")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_tolerance_follows_the_compute_precision():
    cpu = torch.device("cpu")
    assert batch_tolerance(torch.float32, cpu) == pytest.approx(64 * 2.0 ** -23)
    assert batch_tolerance(torch.float64, cpu) == pytest.approx(64 * 2.0 ** -52)
    assert batch_tolerance(torch.float32, cpu, low_precision=True) == 3e-2
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert batch_tolerance(torch.float32, cpu) == pytest.approx(64 * 2.0 ** -10)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_examples_alone_are_structurally_interaction_free():
    """max_physical_batch_size=1: every example differentiated in its own forward and backward. A loss that mixes
    the batch (here the hard-example mining above) cannot mix anything: the update equals the per-example loop's, and
    neither the probe nor the batch check refuses it."""
    import copy

    sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))
    import zoo

    class Mining(zoo.Base):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(zoo.D, 8), nn.Tanh(), nn.Linear(8, 3))

        def loss(self, batch):
            x, y = batch
            losses = F.cross_entropy(self.net(x), y, reduction="none")
            return losses.topk(min(2, len(losses))).values.mean()

    strategy = zoo.assert_exact(Mining, zoo.vector_data(), physical=1)
    assert strategy.private_step.schedule.checks == 0
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        zoo.private_step(copy.deepcopy(Mining()).double(), zoo._as_double(zoo.vector_data()))


class StandardisedAboveASize(Classifier):
    """Features standardised with the batch's own statistics only when the batch holds more than 128 examples (the
    compared examples are at most 128): the check also passes them among others at the step's own size."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if len(x) > 128:
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("physical", [None, 200])
def test_an_interaction_above_the_compared_size_is_refused_before_any_release(physical):
    model = StandardisedAboveASize()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0"):
        run(model, classes(600), batch_size=300, max_physical_batch_size=physical)
    assert unchanged(before, model), "a release happened"


def test_physical_batches_below_the_gated_size_train():
    """Physical batches of 100 never reach the gate: the step the model runs is independent, and trains."""
    strategy = run(StandardisedAboveASize(), classes(600), batch_size=300, max_physical_batch_size=100)
    assert strategy.ledger.steps == 2


class RoundedBySize(Classifier):
    """Independent examples whose float32 logits round by how many share the batch, as a kernel's blocking does:
    (z + c) − c with c = 32·B (B > 6: past the first probe's examples) moves z by up to half an ulp of c, about 240
    float32 ulps of the largest gradient norm between the batch, its halves and one example alone (measured); float64
    rounds it 2^-29 as much. ``mixed``: each example's input also takes that share of the batch's sum
    (x_i + mixed·Σ_j x_j), a true interaction of the rounding's size (1e-5: about 300 ulps, measured)."""

    def __init__(self, mixed: float = 0.0) -> None:
        super().__init__()
        self.mixed = mixed

    def training_step(self, batch, batch_idx):
        x, y = batch
        if len(x) <= 6:
            return F.cross_entropy(self(x), y)
        x = x + self.mixed * x.sum(0)
        c = 32.0 * len(x)
        return F.cross_entropy((self(x) + c) - c, y)


def test_a_near_miss_of_float32_rounding_is_rejudged_in_float64_and_trains():
    """The batch check's float32 comparison misses τ (64 ulps) by a little on independent examples (measured without
    the re-judge: refused, "Examples interact at step 0"); computed again in float64 the examples do not interact."""
    strategy = run(RoundedBySize(), classes(), steps=2, verify="every_step")
    assert strategy.ledger.steps == 2


@pytest.mark.parametrize("double", [False, True])
def test_a_true_interaction_as_small_as_rounding_is_still_refused(double):
    """1e-5 of the batch's summed input (the size of the rounding above, hundreds of ulps): refused in float32, where
    the re-judge in float64 still sees it, and in a float64 model, at float64's τ."""
    model = RoundedBySize(mixed=1e-5)
    data = classes()
    if double:
        model = model.double()
        data = TensorDataset(data.tensors[0].double(), data.tensors[1])
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0"):
        run(model, data, steps=2)
    assert unchanged(before, model), "a release happened"
