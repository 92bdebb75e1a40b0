"""Per-order Rényi DP of the sampled Gaussian mechanism, and its conversion to (ε, δ).

The RDP curve itself is Opacus' (``opacus.accountants.analysis.rdp.compute_rdp``, the
analysis of Mironov, Talwar & Zhang 2019 for the Poisson-subsampled Gaussian, add/remove
adjacency), evaluated by :func:`~lightning_dp.accounting.sgm_rdp.sampled_gaussian_rdp`:
the same series vectorised over orders (timings in that module; the tests hold it to
``compute_rdp``). This module only

* caches the RDP vector of **one** step for a given (σ, q) — composition over steps and over
  changing (σ, q) is the sum of such vectors (RDP composes additively, Mironov 2017 Prop. 1);
* converts a composed RDP vector to ε for a δ, either with the tight conversion Opacus uses
  (Balle et al. 2020, "Hypothesis testing interpretations and Rényi DP", Thm. 21) or with
  Mironov's original conversion ε = RDP(α) + log(1/δ)/(α − 1) (Mironov 2017, Prop. 3),
  which the DP-SignSGD paper uses on integer orders (docs/algorithms.md §6).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from functools import lru_cache
from typing import Sequence

import numpy as np

from lightning_dp.accounting.sgm_rdp import RDP_CURVES, check_curve

#: Opacus' default RDP orders (fractional 1.1 … 10.9, then integers 12 … 63).
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])

#: The DP-SignSGD paper's coarse grid: integer orders α ∈ {2, …, 20} (docs/algorithms.md §6).
INTEGER_ORDERS: tuple[float, ...] = tuple(float(a) for a in range(2, 21))


class OneStepCache:
    """Least-recently-used store of read-only one-step RDP vectors, keyed by (σ, q, orders, curve).

    A run with constant σ evaluates its curve once; one whose σ or q changes every step
    visits many keys, and :meth:`get_many` evaluates all missing ones in one batched call
    (``"chord"``: ~50 µs per key instead of ~110, :mod:`~lightning_dp.accounting.sgm_rdp`).
    4096 vectors of Opacus' 151 orders take ~5 MB.
    """

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = int(maxsize)
        self._store: OrderedDict[tuple[float, float, int, str], np.ndarray] = OrderedDict()
        self._order_ids: dict[tuple[float, ...], int] = {}  # keys hold a small id, not 151 floats to hash

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Forget every vector (benchmarks measure cold costs with it)."""
        self._store.clear()

    def get(self, noise_multiplier: float, sample_rate: float, orders: tuple[float, ...], curve: str) -> np.ndarray:
        """The vector of one (σ, q), evaluated on a miss."""
        return self.get_many(((noise_multiplier, sample_rate),), orders, curve)[0]

    def get_many(self, pairs: Sequence[tuple[float, float]], orders: tuple[float, ...], curve: str) -> list[np.ndarray]:
        """The vectors of several (σ, q), the missing ones evaluated together (one row each)."""
        store = self._store
        tag = self._order_ids.setdefault(orders, len(self._order_ids))
        keys = [(float(s), float(q), tag, curve) for s, q in pairs]
        missing = list(dict.fromkeys(k for k in keys if k not in store))
        if missing:
            rows = RDP_CURVES[curve]([k[0] for k in missing], [k[1] for k in missing], orders)
            rows.setflags(write=False)
            store.update(zip(missing, rows))
        out = []
        for key in keys:
            store.move_to_end(key)
            out.append(store[key])
        while len(store) > self.maxsize:
            store.popitem(last=False)
        return out


#: The process-wide cache behind :func:`step_rdp` and :class:`~lightning_dp.accounting.RunningRDP`.
STEP_CACHE = OneStepCache()


