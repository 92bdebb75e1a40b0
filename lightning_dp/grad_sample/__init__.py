"""Per-example gradient engines behind one interface (see :mod:`.base`).

Registered engines: ``"opacus_hooks"`` (Opacus' per-layer rules, broadest coverage),
``"vmap"`` (torch.func per layer), ``"ghost"`` (ghost norms + book-keeping, no
per-example gradients materialised). :func:`select_engine` picks the fastest valid one.
"""

from lightning_dp.grad_sample import functorch_vmap, ghost, opacus_hooks  # noqa: F401  (registration)
from lightning_dp.grad_sample.auto import select_engine, unsupported_by_engine
from lightning_dp.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    available_engines,
    clip_and_sum_materialised,
    clip_factors,
    make_engine,
    merge_clipped,
    register_engine,
)
from lightning_dp.grad_sample.functorch_vmap import FunctorchVmapEngine
from lightning_dp.grad_sample.ghost import GhostEngine
from lightning_dp.grad_sample.opacus_hooks import OpacusHooksEngine

__all__ = [
    "ClippedBatch",
    "FunctorchVmapEngine",
    "GhostEngine",
    "GradSampleEngine",
    "OpacusHooksEngine",
    "available_engines",
    "clip_and_sum_materialised",
    "clip_factors",
    "make_engine",
    "merge_clipped",
    "register_engine",
    "select_engine",
    "unsupported_by_engine",
]
