"""Registry of DP-Adam / DP-AdaGrad variants by name (docs/algorithms.md §1–§5).

Adding a variant is one class and one :func:`register_variant` call; nothing
else in the package switches on variant names.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from lightning_dp.optim.bias_corrected import BiasCorrected
from lightning_dp.optim.independent_moments import IndependentMoments
from lightning_dp.optim.noiseless import Noiseless
from lightning_dp.optim.post_processing import PostProcessing
from lightning_dp.optim.preconditioner import Preconditioner
from lightning_dp.optim.scale_then_privatize import ScaleThenPrivatize

P = TypeVar("P", bound=type[Preconditioner])

_VARIANTS: dict[str, type[Preconditioner]] = {}


def register_variant(cls: P) -> P:
    """Register a :class:`Preconditioner` subclass under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty class attribute `name`.")
    _VARIANTS[cls.name] = cls
    return cls


for _cls in (PostProcessing, BiasCorrected, IndependentMoments, ScaleThenPrivatize, Noiseless):
    register_variant(_cls)


def variant_names() -> list[str]:
    """Names accepted by ``DPAdam(variant=...)``, ``DPAdagrad`` and ``AdamVariant``."""
    return sorted(_VARIANTS)


def variant_class(name: str, base: str | None = None) -> type[Preconditioner]:
    """The class registered as ``name``; ValueError for an unknown name or unsupported ``base``."""
    if name not in _VARIANTS:
        raise ValueError(f"unknown DP optimizer variant {name!r}; choose one of {variant_names()}.")
    cls = _VARIANTS[name]
    if base is not None and base not in cls.bases:
        raise ValueError(f"variant {name!r} has no {base} form; it supports {sorted(cls.bases)}.")
    return cls


def check_hparams(name: str, hparams: dict[str, Any], base: str | None = None) -> None:
    """Validate hyperparameter *names* for ``name`` without building the variant."""
    cls = variant_class(name, base)
    accepted = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ValueError(f"variant {name!r} got unknown hyperparameter(s) {unknown}; it accepts {accepted or 'none'}.")


def make_preconditioner(name: str, base: str | None = None, **hparams: Any) -> Preconditioner:
    """Build the variant ``name`` with its hyperparameters (validated)."""
    check_hparams(name, hparams, base)
    return variant_class(name, base)(**hparams)
