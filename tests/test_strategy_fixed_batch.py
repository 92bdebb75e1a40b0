"""DPStrategy(fixed_batch_size=F) end to end (issue 38): every physical batch has F rows; the updates are those of
the Poisson batches themselves (nothing truncated, padding adds nothing); the ledger is unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer

from lightning_dp import DPStrategy, Users
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.clipping import AdaptiveClipping, AutomaticClipping, PerLayerClipping


class _Zero(GaussianNoise):
    def sample(self, like):
        return [torch.zeros_like(t) for t in like]


class _Shapes(TinyClassifier):
    """Records the rows of every batch its training_step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def training_step(self, batch, batch_idx):
        self.rows.append(batch[0].shape[0])
        return super().training_step(batch, batch_idx)


def _train(fixed, steps=6, batch_size=10, clipping=None, engine="auto"):
    torch.manual_seed(0)
    model = _Shapes()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=None if clipping else 0.2, clipping=clipping,
                          noise=_Zero(), sampler_seed=3, fixed_batch_size=fixed, public_state=["rows"],
                          per_sample=engine)
    quiet_trainer(strategy=strategy, max_steps=steps).fit(model, make_loader(n=60, batch_size=batch_size))
    return torch.cat([p.detach().flatten() for p in model.parameters()]), strategy, model


@pytest.mark.parametrize("fixed", [16, 7])
def test_fixed_shapes_give_the_poisson_updates(fixed):
    """F = 16 holds every batch (padding only); F = 7 splits the larger ones into padded physical batches."""
    poisson, reference, shaped = _train(None)
    padded, strategy, model = _train(fixed)
    torch.testing.assert_close(padded, poisson, rtol=1e-5, atol=1e-6)
    # 6 steps each: the padded fit continues the Poisson fit's 6 on the same records (the data's record composes
    # them, accounting/data_ledgers.py), then its own 6, accounted as the Poisson ones
    assert reference.ledger.steps == 6 and strategy.ledger.steps == 12
    assert strategy.sample_rate == reference.sample_rate  # the same Poisson sampling is accounted
    assert set(model.rows) == {fixed}  # every physical batch had exactly F rows (the checks' passes leave no trace)
    assert len(set(shaped.rows)) > 1  # (the Poisson batches themselves vary)
    overflow = sum(-(-n // fixed) - 1 for n in shaped.rows if n > fixed)
    assert len(model.rows) == 6 + overflow  # one physical batch per step (an empty one too), more only beyond F


def test_fixed_batch_size_and_max_physical_batch_size_are_exclusive():
    with pytest.raises(ValueError, match="fixed_batch_size or max_physical_batch_size"):
        DPStrategy(noise_multiplier=1.0, fixed_batch_size=8, max_physical_batch_size=4)
    with pytest.raises(ValueError, match="fixed_batch_size"):
        DPStrategy(noise_multiplier=1.0, fixed_batch_size=0)
    with pytest.raises(ValueError, match="augmentation_multiplicity"):
        DPStrategy(noise_multiplier=1.0, fixed_batch_size=8, augmentation_multiplicity=2)


_POLICIES = {
    "automatic": lambda: AutomaticClipping(0.2, gamma=0.01),
    "per_layer": lambda: PerLayerClipping(0.2),
    "adaptive": lambda: _seeded(AdaptiveClipping(initial_norm=0.2)),
}


def _seeded(policy):
    policy._generator.manual_seed(0)  # the count's noise, the same draws in both runs
    return policy


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
@pytest.mark.parametrize("policy", sorted(_POLICIES))
def test_clipping_policies_on_fixed_shapes_give_the_poisson_updates(policy, engine):
    """A clipping policy with fixed_batch_size: padding rows' factors are 0 under the policy too, so the updates
    (and the adaptive bound, which counts the examples' norms only) are those of the Poisson batches."""
    poisson, reference, _ = _train(None, clipping=_POLICIES[policy](), engine=engine)
    padded, strategy, model = _train(7, clipping=_POLICIES[policy](), engine=engine)
    torch.testing.assert_close(padded, poisson, rtol=1e-5, atol=1e-6)
    assert set(model.rows) == {7}
    assert strategy.max_grad_norm == pytest.approx(reference.max_grad_norm, rel=1e-6)  # adaptive: the same C


def test_fixed_batch_size_and_users_are_refused_together():
    with pytest.raises(ValueError, match="fixed_batch_size.*privacy_unit=Users"):
        DPStrategy(noise_multiplier=1.0, fixed_batch_size=8, privacy_unit=Users(list(range(60)), users_per_batch=4))
