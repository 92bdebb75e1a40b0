"""The run's clipping policy from ``max_grad_norm`` and ``clipping``, and the combinations refused by name."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.clipping.flat import FlatClipping
from lightning_dp.clipping.policy import ClippingPolicy

DEFAULT_MAX_GRAD_NORM = 1.0
"""C when neither ``max_grad_norm`` nor a policy gives one."""


def resolve_clipping(max_grad_norm: Optional[float], clipping: Optional[ClippingPolicy]) -> ClippingPolicy:
    """The policy in force: ``clipping``, or flat clipping at ``max_grad_norm`` (default 1.0). Both given: they must
    agree (a policy's configured bound, the adaptive policy's ``initial_norm``), or the run is refused."""
    if clipping is None:
        return FlatClipping(DEFAULT_MAX_GRAD_NORM if max_grad_norm is None else max_grad_norm)
    if not isinstance(clipping, ClippingPolicy):
        raise TypeError(f"clipping must be a clipping policy (lightning_dp.PerLayerClipping, AutomaticClipping, "
                        f"AdaptiveClipping), got {clipping!r}")
    bound = clipping.configured_bound
    if max_grad_norm is not None and not math.isclose(float(max_grad_norm), bound, rel_tol=1e-9):
        raise PrivacyConfigurationError(
            f"max_grad_norm={max_grad_norm:g} and clipping={type(clipping).__name__} (bound {bound:g}) disagree on the "
            "clipping norm C: give it once, in the policy (drop max_grad_norm), or make them equal.")
    return clipping


def unit_refusal(unit: Any, *, sharded: bool, mechanism: str, bands: int, second_moment: bool,
                 **_: Any) -> Optional[str]:
    """Why user-level DP cannot run with these settings (``None``: it can)."""
    if unit is None:
        return None
    if sharded:
        return "privacy_unit=Users(...) does not run on sharded parameters (DPShardedStrategy): use DPStrategy"
    if mechanism != "gaussian":
        return (f"privacy_unit=Users(...) needs the Gaussian release of the clipped mean; the optimizer asks for "
                f"{mechanism!r} (DP-SignSGD): use an optimizer without a mechanism of its own")
    if bands > 1:
        return "privacy_unit=Users(...) samples users by plain Poisson sampling: use noise='gaussian' (not banded)"
    if second_moment:
        return ("privacy_unit=Users(...) does not serve optimizers that release a second moment "
                "(independent_moments): its per-example squares are not a user's")
    return None
