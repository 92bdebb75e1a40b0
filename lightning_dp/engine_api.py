"""The one interface between the privacy core and the per-example gradient engines.

An engine turns one forward + backward of a *mean* loss into the per-example clipped
statistics the mechanism needs (docs/algorithms.md, "The mechanism"):

    S   = Σ_i clip_C(s ⊙ g_i)          (always)
    S2  = Σ_i clip_C(s ⊙ g_i)²         (only when asked, for independent moments)
    ‖s ⊙ g_i‖ for every example         (norms before clipping; diagnostics)

How it gets there is the engine's own business (:mod:`lightning_dp.grad_sample`: materialise per-example
gradients with Opacus' hooks or ``torch.func.vmap``, or never materialise them: ghost clipping). The core sees
only what is defined here: the :class:`ClippedBatch` record, the :class:`GradSampleEngine` contract and the
registry by name (:func:`make_engine`, :func:`select_engine`). The built-in engines are found by module name and
imported on first use, so the core imports no engine machinery (docs/architecture.md, "The rooms").
"""

from __future__ import annotations

import importlib
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Mapping, Optional, Sequence, TypeVar, Union

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # annotations only (a policy is passed in, never built here)
    from lightning_dp.clipping.rule import ClipRule

ParamMap = Mapping[Tensor, Tensor]

_BUILTIN = {
    "ghost": "lightning_dp.grad_sample.ghost",
    "vmap": "lightning_dp.grad_sample.functorch_vmap",
    "opacus_hooks": "lightning_dp.grad_sample.opacus_hooks",
}
"""The built-in engines by name, and the module whose import registers each."""
_SELECTION = "lightning_dp.grad_sample.auto"
"""Where the engines' own rule for ``per_sample="auto"`` lives (:func:`select_engine`, :func:`engines_after`)."""


@dataclass
class ClippedBatch:
    """Per-example clipped statistics of one (local) batch.

    Attributes:
        sums: Σ_i clip_C(s ⊙ g_i) for every trainable parameter (zeros if the batch is empty).
        square_sums: Σ_i clip_C(s ⊙ g_i)² per parameter, or ``None`` if not requested.
        norms: per-example L2 norms of s ⊙ g_i over all trainable parameters, before clipping (per unit when the
            rule groups examples into units: the norm of the unit's mean gradient).
        batch_size: number of examples in the batch.
    """

    sums: dict[Tensor, Tensor]
    square_sums: Optional[dict[Tensor, Tensor]]
    norms: Tensor
    batch_size: int


class GradSampleEngine(ABC):
    """Computes clipped per-example statistics for the parameters of one module.

    Life cycle: :meth:`attach` once before training; per step :meth:`begin_step` with the
    number of examples the sampler put in the (physical) batch, then the module's forward and
    ``loss.backward()`` run as usual, then :meth:`clip_and_sum` is called exactly once and
    must leave no per-example state behind; :meth:`detach` at the end.

    The contract every engine keeps (issue "the mechanism checks its own assumptions"):
    after :meth:`begin_step` (n), every captured call's example dimension must equal n, or
    :meth:`clip_and_sum` raises :class:`~lightning_dp.errors.PrivacyConfigurationError`
    naming the layer, the shape seen and the fix; a step in which n > 0 examples were
    sampled but nothing was captured is an error, never a zero release.
    """

    name: ClassVar[str] = ""
    supports_views: ClassVar[bool] = False
    """Whether the engine can take K consecutive rows as one example (augmentation multiplicity)."""
    owned_attributes: ClassVar[frozenset[str]] = frozenset()
    """Attribute names the engine sets on the model's modules while it runs (the release boundary neither
    fingerprints nor restores them: :mod:`~lightning_dp.privacy.boundary`)."""
    supports_padding: ClassVar[bool] = False
    """Whether :meth:`clip_and_sum` honours :attr:`padding_rows` (fixed-shape batches)."""
    padding_rows: int = 0
    """Rows (examples) at the end of the current physical batch that are padding, not examples (fixed-shape batches,
    :mod:`~lightning_dp.performance.fixed_batch`): their clip factors are 0, so they add exactly nothing to the sums,
    and they are left out of the norms and the count. Set by the private step around :meth:`clip_and_sum` only."""
    views_per_example: int = 1
    """K: rows per example (each example's K augmented views, consecutive); set before :meth:`attach`.
    :meth:`begin_step` still counts examples; K > 1 needs :attr:`supports_views`."""

    @abstractmethod
    def attach(self, module: nn.Module) -> None:
        """Start capturing what this engine needs during forward/backward of ``module``."""

    @abstractmethod
    def detach(self) -> None:
        """Remove every hook and buffer the engine added."""

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Start a step of ``num_examples`` examples (``None``: unknown, not verified): drop
        anything captured before (e.g. by a ``validation_step`` that differentiated)."""

    @abstractmethod
    def clip_and_sum(
        self,
        params: Sequence[nn.Parameter],
        max_grad_norm: Union[float, ClipRule],
        scale: Optional[ParamMap] = None,
        with_squares: bool = False,
    ) -> ClippedBatch:
        """Clip each example's (scaled) gradient to ``max_grad_norm`` and sum.

        Args:
            params: the trainable parameters, in a fixed order.
            max_grad_norm: C (flat clipping of each example), or a
                :class:`~lightning_dp.clipping.rule.ClipRule`: a clipping policy and the examples' units.
            scale: optional per-coordinate scale s per parameter (scale-then-privatize).
            with_squares: also return Σ_i clip_C(s ⊙ g_i)².
        """

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Names and types of layers this engine cannot handle ('' list if none)."""
        return []


