"""The per-example gradient engine interface and its registry.

An engine turns one forward + backward of a *mean* loss into the per-example clipped
statistics the mechanism needs (docs/algorithms.md, "The mechanism"):

    S   = Σ_i clip_C(s ⊙ g_i)          (always)
    S2  = Σ_i clip_C(s ⊙ g_i)²         (only when asked, for independent moments)
    ‖s ⊙ g_i‖ for every example         (norms before clipping; diagnostics)

How it gets there is its own business: materialise per-example gradients (Opacus
hooks, torch.func.vmap) or never materialise them (ghost clipping / book-keeping).
Engines are registered by name; ``DPStrategy(per_sample=name)`` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional, Sequence, TypeVar, Union

import torch
from torch import Tensor, nn

from lightning_dp.mechanism.clipping.flat import flat_factors
from lightning_dp.mechanism.clipping.rule import ClipRule, as_rule

ParamMap = Mapping[Tensor, Tensor]


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
    fingerprints nor restores them: :mod:`~lightning_dp.mechanism.boundary`)."""
    views_per_example: int = 1
    """K: rows per example (each example's K augmented views, consecutive); set before :meth:`attach`.
    :meth:`begin_step` still counts examples; K > 1 needs :attr:`supports_views`."""
    supports_padding: ClassVar[bool] = False
    """Whether :meth:`clip_and_sum` honours :attr:`padding_rows` (fixed-shape batches)."""
    padding_rows: int = 0
    """Rows (examples) at the end of the current physical batch that are padding, not examples (fixed-shape batches,
    :mod:`~lightning_dp.mechanism.fixed_batch`): their clip factors are 0, so they add exactly nothing to the sums,
    and they are left out of the norms and the count. Set by the private step around :meth:`clip_and_sum` only."""

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
                :class:`~lightning_dp.mechanism.clipping.rule.ClipRule`: a clipping policy and the examples' units.
            scale: optional per-coordinate scale s per parameter (scale-then-privatize).
            with_squares: also return Σ_i clip_C(s ⊙ g_i)².
        """

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Names and types of layers this engine cannot handle ('' list if none)."""
        return []


E = TypeVar("E", bound=type[GradSampleEngine])
_ENGINES: dict[str, type[GradSampleEngine]] = {}


def register_engine(cls: E) -> E:
    """Class decorator: make an engine available as ``DPStrategy(per_sample=cls.name)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty `name`")
    _ENGINES[cls.name] = cls
    return cls


def available_engines() -> list[str]:
    """Names of the registered engines."""
    return sorted(_ENGINES)


def make_engine(name: str) -> GradSampleEngine:
    """Instantiate the engine registered under ``name``."""
    try:
        return _ENGINES[name]()
    except KeyError:
        raise ValueError(f"Unknown per-sample engine {name!r}; available: {available_engines()}") from None


def mean_over_views(grad_samples: Sequence[Tensor], views: int) -> list[Tensor]:
    """Per-row gradients ``[n·K, …]`` → per-example gradients ``[n, …]``: the mean over each example's K
    consecutive rows (its augmented views). Augmentation multiplicity (De et al. 2022, §3.1, eq. 2): the
    example's gradient is the mean of its views' gradients, clipped ONCE, so one example still moves the
    sum by at most C and the accounting is unchanged. ``views = 1`` returns the input."""
    if views == 1:
        return list(grad_samples)
    out = []
    for gs in grad_samples:
        if gs.shape[0] % views:
            raise ValueError(f"{gs.shape[0]} rows are not a multiple of {views} views per example")
        out.append(gs.view(gs.shape[0] // views, views, *gs.shape[1:]).mean(1))
    return out


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C / ‖g_i‖) per example (docs/algorithms.md, clip_C). Zero norms give 1."""
    return flat_factors(norms, max_grad_norm)


def clip_from_parts(sq_parts: Sequence[Tensor], max_grad_norm: Union[float, ClipRule],
                    padding: int = 0) -> tuple[Tensor, Tensor]:
    """(norms, clip factors) of n examples from their squared norms per part (layer, parameter), each ``[n]`` (or
    ``[L, n]`` for L stacked layers).

    ``max_grad_norm``: C (flat clipping), or a :class:`~lightning_dp.mechanism.clipping.rule.ClipRule` whose
    policy takes one factor per example from its whole norm (flat, automatic, adaptive: not per parameter, every
    example its own unit); the factors are the policy's (:meth:`ClipRule.example_factors`).

    The sum over parts and the factor are taken in float64, the only place the norms are wider than the gradients:
    the bound ‖c_i g_i‖ ≤ C is a statement about the whole gradient, and a float32 sum of L parts carries a relative
    error up to L·2⁻²⁴ (10⁻⁵ at a few hundred layers) that would let c_i g_i exceed C by as much. Each part stays in
    its own dtype (a per-layer reduction is accurate to its own rounding); the n-vectors cost nothing. Returned in
    the parts' dtype, ready for the contractions: c_i ‖g_i‖ ≤ C(1 + 2⁻²⁴) in float32.

    ``padding``: the last ``padding`` rows are padding (fixed-shape batches): their factors are exactly 0, so
    Σ_i c_i g_i over the padded batch is the sum over its examples, whatever the padding rows hold."""
    rule = as_rule(max_grad_norm)
    if rule.per_parameter or rule.grouped:
        raise ValueError(f"clip_from_parts takes one whole norm per example; {rule.policy.describe()} with "
                         f"{'units of several examples' if rule.grouped else 'norms per parameter'} is "
                         "clip_and_sum_by_rule's")
    dtype, n = sq_parts[0].dtype, sq_parts[0].shape[-1]
    sq = torch.cat([s.reshape(-1, n) for s in sq_parts]).sum(0, dtype=torch.float64).clamp_min(0)
    norms = sq.sqrt()
    factors = rule.example_factors(sq).to(dtype)
    if padding:
        factors[n - padding:] = 0.0
    return norms.to(dtype), factors


