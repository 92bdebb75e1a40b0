"""The clipping policies on their own (issue #39): factors, bounds, refusals, the adaptive update and its cost."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dp import AdaptiveClipping, AutomaticClipping, PerLayerClipping, PrivacyConfigurationError
from lightning_dp.clipping import FlatClipping
from lightning_dp.clipping.adaptive import raised_noise_multiplier
from lightning_dp.clipping.resolve import resolve_clipping


def test_every_policy_bounds_a_units_clipped_gradient_by_c():
    norms = torch.tensor([0.0, 1e-3, 0.5, 2.0, 1e3], dtype=torch.float64)
    for policy in (FlatClipping(0.7), AutomaticClipping(0.7, gamma=0.01), AdaptiveClipping(0.7)):
        assert bool(((policy.factors(norms) * norms) < 0.7).all())
    per_layer = PerLayerClipping(0.7)
    parts = torch.tensor([[3.0, 0.1], [4.0, 0.2], [0.0, 5.0]], dtype=torch.float64)  # [P = 3, u = 2]
    clipped = per_layer.parameter_factors(parts) * parts
    assert bool((clipped <= 0.7 / math.sqrt(3)).all())
    assert bool((clipped.pow(2).sum(0).sqrt() <= 0.7).all())


def test_automatic_factor_is_c_over_norm_plus_gamma():
    norms = torch.tensor([0.0, 1.0, 9.0], dtype=torch.float64)
    assert torch.allclose(AutomaticClipping(2.0, gamma=0.5).factors(norms), 2.0 / (norms + 0.5))


def test_per_layer_budgets_must_give_c_and_name_every_parameter():
    with pytest.raises(PrivacyConfigurationError, match="not max_grad_norm = 1"):
        PerLayerClipping(1.0, budgets={"a": 0.5, "b": 0.5})
    policy = PerLayerClipping(budgets={"a": 0.6, "b": 0.8})
    assert policy.max_grad_norm == pytest.approx(1.0)
    with pytest.raises(PrivacyConfigurationError, match="no budget for c"):
        policy.bind(["a", "b", "c"])
    with pytest.raises(PrivacyConfigurationError, match="not trainable: b"):
        policy.bind(["a"])
    policy.bind(["b", "a"])
    assert policy.budget_vector(2, torch.zeros(1)).tolist() == pytest.approx([0.8, 0.6])
    assert policy.at_bound(2.0).budget_vector(2, torch.zeros(1)).tolist() == pytest.approx([1.6, 1.2])


def test_max_grad_norm_and_a_policy_must_agree():
    assert resolve_clipping(None, None).max_grad_norm == 1.0
    assert resolve_clipping(0.3, None).max_grad_norm == 0.3
    assert resolve_clipping(2.0, AutomaticClipping(2.0)).max_grad_norm == 2.0
    assert resolve_clipping(5.0, AdaptiveClipping(initial_norm=5.0)).max_grad_norm == 5.0
    for policy in (AutomaticClipping(2.0), PerLayerClipping(2.0), AdaptiveClipping(initial_norm=2.0)):
        with pytest.raises(PrivacyConfigurationError, match="disagree on the clipping norm C"):
            resolve_clipping(1.0, policy)


def test_the_count_noise_raises_the_gradient_noise_so_the_pair_is_one_gaussian_of_multiplier_z():
    """Andrew et al. 2021, Theorem 1: σ_Δ⁻² + (2σ_b)⁻² = z⁻²."""
    z, sb = 1.1, 3.2
    sd = raised_noise_multiplier(z, sb)
    assert sd > z and sd ** -2 + (2 * sb) ** -2 == pytest.approx(z ** -2)
    policy = AdaptiveClipping(1.0)
    assert policy.gradient_noise_multiplier(1.0, expected_units=64) == pytest.approx(raised_noise_multiplier(1.0, 3.2))
    assert policy.gradient_noise_multiplier(1.0, expected_units=8) == pytest.approx(1.0 / math.sqrt(0.75))  # σ_b = z
    with pytest.raises(PrivacyConfigurationError, match="count_noise_multiplier > 0.5"):
        AdaptiveClipping(1.0, count_noise_multiplier=0.5).gradient_noise_multiplier(1.0, 64)


def test_the_adaptive_bound_moves_geometrically_towards_the_quantile():
    policy = AdaptiveClipping(initial_norm=10.0, learning_rate=0.2, count_noise_multiplier=1e-9)
    norms = torch.full((100,), 1.0)
    policy.after_release(norms, expected_units=100, sigma=1.0)  # every unit unclipped: b̃ = 1
    assert policy.max_grad_norm == pytest.approx(10.0 * math.exp(-0.2 * 0.5))
    policy = AdaptiveClipping(initial_norm=0.1, learning_rate=0.2, count_noise_multiplier=1e-9)
    policy.after_release(norms, expected_units=100, sigma=1.0)  # every unit clipped: b̃ = 0
    assert policy.max_grad_norm == pytest.approx(0.1 * math.exp(0.2 * 0.5))
    assert policy.configured_bound == 0.1


def test_the_adaptive_bound_travels_in_the_state_and_a_different_policy_is_refused():
    policy = AdaptiveClipping(initial_norm=4.0)
    policy.after_release(torch.ones(10), 10, 1.0)
    resumed = AdaptiveClipping(initial_norm=4.0)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.max_grad_norm == policy.max_grad_norm != 4.0
    with pytest.raises(PrivacyConfigurationError, match="clipping=AdaptiveClipping"):
        FlatClipping(1.0).load_state_dict(policy.state_dict())


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="gamma"):
        AutomaticClipping(1.0, gamma=0.0)
    with pytest.raises(ValueError, match="target_quantile"):
        AdaptiveClipping(1.0, target_quantile=1.0)
    with pytest.raises(ValueError, match="initial_norm"):
        AdaptiveClipping(-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        PerLayerClipping()
