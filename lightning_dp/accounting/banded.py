"""Sensitivity and privacy accounting of banded DP-MF under b-min-separated participation.

docs/algorithms.md §7. The mechanism (:mod:`lightning_dp.privacy.banded_noise`) releases
Ĉ⁻¹(Ĉ X + σ C_clip Z) with Ĉ the b-banded lower-triangular Toeplitz strategy normalised to
max column norm 1 (sens = ‖c‖₂ is divided out). Sampling is cyclic Poisson
(:mod:`lightning_dp.privacy.min_sep_sampling`): b fixed groups, step t samples group t mod b
with rate q_g.

**Why ⌈T/b⌉ sampled Gaussian steps.** Column s of Ĉ is non-zero only in rows s..s+b−1. An
example of group g participates (if sampled) in steps g, g + b, g + 2b, …: its columns have
*disjoint* row supports, so for a 0/1 participation vector u, ‖Ĉ u‖² = Σ_{s∈u} ‖Ĉ e_s‖² (no cross
terms, checked by :func:`brute_force_sensitivity` in the tests) and the rows of Ĉ X + σ C_clip Z
split into ⌈T/b⌉ independent blocks, each touched by at most one participation with
sensitivity ≤ C_clip · max_s ‖Ĉ e_s‖ = C_clip and Poisson-sampled with rate q_g. Choquette-Choo
et al. 2023 ("(Amplified) banded matrix factorization", arXiv 2306.08153, Thm. 5; used this way
by JAX Privacy's BandMF execution plan) make this precise, including adaptivity: the mechanism
satisfies every guarantee of DP-SGD with noise multiplier σ, Poisson rate q_g and ⌈T/b⌉ steps.
The theorem is stated for zero-out adjacency (replace an example by one with zero gradient);
for the Poisson-sampled Gaussian that gives the same privacy-loss pair as add/remove, which our
accountants compute, so ε below is the library's usual ε.

This needs a fixed σ for the whole run (a time-varying σ is not of the form above) and a
group cycle that never restarts mid-run.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional, Sequence

import numpy as np

from lightning_dp.accounting.calibration import calibrate_noise
from lightning_dp.accounting.checks import check_steps
from lightning_dp.accounting.epsilon import epsilon
from lightning_dp.accounting.banded_coefficients import check_bands


def banded_rounds(steps: int, bands: int) -> int:
    """⌈T/b⌉: the most participations any example can have in T steps (group 0's count)."""
    return math.ceil(check_steps(steps) / check_bands(bands))


def rounds_charged_at(step: int, bands: int) -> int:
    """1 if 0-based ``step`` opens a new cycle of the b groups (step ≡ 0 mod b), else 0.

    Recording ``ledger.record(σ, q_g, steps=rounds_charged_at(t, b))`` at every step t leaves
    ⌈T/b⌉ = :func:`banded_rounds` (T, b) sampled-Gaussian steps in the ledger after T steps.
    """
    return 1 if check_steps(step) % check_bands(bands) == 0 else 0


def banded_epsilon(
    noise_multiplier: float,
    group_sample_rate: float,
    steps: int,
    bands: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """ε(δ) of T steps of banded DP-MF with b-min-separated (cyclic Poisson) participation.

    Equals :func:`~lightning_dp.accounting.epsilon` (σ, q_g, ⌈T/b⌉, δ) (module docstring; Choquette-Choo
    et al. 2023, Thm. 5). σ is the multiplier of the normalised strategy, i.e. the ``noise_multiplier``
    given to the strategy with :class:`~lightning_dp.privacy.banded_noise.BandedToeplitzNoise`.

    Args:
        noise_multiplier: σ > 0.
        group_sample_rate: q_g ∈ (0, 1], the within-group Poisson rate (b · B / N).
        steps: T ≥ 0 logical steps.
        bands: b ≥ 1 (b = 1 is DP-SGD: the same ε as ``epsilon(σ, q, T, δ)``).
        delta: δ ∈ (0, 1).
        accountant: any registered accountant (``"rdp"``, ``"pld"``, ``"prv"``, ...).
    """
    return epsilon(noise_multiplier, group_sample_rate, banded_rounds(steps, bands), delta, accountant)


def calibrate_banded_noise(
    target_epsilon: float,
    delta: float,
    group_sample_rate: float,
    steps: int,
    bands: int,
    accountant: str = "rdp",
    rtol: float = 1e-4,
) -> float:
    """Smallest σ (within ``rtol``) with ``banded_epsilon(σ, q_g, T, b, δ) ≤ target_epsilon``.

    :func:`~lightning_dp.accounting.calibrate_noise` on ⌈T/b⌉ steps of rate q_g.
    """
    if check_steps(steps) < 1:
        raise ValueError("steps must be >= 1 to calibrate σ (with 0 steps any σ gives ε = 0)")
    return calibrate_noise(target_epsilon, delta, group_sample_rate, banded_rounds(steps, bands), accountant, rtol)


def strategy_matrix(coefficients: Sequence[float], n: int) -> np.ndarray:
    """The n × n lower-triangular Toeplitz C with C[t, s] = c_{t−s} (0 ≤ t − s < b)."""
    c = np.asarray(coefficients, dtype=np.float64)
    matrix = np.zeros((n, n))
    for j, cj in enumerate(c[:n]):
        matrix += cj * np.eye(n, k=-j)
    return matrix


def column_norm_sensitivity(matrix: np.ndarray) -> float:
    """max_s ‖C e_s‖₂: the sensitivity of one participation (the quantity the mechanism divides out)."""
    return float(np.max(np.linalg.norm(np.asarray(matrix, dtype=np.float64), axis=0)))


def participation_patterns(
    n: int, min_separation: int, max_participations: Optional[int] = None
) -> Iterator[tuple[int, ...]]:
    """Every non-empty set of steps in 0..n−1 whose members are ≥ ``min_separation`` apart.

    Exponential in n: for tests on small matrices only.
    """
    if min_separation < 1:
        raise ValueError(f"min_separation must be >= 1, got {min_separation}")
    most = n if max_participations is None else max_participations
    for k in range(1, most + 1):
        for steps in itertools.combinations(range(n), k):
            if all(b - a >= min_separation for a, b in zip(steps, steps[1:])):
                yield steps


def brute_force_sensitivity(
    matrix: np.ndarray, min_separation: int, max_participations: Optional[int] = None
) -> float:
    """max ‖C u‖₂ over 0/1 participation vectors u with participations ≥ ``min_separation`` apart.

    The L2 sensitivity of X ↦ C X when one example (gradient norm ≤ 1, worst case all aligned)
    may take part in any such set of steps. With ``max_participations=1`` it is the single-
    participation sensitivity :func:`column_norm_sensitivity`. For a b-banded C and separation
    ≥ b the squared norm is additive over participations (disjoint supports); that additivity is
    what reduces the amplified analysis to one Gaussian step per participation.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    best = 0.0
    for steps in participation_patterns(matrix.shape[1], min_separation, max_participations):
        best = max(best, float(np.linalg.norm(matrix[:, list(steps)].sum(axis=1))))
    return best


def multi_participation_sensitivity(coefficients: Sequence[float], n: int, bands: int) -> float:
    """Closed form of :func:`brute_force_sensitivity` (C, min_separation=b) for a b-banded Toeplitz C.

    Disjoint supports make ‖C u‖² = Σ_{s∈u} ‖C e_s‖²; column norms do not increase with s (the
    last b − 1 columns are truncated), so the worst pattern is s = 0, b, 2b, …:
    sqrt(Σ_m ‖C e_{mb}‖²). This is the sensitivity *without* amplification (every group always
    participates) — for comparison; the amplified analysis uses one column norm per round.
    """
    bands = check_bands(bands)
    c = np.asarray(coefficients, dtype=np.float64)
    if c.size > bands:
        raise ValueError(f"{c.size} coefficients is more than bands={bands}")
    tail = np.cumsum((c * c)[::-1])[::-1]  # tail[k] = Σ_{j≥k} c_j²
    total = 0.0
    for start in range(0, n, bands):
        rows = min(c.size, n - start)  # column `start` keeps c_0..c_{rows−1}
        total += float(tail[0] - (tail[rows] if rows < c.size else 0.0))
    return math.sqrt(total)