def clip_and_sum_materialised(
    params: Sequence[nn.Parameter],
    grad_samples: Sequence[Tensor],
    max_grad_norm: Union[float, ClipRule],
    scale: Optional[ParamMap] = None,
    with_squares: bool = False,
    padding: int = 0,
) -> ClippedBatch:
    """Shared clipping for engines that materialise per-example gradients (``padding``: rows at the end that are
    padding, :attr:`GradSampleEngine.padding_rows`).

    ``grad_samples[k]`` has shape ``[b, *params[k].shape]``. Low-precision per-example
    gradients (bf16/fp16 autocast) are clipped in float32, so the clipped sum's
    sensitivity is C for the gradients actually computed. A clipping policy other than flat, or
    units of several examples, take :func:`clip_and_sum_by_rule`.
    """
    rule = as_rule(max_grad_norm)
    grad_samples = [gs.float() if gs.dtype in (torch.bfloat16, torch.float16) else gs for gs in grad_samples]
    if scale is not None:
        grad_samples = [gs * scale[p].unsqueeze(0) for p, gs in zip(params, grad_samples)]
    b = grad_samples[0].shape[0] if grad_samples else 0
    if b == 0:
        zeros = {p: torch.zeros_like(p) for p in params}
        squares = {p: torch.zeros_like(p) for p in params} if with_squares else None
        return ClippedBatch(zeros, squares, torch.zeros(0, device=params[0].device), 0)
    if not rule.is_flat_per_example:
        return clip_and_sum_by_rule(params, grad_samples, rule, with_squares, padding)
    norms, factors = clip_from_parts([torch.linalg.vector_norm(gs.reshape(b, -1), dim=1).square()
                                      for gs in grad_samples], rule, padding)  # no g² temporary
    sums = {p: torch.einsum("b,b...->...", factors, gs) for p, gs in zip(params, grad_samples)}
    squares = None
    if with_squares:
        squares = {p: torch.einsum("b,b...->...", factors.pow(2), gs.pow(2)) for p, gs in zip(params, grad_samples)}
    return ClippedBatch(sums, squares, norms[:b - padding].detach(), b - padding)


def clip_and_sum_by_rule(params: Sequence[nn.Parameter], grad_samples: Sequence[Tensor], rule: ClipRule,
                         with_squares: bool = False, padding: int = 0) -> ClippedBatch:
    """:func:`clip_and_sum_materialised` for any :class:`~lightning_dp.mechanism.clipping.rule.ClipRule`: each unit's
    summed gradient is formed (a sum over its examples' rows), its norms taken (per parameter when the policy
    clips per parameter) and the factors applied per example (per parameter). Squares are Σ_i f_i² g_i², the
    per-example second moment: refused for units of several examples (the private step does so).

    ``padding``: the last rows are padding (fixed-shape batches): their factors are exactly 0 and they are left out
    of the norms and the count. Only with every example its own unit (a padding row belongs to no unit)."""
    b = grad_samples[0].shape[0]
    if with_squares and rule.groups is not None:
        raise ValueError("squares of per-example gradients are not a unit's second moment: not with grouped units")
    if padding and rule.groups is not None:
        raise ValueError("padding rows (fixed_batch_size) belong to no unit: not with units of several examples")
    if rule.groups is None:
        units = grad_samples
    else:
        groups = rule.groups.to(grad_samples[0].device)
        count = rule.num_units()
        units = [gs.new_zeros((count, *gs.shape[1:])).index_add_(0, groups, gs) for gs in grad_samples]
    per_param = torch.stack([u.reshape(u.shape[0], -1).pow(2).sum(1) for u in units], dim=0)  # [P, u]
    sq = per_param if rule.per_parameter else per_param.sum(0)
    factors = rule.example_factors(sq)
    if padding:
        factors = factors.clone()
        factors[..., b - padding:] = 0.0
        sq = sq[..., :b - padding]
    rows = factors if rule.per_parameter else factors.expand(len(params), b)
    sums = {p: torch.einsum("b,b...->...", f, gs) for p, f, gs in zip(params, rows, grad_samples)}
    squares = None
    if with_squares:
        squares = {p: torch.einsum("b,b...->...", f.pow(2), gs.pow(2)) for p, f, gs in zip(params, rows, grad_samples)}
    return ClippedBatch(sums, squares, rule.unit_norms(sq).detach(), b - padding)


def merge_clipped(first: ClippedBatch, second: ClippedBatch) -> ClippedBatch:
    """The statistics of two disjoint physical batches of one logical batch, combined."""
    sums = {p: first.sums[p] + second.sums[p] for p in first.sums}
    squares = None
    if first.square_sums is not None and second.square_sums is not None:
        squares = {p: first.square_sums[p] + second.square_sums[p] for p in first.square_sums}
    norms = torch.cat([first.norms, second.norms])
    return ClippedBatch(sums, squares, norms, first.batch_size + second.batch_size)
