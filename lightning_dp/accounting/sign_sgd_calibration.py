"""Per-worker noise calibration for DP-SignSGD (docs/algorithms.md §6), ours and the paper's.

Each DP-SignSGD worker runs the sampled Gaussian mechanism (SGM) on its *local* data:
local Poisson rate q, noise multiplier σ, T steps, per-example clipping to C (so the
add/remove sensitivity of its clipped sum is C, i.e. unit sensitivity in units of C).
Its (ε, δ) guarantee w.r.t. its own dataset is that of DP-SGD with (q, σ, T).

Three ways to turn (ε, δ, q, T) into σ are offered (root-finding on σ):

* ``"rdp"`` (ours, default): Opacus' RDP analysis of the SGM
  (``compute_rdp``'s series, vectorised: :func:`~lightning_dp.accounting.rdp.step_rdp`) at Opacus' default orders
  (fractional orders 1.1 … 10.9 and integers 12 … 63), converted with the tighter
  conversion of Balle et al. 2020 (:func:`~lightning_dp.accounting.rdp.rdp_to_epsilon`).
* ``"prv"``: Opacus' PRV accountant (numerical privacy-loss composition, tighter
  still; ~1 s per ε evaluation, 5–10 evaluations per calibration).
* ``"paper_grid"``: the seed paper's §3.3: integer orders α ∈ {2, …, 20} (its eq. (8),
  which is exactly what ``compute_rdp`` evaluates at integer orders) with Mironov's
  conversion ε = T·RDP(α) + log(1/δ)/(α − 1) (its eq. (9), Mironov 2017, Prop. 3).
  (The paper also restricts σ to a grid in [0.5, 3]; we do not.)

The paper's Algorithm 2 additionally clips the *averaged* subsample gradient; under
add/remove adjacency that statistic has sensitivity 2C, not C, so for its stated
(ε, δ) to hold its σ must be doubled (``sensitivity_factor=2``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from lightning_dp.accounting.calibration import smallest_sigma
from lightning_dp.accounting.checks import check_delta, check_sample_rate, check_steps
from lightning_dp.accounting.rdp import INTEGER_ORDERS, RDP_ORDERS, rdp_to_epsilon, rdp_to_epsilon_mironov, step_rdp

CalibrationMethod = Literal["rdp", "prv", "paper_grid"]

PAPER_ORDERS: tuple[int, ...] = tuple(int(a) for a in INTEGER_ORDERS)
"""The seed paper's integer grid (it writes 1 ≤ α ≤ 20; α = 1 is undefined for eq. (9))."""


def _check(sample_rate: float, steps: int, delta: float) -> None:
    check_sample_rate(sample_rate)
    if check_steps(steps) < 1:
        raise ValueError(f"steps (T) must be >= 1, got {steps}")
    check_delta(delta)


def epsilon_rdp(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[float] = RDP_ORDERS,
) -> float:
    """ε of T SGM steps by Opacus' RDP analysis and the Balle et al. 2020 conversion."""
    _check(sample_rate, steps, delta)
    orders = tuple(float(a) for a in orders)
    return rdp_to_epsilon(steps * step_rdp(noise_multiplier, sample_rate, orders), orders, delta)


def epsilon_paper_grid(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[int] = PAPER_ORDERS,
) -> float:
    """ε by the seed paper's §3.3: min over integer α of T·RDP(α) + log(1/δ)/(α − 1).

    RDP(α) is the paper's eq. (8) (evaluated by Opacus' ``compute_rdp``, which uses the
    same binomial expansion at integer orders); the conversion is Mironov's, eq. (9).
    """
    _check(sample_rate, steps, delta)
    if any(int(a) != a or a < 2 for a in orders):
        raise ValueError(f"paper grid orders must be integers >= 2, got {list(orders)}")
    grid = tuple(float(a) for a in orders)
    return rdp_to_epsilon_mironov(steps * step_rdp(noise_multiplier, sample_rate, grid), grid, delta)