def step_rdp(
    noise_multiplier: float, sample_rate: float, orders: tuple[float, ...] = RDP_ORDERS, curve: str = "exact"
) -> np.ndarray:
    """RDP vector (one value per order) of ONE step of the sampled Gaussian mechanism.

    ``curve="exact"``: Opacus' ``compute_rdp`` with ``steps=1`` (vectorised,
    :func:`~lightning_dp.accounting.sgm_rdp.sampled_gaussian_rdp`); ``"chord"``: its
    upper bound exact at integer orders (:func:`~lightning_dp.accounting.sgm_rdp.sampled_gaussian_rdp_upper`,
    cheaper; timings in :mod:`~lightning_dp.accounting.sgm_rdp`). Cached per (σ, q, orders, curve) in
    :data:`STEP_CACHE`: a run whose σ is
    constant pays once. ``σ = 0`` gives ``inf`` (no privacy), ``q = 0`` gives 0. The returned
    array is read-only; multiply it by a step count to compose.
    """
    orders = tuple(float(a) for a in orders)
    return STEP_CACHE.get(float(noise_multiplier), float(sample_rate), orders, check_curve(curve))


@lru_cache(maxsize=256)
def _balle_offsets(orders: tuple[float, ...], delta: float) -> np.ndarray:
    a = np.asarray(orders, dtype=float)
    offsets = -(np.log(delta) + np.log(a)) / (a - 1.0) + np.log((a - 1.0) / a)
    offsets.setflags(write=False)
    return offsets


@lru_cache(maxsize=256)
def _mironov_offsets(orders: tuple[float, ...], delta: float) -> np.ndarray:
    a = np.asarray(orders, dtype=float)
    offsets = np.log(1.0 / delta) / (a - 1.0)
    offsets.setflags(write=False)
    return offsets


def conversion_offsets(orders: tuple[float, ...], delta: float, conversion: str = "balle") -> np.ndarray:
    """The per-order term that :func:`rdp_to_epsilon` (``"balle"``) or
    :func:`rdp_to_epsilon_mironov` (``"mironov"``) adds to RDP(α) before minimising (cached)."""
    table = {"balle": _balle_offsets, "mironov": _mironov_offsets}
    if conversion not in table:
        raise ValueError(f"conversion must be one of {sorted(table)}, got {conversion!r}")
    return table[conversion](tuple(orders), float(delta))


def epsilon_from_offsets(rdp: np.ndarray, offsets: np.ndarray) -> float:
    """min over orders of RDP(α) + offset(α), clipped at 0, with :func:`conversion_offsets`
    computed once (the fast path of :class:`~lightning_dp.accounting.RunningRDP`). A zero
    vector (no release) gives 0; a vector infinite or undefined everywhere gives ``inf``."""
    rdp = np.asarray(rdp, dtype=float)
    if not rdp.any():
        return 0.0  # nothing released yet
    eps = rdp + offsets
    best = float(eps.min())
    if math.isnan(best):  # some orders undefined: ignore them (inf if all are)
        if np.all(np.isnan(eps)):
            return float("inf")
        best = float(np.nanmin(eps))
    return max(0.0, best)


def rdp_to_epsilon(rdp: np.ndarray, orders: tuple[float, ...], delta: float) -> float:
    """ε(δ) from a composed RDP vector: Balle et al. 2020, Thm. 21 (the conversion of Opacus'
    ``get_privacy_spent``, minimised over the orders; equal to it, see the tests).

    A zero vector (no release) gives ε = 0; a vector that is infinite everywhere gives ``inf``.
    """
    return epsilon_from_offsets(rdp, _balle_offsets(tuple(orders), float(delta)))


def rdp_to_epsilon_mironov(rdp: np.ndarray, orders: tuple[float, ...], delta: float) -> float:
    """ε(δ) = min_α RDP(α) + log(1/δ)/(α − 1): Mironov 2017, Prop. 3 (looser than Balle et al.).

    This is the conversion of the DP-SignSGD paper (docs/algorithms.md §6); kept for comparison.
    """
    return epsilon_from_offsets(rdp, _mironov_offsets(tuple(orders), float(delta)))
