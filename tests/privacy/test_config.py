"""The frozen privacy configuration (lightning_dp/privacy/config.py): built once from the strategy's keyword
arguments, handed to the private step unchanged, never written."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from lightning_dp import DPStrategy
from lightning_dp.clipping import AutomaticClipping
from lightning_dp.errors import KnownSeedWarning
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig
from lightning_dp.privacy.csprng import SecureGaussianNoise
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep


def test_the_strategy_hands_its_settings_to_the_step_in_one_frozen_object():
    policy = AutomaticClipping(max_grad_norm=0.5)
    strategy = DPStrategy(target_epsilon=3.0, target_delta=1e-5, accountant="prv", clipping=policy,
                          per_sample="vmap", augmentation_multiplicity=2, public_state=["model.counter"],
                          verify="every_step")
    privacy, execution = strategy.privacy_config, strategy.execution_config
    assert privacy is strategy.private_step.config and execution is strategy.private_step.execution
    assert (privacy.target_epsilon, privacy.target_delta, privacy.accountant) == (3.0, 1e-5, "prv")
    assert privacy.clipping is policy and privacy.public_state == ("model.counter",)
    assert (execution.engine, execution.views_per_example, execution.verify) == ("vmap", 2, "every_step")
    step = strategy.private_step  # what the step reads comes from the configuration
    assert (step.target_epsilon, step.accountant, step.engine_name, step.views_per_example) == (3.0, "prv", "vmap", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        privacy.target_epsilon = 100.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        execution.engine = "ghost"  # type: ignore[misc]


def test_keyword_front_and_from_config_build_the_same_step():
    noise = GaussianNoise(seed=0)
    by_kwargs = PrivateStep(1.5, 0.7, noise, engine="ghost", sampler_seed=3, verify="first_step")
    by_config = PrivateStep.from_config(PrivacyConfig(noise_multiplier=1.5, max_grad_norm=0.7, noise=noise,
                                                      sampler_seed=3),
                                        ExecutionConfig(engine="ghost", verify="first_step"))
    assert by_kwargs.config == by_config.config and by_kwargs.execution == by_config.execution
    for step in (by_kwargs, by_config):
        assert (step.noise_multiplier, step.max_grad_norm, step.engine_name, step.sampler_seed) == (1.5, 0.7, "ghost", 3)
        assert step.noise is noise


@pytest.mark.parametrize("settings, kind", [
    ({"noise": "gaussian"}, GaussianNoise),
    ({"noise": "banded", "bands": 4}, BandedToeplitzNoise),
    ({"noise": "gaussian", "secure_mode": True}, SecureGaussianNoise),
])
def test_the_noise_is_named_by_the_configuration(settings, kind):
    mechanism = PrivacyConfig(noise_multiplier=1.0, **settings).noise_mechanism()
    assert type(mechanism) is kind
    assert getattr(mechanism, "bands", 1) == settings.get("bands", 1)


@pytest.mark.parametrize("privacy, match", [
    ({"noise_multiplier": 1.0, "noise": "laplace"}, "noise must be"),
    ({"noise_multiplier": 1.0, "bands": 3}, "needs noise='banded'"),
    ({"target_epsilon": -1.0, "target_delta": 1e-5}, "target_epsilon must be"),
    ({"target_epsilon": 2.0, "target_delta": 1.5}, "target_delta"),
])
def test_bad_privacy_settings_are_refused_when_the_configuration_is_built(privacy, match):
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(**privacy)


@pytest.mark.parametrize("execution, match", [
    ({"views_per_example": 0}, "views_per_example"),
    ({"max_physical_batch_size": 0}, "max_physical_batch_size"),
    ({"max_physical_batch_size": 8, "fixed_batch_size": 8}, "not both"),
])
def test_bad_execution_settings_are_refused_when_the_configuration_is_built(execution, match):
    with pytest.raises(ValueError, match=match):
        ExecutionConfig(**execution)


def test_the_strategy_still_asks_for_exactly_one_of_sigma_and_a_target():
    with pytest.raises(ValueError, match="exactly one"):
        DPStrategy(noise_multiplier=1.0, target_epsilon=3.0, target_delta=1e-5)
    with pytest.raises(ValueError, match="exactly one"):
        DPStrategy(noise_multiplier=None, max_grad_norm=1.0)


@pytest.mark.parametrize("build, said", [
    (lambda: DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0), ["sampler_seed"]),
    (lambda: DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, noise=GaussianNoise(seed=1)), ["re-draw z_t"]),
    (lambda: PrivateStep(1.0, 1.0, GaussianNoise(generator=torch.Generator().manual_seed(3))), ["re-draw z_t"]),
    (lambda: PrivateStep(1.0, 1.0, BandedToeplitzNoise(bands=2, seed=4), sampler_seed=5),
     ["re-draw z_t", "sampler_seed"]),
])
def test_a_seed_the_caller_chose_is_warned_as_known_to_whoever_knows_it(build, said):
    """zoo14 t7: a public noise seed (or generator) lets anyone subtract the noise, a public sampler seed removes
    the amplification by sampling: the reported ε holds only while the seed is secret, which the run says."""
    with pytest.warns(KnownSeedWarning) as caught:
        build()
    messages = [str(w.message) for w in caught if issubclass(w.category, KnownSeedWarning)]
    assert len(messages) == 1 and all(part in messages[0] for part in said)
    assert caught[0].filename == __file__  # points at the caller's line, not the library's


@pytest.mark.parametrize("build", [
    lambda: DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0),
    lambda: DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, noise="banded", bands=2),
    lambda: PrivateStep(1.0, 1.0, GaussianNoise()),
    lambda: PrivateStep(1.0, 1.0, SecureGaussianNoise()),
])
def test_os_seeded_sampling_and_noise_warn_nothing(build):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KnownSeedWarning)
        build()
