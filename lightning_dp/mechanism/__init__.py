"""The privacy mechanism in pure torch (no Lightning): sampling, per-example engines,
clipping, noise. Everything that touches raw per-example data lives here."""

from lightning_dp.mechanism.collate import EmptySafeCollate, batch_size_of
from lightning_dp.mechanism.grad_sample import (
    ClippedBatch,
    GradSampleEngine,
    available_engines,
    make_engine,
    register_engine,
)
from lightning_dp.mechanism.noise import GaussianNoise, NoiseMechanism
from lightning_dp.mechanism.privatizer import Privatizer, flat_all_reduce, validate_privacy_params
from lightning_dp.mechanism.release import DEFAULT_REQUEST, MechanismRequest, PrivateOptimizer, Release
from lightning_dp.mechanism.sampling import PoissonBatchSampler, secure_seed, steps_per_epoch_for
from lightning_dp.mechanism.validators import validate_module

__all__ = [
    "ClippedBatch",
    "DEFAULT_REQUEST",
    "EmptySafeCollate",
    "GaussianNoise",
    "GradSampleEngine",
    "MechanismRequest",
    "NoiseMechanism",
    "PoissonBatchSampler",
    "PrivateOptimizer",
    "Privatizer",
    "Release",
    "available_engines",
    "batch_size_of",
    "flat_all_reduce",
    "make_engine",
    "register_engine",
    "secure_seed",
    "steps_per_epoch_for",
    "validate_module",
    "validate_privacy_params",
]