def epsilon_prv(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of T SGM steps by Opacus' PRV accountant (Gopi et al. 2021); upper estimate."""
    _check(sample_rate, steps, delta)
    from lightning_dp._opacus import import_opacus

    PRVAccountant = import_opacus("opacus.accountants").PRVAccountant  # imported on first use

    accountant = PRVAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its internal RDP domain bound warns at tiny σ
        return float(accountant.get_epsilon(delta=delta))


_EPSILON: dict[str, Callable[[float, float, int, float], float]] = {
    "rdp": epsilon_rdp,
    "prv": epsilon_prv,
    "paper_grid": epsilon_paper_grid,
}


def worker_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: CalibrationMethod = "rdp",
    sensitivity_factor: float = 1.0,
) -> float:
    """ε of one DP-SignSGD worker after T steps with local rate q and noise std σC.

    ``sensitivity_factor`` k: the released statistic's add/remove sensitivity is k·C
    (1 for per-example clipping; 2 for the paper's clipped average), so the effective
    noise multiplier is σ/k.
    """
    if method not in _EPSILON:
        raise ValueError(f"method must be one of {sorted(_EPSILON)}, got {method!r}")
    if not sensitivity_factor > 0:
        raise ValueError(f"sensitivity_factor must be > 0, got {sensitivity_factor}")
    if not noise_multiplier > 0:
        return math.inf
    return _EPSILON[method](noise_multiplier / sensitivity_factor, sample_rate, steps, delta)


def calibrate_worker_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    method: CalibrationMethod = "rdp",
    sensitivity_factor: float = 1.0,
    rel_tol: float = 1e-3,
    max_sigma: float = 1e4,
) -> float:
    """Smallest σ (to ``rel_tol``) such that one worker is (target ε, δ)-DP after T steps.

    ε is decreasing in σ: the shared search of :func:`~lightning_dp.accounting.calibration.smallest_sigma`
    (bracket, Brent's method in log σ on log ε, then step σ up until
    ``worker_epsilon(σ, ...) <= target_epsilon`` holds, which it always does for the returned σ).

    Args:
        target_epsilon: ε > 0.
        delta: δ in (0, 1), e.g. the paper's n_local^-1.1.
        sample_rate: local Poisson rate q of a worker (expected local batch / n_local).
        steps: T.
        method: ``"rdp"`` (ours), ``"prv"``, or ``"paper_grid"`` (see module docstring).
        sensitivity_factor: 1 for per-example clipping; 2 to correct the paper's Alg. 2.
        rel_tol: relative accuracy of σ.
        max_sigma: give up (ValueError) above this σ.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")

    return smallest_sigma(
        lambda sigma: worker_epsilon(sigma, sample_rate, steps, delta, method, sensitivity_factor),
        target_epsilon, rel_tol, max_sigma=max_sigma,
    )


@dataclass(frozen=True)
class SigmaComparison:
    """Per-worker σ for one (ε, δ, q, T) by each method (see :func:`compare_worker_sigmas`).

    Attributes:
        ours: σ by the RDP accountant at fractional orders, per-example clipping (sensitivity C).
        prv: σ by the PRV accountant (``None`` if not computed).
        paper_grid: σ the paper's grid returns (integer α, Mironov), taken at its word (sensitivity C).
        paper_grid_2c: σ the paper's grid needs once its 2C sensitivity is accounted for.
        paper_actual_epsilon: ε the paper's σ really delivers for its 2C-sensitive
            statistic (by our accountant), i.e. what its "ε = target" actually is.
    """

    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    ours: float
    prv: Optional[float]
    paper_grid: float
    paper_grid_2c: float
    paper_actual_epsilon: float


def compare_worker_sigmas(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    with_prv: bool = False,
    rel_tol: float = 1e-3,
) -> SigmaComparison:
    """Our per-worker σ next to the seed paper's, for the docs and ``lightning-dp budget``.

    ``rel_tol`` is passed to every :func:`calibrate_worker_sigma` (PRV uses at least 1e-2).
    """
    args = (target_epsilon, delta, sample_rate, steps)
    ours = calibrate_worker_sigma(*args, "rdp", rel_tol=rel_tol)
    prv = calibrate_worker_sigma(*args, "prv", rel_tol=max(rel_tol, 1e-2)) if with_prv else None
    grid = calibrate_worker_sigma(*args, "paper_grid", rel_tol=rel_tol)
    grid_2c = calibrate_worker_sigma(*args, "paper_grid", sensitivity_factor=2.0, rel_tol=rel_tol)
    actual = worker_epsilon(grid, sample_rate, steps, delta, "rdp", sensitivity_factor=2.0)
    return SigmaComparison(target_epsilon, delta, sample_rate, steps, ours, prv, grid, grid_2c, actual)
