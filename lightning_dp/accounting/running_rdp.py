"""A running per-order RDP total, fed incrementally from a :class:`PrivacyLedger`.

Rényi DP composes additively (Mironov 2017, Prop. 1): the RDP of a run whose σ or q
changes mid-way is the sum over steps of the one-step RDP vectors of Opacus
(:func:`~lightning_dp.accounting.rdp.step_rdp`). Keeping that sum up to date costs one
weighted sum over the new ledger entries' vectors, instead of recomputing the whole history each
time ε is asked for (which took Opacus 118 s at 10^4 changing steps, docs/accounting.md). The one-step vector of a given
(σ, q) is cached, so a run with
constant σ pays for Opacus' curve once.

Optional ``quantum``: round σ *down* and q *up* to a geometric grid of relative spacing
``quantum`` before looking up the one-step vector. RDP of the sampled Gaussian is
non-increasing in σ and non-decreasing in q at every order, so the total is an upper
bound on the exact one (sound, slightly pessimistic) and runs whose σ drifts a little
every step reuse cached vectors. ``None`` (default) is exact.

``curve`` picks how a one-step vector is evaluated (:mod:`~lightning_dp.accounting.sgm_rdp`):
``"exact"`` (Opacus' series, 1–4 ms per new (σ, q)), ``"chord"`` (exact at integer orders, a
convexity upper bound at fractional ones, ~50 µs per (σ, q) when batched; ε ≤ 1.3 % higher at
σ ≥ 1.2, ≤ 5 % at σ = 1, up to ~20–37 % at σ ≤ 0.6:
:func:`~lightning_dp.accounting.sgm_rdp.sampled_gaussian_rdp_upper`) or ``"auto"`` (default):
exact for the first ``exact_keys`` distinct (σ, q) of the run; any further one gets the chord
bound at (σ, q) rounded to the :data:`AUTO_QUANTUM` grid (σ down, q up), so a σ or q that
drifts every step costs one chord evaluation per 0.5 % of drift. A run with constant σ (or a
few phases) is thus exact, and one whose σ or q changes every step pays tens of microseconds
per new grid cell instead of milliseconds. Every choice is an upper bound on each step's
RDP, so the sum stays a valid bound; the choice depends only on the order of the releases, so
rebuilding from the ledger gives the same total.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from lightning_dp.accounting.rdp import RDP_ORDERS, STEP_CACHE, conversion_offsets, epsilon_from_offsets
from lightning_dp.accounting.sgm_rdp import check_curve

_CONVERSIONS = ("balle", "mironov")

#: With ``curve="auto"``, the (σ, q) beyond the first ``exact_keys`` are rounded (σ down, q up)
#: to this relative grid before the chord bound is looked up: a σ or q that drifts every step
#: then costs one evaluation per 0.5 % of drift (per-step RDP ≤ ~1 % higher for those steps).
AUTO_QUANTUM = 5e-3


def _grid_down(x: float, quantum: float) -> float:
    k = math.floor(math.log(x) / math.log1p(quantum))
    g = (1.0 + quantum) ** k
    while g > x:  # guard against rounding in log/pow
        k -= 1
        g = (1.0 + quantum) ** k
    return g


def _grid_up(x: float, quantum: float) -> float:
    k = math.ceil(math.log(x) / math.log1p(quantum))
    g = (1.0 + quantum) ** k
    while g < x:
        k += 1
        g = (1.0 + quantum) ** k
    return min(g, 1.0)


class RunningRDP:
    """Per-order RDP total of the releases seen so far; ε(δ) from it in microseconds.

    Example:
        >>> run = RunningRDP()
        >>> run.add(1.1, 0.004, steps=1000)
        >>> round(run.epsilon(1e-5), 3)  # doctest: +SKIP
        0.763

    Args:
        orders: RDP orders (default: Opacus' default orders).
        quantum: ``None`` for exact accounting, or the relative grid spacing (e.g. 1e-3)
            used to round σ down / q up for cheap, conservative updates (module docstring).
        conversion: ``"balle"`` (Balle et al. 2020, Thm. 21; Opacus' conversion) or
            ``"mironov"`` (Mironov 2017, Prop. 3; with :data:`INTEGER_ORDERS` this is the
            ``"integer_rdp"`` accountant of the DP-SignSGD paper).
        curve: ``"auto"`` (default), ``"exact"`` or ``"chord"`` (module docstring).
        exact_keys: with ``curve="auto"``, how many distinct (σ, q) get the exact curve.
    """

    def __init__(
        self,
        orders: Sequence[float] = RDP_ORDERS,
        quantum: Optional[float] = None,
        conversion: str = "balle",
        curve: str = "auto",
        exact_keys: int = 4,
    ) -> None:
        if quantum is not None and not quantum > 0:
            raise ValueError(f"quantum must be None (exact) or > 0, got {quantum!r}")
        if conversion not in _CONVERSIONS:
            raise ValueError(f"conversion must be one of {sorted(_CONVERSIONS)}, got {conversion!r}")
        if curve != "auto":
            check_curve(curve)
        if int(exact_keys) != exact_keys or exact_keys < 0:
            raise ValueError(f"exact_keys must be an integer >= 0, got {exact_keys!r}")
        self.orders: tuple[float, ...] = tuple(float(a) for a in orders)
        self.quantum = quantum
        self.conversion = conversion
        self.curve = curve
        self.exact_keys = int(exact_keys)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything (an empty run)."""
        self._total = np.zeros(len(self.orders))
        self.steps = 0
        self.private = True
        self._seen = 0  # number of ledger entries (partly) consumed
        self._last: Optional[tuple[float, float, bool]] = None  # key of entry _seen - 1
        self._last_steps = 0  # steps consumed from entry _seen - 1
        self._verify = False
        self._memo: Optional[tuple[float, float, int]] = None  # (σ, q, len(_exact)) of _memo_value
        self._memo_value = np.zeros(len(self.orders))
        self._exact: set[tuple[float, float]] = set()  # (σ, q) given the exact curve ("auto")
        self._offsets: dict[float, np.ndarray] = {}  # conversion offsets per δ

    def charge_key(self, noise_multiplier: float, sample_rate: float) -> tuple[float, float, str]:
        """(σ', q', curve) whose one-step vector a release of (σ, q) is charged now: (σ, q)
        rounded to the ``quantum`` grid if set, the curve by ``curve`` (for ``"auto"``: exact for
        the first ``exact_keys`` distinct (σ, q), else the chord at the :data:`AUTO_QUANTUM` cell)."""
        sigma, q = noise_multiplier, sample_rate
        positive = sigma > 0 and q > 0
        if self.quantum is not None and positive:
            sigma, q = _grid_down(sigma, self.quantum), _grid_up(q, self.quantum)
        if self.curve != "auto":
            return sigma, q, self.curve
        if (sigma, q) in self._exact or len(self._exact) < self.exact_keys:
            return sigma, q, "exact"
        if self.quantum is None and positive:  # many (σ, q): share grid cells
            sigma, q = _grid_down(sigma, AUTO_QUANTUM), _grid_up(q, AUTO_QUANTUM)
        return sigma, q, "chord"

    def one_step(self, noise_multiplier: float, sample_rate: float) -> np.ndarray:
        """The one-step RDP vector a release of (σ, q) is charged (:meth:`charge_key`).

        The same (σ, q) as the previous call returns the same array object without a lookup."""
        memo = (noise_multiplier, sample_rate, len(self._exact))
        if memo != self._memo:
            sigma, q, curve = self.charge_key(noise_multiplier, sample_rate)
            self._memo, self._memo_value = memo, STEP_CACHE.get(sigma, q, self.orders, curve)
        return self._memo_value

    def bound_step(self, min_noise_multiplier: float, max_sample_rate: float) -> np.ndarray:
        """A one-step vector ≥ the charge (:meth:`one_step`) of every (σ, q) with σ ≥ ``min_noise_multiplier``
        and q ≤ ``max_sample_rate``, whatever the curve and however many exact keys are used.

        It is the chord at the corner rounded down (σ) / up (q) to the ``quantum`` grid and then
        the :data:`AUTO_QUANTUM` grid: every charged (σ', q') in the box has σ' at or above that
        corner and q' at or below it (rounding is monotone), the exact curve is below the chord,
        and both are non-increasing in σ and non-decreasing in q at every order.
        """
        sigma, q = min_noise_multiplier, min(max_sample_rate, 1.0)
        if not (sigma > 0 and q > 0):
            return self.one_step(sigma, q)  # σ = 0: inf; q = 0: nothing released
        if self.quantum is not None:
            sigma, q = _grid_down(sigma, self.quantum), _grid_up(q, self.quantum)
        return STEP_CACHE.get(_grid_down(sigma, AUTO_QUANTUM), _grid_up(q, AUTO_QUANTUM), self.orders, "chord")

    def add(self, noise_multiplier: float, sample_rate: float, steps: int = 1, private: bool = True) -> None:
        """Compose ``steps`` releases of (σ, q) into the total (not tied to a ledger)."""
        self._add_many(((noise_multiplier, sample_rate, steps, private),))

    def _add_many(self, releases: Sequence[tuple[float, float, int, bool]]) -> None:
        """:meth:`add` for each release in order, with the missing one-step vectors evaluated
        in one batch per curve and the total updated once."""
        counts: dict[tuple[float, float, str], int] = {}
        for sigma, q, steps, private in releases:
            if steps <= 0:
                continue
            self.steps += int(steps)
            if not private:
                self.private = False
                continue
            key = self.charge_key(sigma, q)
            if self.curve == "auto" and key[2] == "exact":
                self._exact.add(key[:2])
            counts[key] = counts.get(key, 0) + int(steps)
        if not counts:
            return
        update = np.zeros(len(self.orders))
        for curve in sorted({key[2] for key in counts}):  # a fixed order: every DDP rank sums alike
            keys = [key for key in counts if key[2] == curve]
            vectors = STEP_CACHE.get_many([key[:2] for key in keys], self.orders, curve)
            update += np.array([counts[key] for key in keys], dtype=float) @ np.stack(vectors)
        self._total = self._total + update

    @property
    def total(self) -> np.ndarray:
        """The per-order RDP total of every release added so far."""
        return self._total

    def affordable_steps(self, delta: float, target_epsilon: float, step: np.ndarray) -> int:
        """The most further releases, each charged at most ``step`` per order (e.g.
        :meth:`one_step` or :meth:`bound_step`), after which ε(δ) stays ≤ ``target_epsilon``.

        ε(total + n·r) = min_α (total_α + n·r_α + offset_α) (:func:`rdp_to_epsilon`), so per
        order n_α = ⌊(target − offset_α − total_α) / r_α⌋ and the answer is max_α n_α (checked
        against ε itself, so it agrees with :meth:`epsilon_after` at the boundary). ``inf``-free:
        a step that costs nothing gives a very large number.
        """
        if not self.private:
            return 0
        offsets = self._offsets_for(delta)
        room = target_epsilon - offsets - self._total
        with np.errstate(divide="ignore", invalid="ignore"):
            per_order = np.where(step > 0, np.floor(room / step), np.where(room >= 0, np.inf, -1.0))
        best = float(np.nanmax(per_order)) if np.any(~np.isnan(per_order)) else -1.0
        n = int(min(max(best, -1.0), 2**62))

        def eps(k: int) -> float:
            return epsilon_from_offsets(self._total + k * step if k else self._total, offsets)

        while n >= 0 and eps(n) > target_epsilon:
            n -= 1  # floating-point guard: never promise a step ε would refuse
        while n < 2**62 and eps(n + 1) <= target_epsilon:
            n += 1
        return max(n, 0)

    # ----------------------------------------------------------------- ledger
    def sync(self, ledger: PrivacyLedger | Iterable[LedgerEntry]) -> int:
        """Fold in the ledger's releases not seen yet; returns how many steps were added.

        Only new entries (and the growth of the last, run-length merged entry) are read and
        composed, in one batch. If the ledger no longer extends what was seen (replaced,
        cleared, restored from another checkpoint), the total is rebuilt from scratch.
        """
        if isinstance(ledger, PrivacyLedger):
            length, tail = len(ledger), ledger.entries_since(self._seen - 1)
        else:
            entries = tuple(ledger)
            length, tail = len(entries), entries[max(0, self._seen - 1) :]
        if not self._consistent(ledger, length, tail):
            self.reset()
            tail = ledger.entries if isinstance(ledger, PrivacyLedger) else tuple(ledger)
        before = self.steps
        releases = [(e.noise_multiplier, e.sample_rate, e.steps, e.private) for e in tail]
        if self._seen and releases:  # the last entry seen: only its growth is new
            sigma, q, steps, private = releases[0]
            releases[0] = (sigma, q, steps - self._last_steps, private)
        self._add_many(releases)
        if tail:
            last = tail[-1]
            self._seen = length
            self._last = (last.noise_multiplier, last.sample_rate, last.private)
            self._last_steps = last.steps
        return self.steps - before

    def _consistent(self, ledger: Any, length: int, tail: Sequence[LedgerEntry]) -> bool:
        if self._seen == 0:
            return self.steps == 0
        if length < self._seen:
            return False
        e = tail[0]
        if (e.noise_multiplier, e.sample_rate, e.private) != self._last or e.steps < self._last_steps:
            return False
        if self._verify:  # first sync after load_state_dict: check the step count fully
            self._verify = False
            entries = ledger.entries if isinstance(ledger, PrivacyLedger) else tuple(ledger)
            seen = sum(x.steps for x in entries[: self._seen - 1]) + self._last_steps
            return seen == self.steps
        return True

    # --------------------------------------------------------------- epsilon
    def epsilon(self, delta: float) -> float:
        """ε(δ) of the total (Balle et al. 2020 conversion); ``inf`` if a release was not private."""
        if not self.private:
            return float("inf")
        return epsilon_from_offsets(self._total, self._offsets_for(delta))

    def _offsets_for(self, delta: float) -> np.ndarray:
        offsets = self._offsets.get(delta)
        if offsets is None:
            offsets = self._offsets[delta] = conversion_offsets(self.orders, delta, self.conversion)
        return offsets

    def epsilon_after(self, delta: float, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """ε(δ) if ``steps`` more releases with (σ, q) were made (the total is not changed)."""
        if not self.private:
            return float("inf")
        total = self._total + steps * self.one_step(noise_multiplier, sample_rate)
        return epsilon_from_offsets(total, self._offsets_for(delta))

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Serialisable state (the total and how far into the ledger it reaches)."""
        return {
            "orders": list(self.orders),
            "quantum": self.quantum,
            "conversion": self.conversion,
            "curve": self.curve,
            "exact_keys": self.exact_keys,
            "exact": sorted([list(k) for k in self._exact]),
            "total": [float(x) for x in self._total],
            "steps": self.steps,
            "private": self.private,
            "seen": self._seen,
            "last": list(self._last) if self._last is not None else None,
            "last_steps": self._last_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved total; the next :meth:`sync` verifies it against the ledger
        (and rebuilds from the ledger if they disagree)."""
        self.orders = tuple(float(a) for a in state["orders"])
        self._offsets = {}
        self._memo = None
        self.quantum = state.get("quantum")
        self.conversion = state.get("conversion", "balle")
        self.curve = state.get("curve", "exact")  # states saved before curves existed were exact
        self.exact_keys = int(state.get("exact_keys", 4))
        self._exact = {(float(s), float(q)) for s, q in state.get("exact", [])}
        self._total = np.asarray(state["total"], dtype=float)
        self.steps = int(state["steps"])
        self.private = bool(state["private"])
        self._seen = int(state["seen"])
        last = state["last"]
        self._last = (float(last[0]), float(last[1]), bool(last[2])) if last is not None else None
        self._last_steps = int(state["last_steps"])
        self._verify = True


def running_for(accountant: str, quantum: Optional[float] = None, curve: str = "auto") -> Optional[RunningRDP]:
    """The :class:`RunningRDP` that reproduces ``accountant`` incrementally, or ``None``.

    ``"rdp"`` → Opacus' orders with the Balle et al. conversion; ``"integer_rdp"`` →
    integer orders 2..20 with Mironov's conversion. PLD/PRV have no running form.
    """
    from lightning_dp.accounting.rdp import INTEGER_ORDERS

    if accountant == "rdp":
        return RunningRDP(RDP_ORDERS, quantum, curve=curve)
    if accountant == "integer_rdp":
        return RunningRDP(INTEGER_ORDERS, quantum, conversion="mironov", curve=curve)
    return None
