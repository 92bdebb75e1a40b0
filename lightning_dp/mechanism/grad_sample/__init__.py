"""Per-example gradient engines behind one interface (see :mod:`.base`)."""

from lightning_dp.mechanism.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    available_engines,
    clip_and_sum_materialised,
    clip_factors,
    make_engine,
    register_engine,
)
from lightning_dp.mechanism.grad_sample import opacus_hooks  # noqa: F401  (registers "opacus_hooks")

__all__ = [
    "ClippedBatch",
    "GradSampleEngine",
    "available_engines",
    "clip_and_sum_materialised",
    "clip_factors",
    "make_engine",
    "register_engine",
]