def sums_finite(batch: ClippedBatch, params: Sequence[nn.Parameter]) -> bool:
    """Whether every clipped sum is finite: the n norms first (every example's finite: so are the sums), the sums
    only when one is not (its factor is 0, but a contraction may still have met 0·inf)."""
    if bool(torch.isfinite(batch.norms).all()):
        return True
    sums = [batch.sums[p] for p in params]
    squares = [batch.square_sums[p] for p in params] if batch.square_sums is not None else []
    return all(bool(torch.isfinite(t).all()) for t in sums + squares)


E = TypeVar("E", bound=type[GradSampleEngine])
_ENGINES: dict[str, type[GradSampleEngine]] = {}


def register_engine(cls: E) -> E:
    """Class decorator: make an engine available as ``DPStrategy(per_sample=cls.name)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty `name`")
    _ENGINES[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for module in _BUILTIN.values():
        importlib.import_module(module)


def available_engines() -> list[str]:
    """Names of the registered engines (the built-in ones imported first)."""
    _load_builtins()
    return sorted(_ENGINES)


def make_engine(name: str) -> GradSampleEngine:
    """Instantiate the engine registered under ``name``."""
    if name not in _ENGINES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        return _ENGINES[name]()
    except KeyError:
        raise ValueError(f"Unknown per-sample engine {name!r}; available: {available_engines()}") from None


_RELEASED: dict[int, tuple["weakref.ref[Tensor]", int]] = {}
"""The ``p.grad`` tensors releases wrote, by identity: (a weak reference, the tensor's version then). Kept here, not
on the tensors (no state hidden on a tensor's attributes); an entry goes with its tensor."""


def mark_released(grad: Optional[Tensor]) -> int:
    """Record ``grad``, a ``p.grad`` the release just wrote (ĝ_t), with its version, and return that version (-1: no
    tensor). Until the tensor is changed or replaced it is that release, not a gradient of a later backward
    (:func:`is_release`)."""
    if grad is None:
        return -1
    key = id(grad)
    _RELEASED[key] = (weakref.ref(grad, lambda _, key=key: _RELEASED.pop(key, None)), grad._version)
    return grad._version


def is_release(grad: Optional[Tensor]) -> bool:
    """Whether ``grad`` is a release's ĝ as it was written (:func:`mark_released`): no backward accumulated into it
    since (autograd adds in place, a new version, or replaces the tensor) and nothing zeroed it. The ``.grad`` of a
    parameter in no optimizer group keeps the last release into the next step: no ``zero_grad`` reaches it."""
    entry = None if grad is None else _RELEASED.get(id(grad))
    return entry is not None and entry[0]() is grad and entry[1] == grad._version


def merge_clipped(first: ClippedBatch, second: ClippedBatch) -> ClippedBatch:
    """The statistics of two disjoint physical batches of one logical batch, combined."""
    sums = {p: first.sums[p] + second.sums[p] for p in first.sums}
    squares = None
    if first.square_sums is not None and second.square_sums is not None:
        squares = {p: first.square_sums[p] + second.square_sums[p] for p in first.square_sums}
    norms = torch.cat([first.norms, second.norms])
    return ClippedBatch(sums, squares, norms, first.batch_size + second.batch_size)


def select_engine(module: nn.Module, views_per_example: int = 1) -> str:
    """The engine ``per_sample="auto"`` uses for ``module``: the engines' own rule
    (:func:`lightning_dp.grad_sample.auto.select_engine`), reached by name."""
    return importlib.import_module(_SELECTION).select_engine(module, views_per_example)


def engines_after(module: nn.Module, name: str, views_per_example: int = 1) -> list[str]:
    """The engines ``auto`` would try after ``name`` for ``module``, in order
    (:func:`lightning_dp.grad_sample.auto.engines_after`)."""
    return importlib.import_module(_SELECTION).engines_after(module, name, views_per_example)
