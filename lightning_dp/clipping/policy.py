"""The clipping policy interface: how each privacy unit's gradient is bounded before the noise.

A policy turns the norms of the units' gradients (per example, or per user with
:class:`~lightning_dp.units.Users`) into clip factors c_u, so that the released sum
Σ_u c_u g_u has L2 sensitivity :attr:`ClippingPolicy.max_grad_norm` (C): adding or removing one unit
moves it by at most C, and the Gaussian mechanism's noise σC covers it. Every engine consults the
policy through one :class:`~lightning_dp.clipping.rule.ClipRule` (the policy and the units
of the batch), and the first step's probe checks the factors the engine applied against
:meth:`ClippingPolicy.factors` on each example's own gradient (:mod:`.reference`).

Policies: :class:`~.flat.FlatClipping` (the default, min(1, C/‖g‖)), :class:`~.per_layer.PerLayerClipping`,
:class:`~.automatic.AutomaticClipping`, :class:`~.adaptive.AdaptiveClipping`.
"""

from __future__ import annotations

import copy
from abc import ABC
from typing import Any, ClassVar, Optional, Sequence

from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError


class ClippingPolicy(ABC):
    """How per-unit gradients are clipped; one instance per run (it may keep state: the adaptive bound).

    Subclasses define :meth:`factors` (or :meth:`parameter_factors` with :attr:`per_parameter`) and set the bound C
    they guarantee (``_bound``, read as :attr:`max_grad_norm`)."""

    per_parameter: ClassVar[bool] = False
    """Whether the factors depend on each parameter tensor's own norm (per-layer clipping): engines then give the
    norms per parameter, ``[P, units]``, and apply one factor per (parameter, unit)."""

    _bound: float
    """C now; each subclass sets it in ``__init__`` (the adaptive policy moves it after every release)."""

    moved_by_releases: ClassVar[tuple[str, ...]] = ()
    """The public attributes the policy itself moves after each release (the adaptive policy's count of updates):
    every other public setting is its configuration, which no hook may set from the data (:meth:`settings`)."""

    def settings(self) -> tuple[tuple[str, Any], ...]:
        """The policy's configuration: its public scalar attributes but :attr:`moved_by_releases` (a target quantile,
        a learning rate, γ). The release boundary compares them between releases as it compares C
        (docs/release_boundary.md, rule 3: σ and C are decisions)."""
        return tuple(sorted((k, v) for k, v in vars(self).items() if not k.startswith("_")
                            and k not in self.moved_by_releases and isinstance(v, (int, float, str, bool, type(None)))))

    @property
    def max_grad_norm(self) -> float:
        """C now: the L2 sensitivity of the clipped sum (the noise is σC); what ``strategy.max_grad_norm`` reads."""
        return self._bound

    @property
    def configured_bound(self) -> float:
        """The bound the policy was configured with (the adaptive policy's initial bound): what must agree with a
        ``max_grad_norm`` given beside it, and what a resumed run compares with its checkpoint."""
        return self.max_grad_norm

    def factors(self, norms: Tensor) -> Tensor:
        """Clip factors ``[u]`` for the units' gradient norms ``[u]``: ‖c_u g_u‖ ≤ C for every unit."""
        raise NotImplementedError(f"{type(self).__name__} clips per parameter: use parameter_factors")

    def parameter_factors(self, norms: Tensor) -> Tensor:
        """Clip factors ``[P, u]`` for the per-parameter norms ``[P, u]`` (per-parameter policies only)."""
        raise NotImplementedError(f"{type(self).__name__} clips whole gradients: use factors")

    def bind(self, names: Sequence[str]) -> None:
        """Learn the trainable parameters' names, in the engine's order (per-name budgets resolve here);
        refuses a mismatch with :class:`PrivacyConfigurationError`."""

    def at_bound(self, bound: float) -> "ClippingPolicy":
        """A copy clipping at ``bound`` instead of C (its shape kept: per-layer budgets rescaled, the automatic
        policy's γ kept). The probe checks the engine's factors at a bound that clips about half the examples."""
        other = copy.deepcopy(self)
        other._set_bound(bound)
        return other

    def _set_bound(self, bound: float) -> None:
        """Clip at ``bound`` from now on (:meth:`at_bound`)."""
        self._bound = float(bound)

    def gradient_noise_multiplier(self, sigma: float, expected_units: float) -> float:
        """The noise multiplier of the gradient's noise for an accounted multiplier ``sigma`` (the ledger's). The
        same, except where the policy releases more than the gradient each step (the adaptive policy's count)."""
        return sigma

    def after_release(self, norms: Tensor, expected_units: float, sigma: float, reduce: Optional[Any] = None,
                      rank: int = 0, world_size: int = 1) -> None:
        """Called once per released step with this rank's units' norms (before clipping): the adaptive policy
        updates its bound here. ``reduce``: in-place SUM all-reduce across the ranks (``None``: one process)."""

    def describe(self) -> str:
        """One line for the log: the policy and its bound."""
        return f"{type(self).__name__}(C = {self.max_grad_norm:g})"

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from (the adaptive bound)."""
        return {"policy": type(self).__name__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another policy is refused."""
        name = state.get("policy")
        if name is not None and name != type(self).__name__:
            raise PrivacyConfigurationError(
                f"the checkpoint was trained with clipping={name}, this run uses {type(self).__name__}: resume "
                "with the checkpoint's clipping policy.")

    def refusal(self, *, sharded: bool, mechanism: str, bands: int, second_moment: bool, users: bool) -> Optional[str]:
        """Why this policy cannot run with these settings (``None``: it can). Named combinations only."""
        if sharded:
            return f"{type(self).__name__} does not run on sharded parameters (DPShardedStrategy): use DPStrategy"
        if mechanism != "gaussian":
            return (f"{type(self).__name__} needs the Gaussian release of the clipped mean; the optimizer asks for "
                    f"{mechanism!r} (DP-SignSGD): use flat clipping (no clipping= argument) with it")
        return None


def positive(value: Any, what: str) -> float:
    """``value`` as a finite float > 0, or ``ValueError`` naming ``what``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number > 0, got {value!r}") from None
    if not (number > 0 and number != float("inf")):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return number
