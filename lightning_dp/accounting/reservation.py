"""Stop before the budget is exceeded, in O(1) Python work per step: reserve budget for a box of (σ, q).

:class:`~lightning_dp.callbacks.PrivacyBudget` must decide after every step whether the next
one keeps ε ≤ target ("a step that would exceed it is never taken"). Asking the running RDP
total every time means folding the new step in and converting to ε — a handful of numpy calls,
0.1–0.4 ms right after a training step, plus a new one-step curve whenever σ or q moved.
Instead, a *reservation* is made rarely and checked cheaply:

* From the exact total T at ledger step s₀ and a box B = {σ ≥ σ_min, q ≤ q_max} around the
  current (σ, q), take r̄ = :meth:`RunningRDP.bound_step` (σ_min, q_max) — per order at least the
  charge of any release in B — and K = :meth:`RunningRDP.affordable_steps` (δ, ε*, r̄). Any K
  releases from B leave ε(T + Σ rᵢ) ≤ ε(T + K·r̄) ≤ ε*, because ε = min_α (RDP_α + offset_α)
  is non-decreasing in every order's RDP (Balle et al. 2020, Thm. 21; docs/algorithms.md, "The ε ceiling").
* While every release since s₀ stayed in B and fewer than K were made, the next step is
  allowed after two float and one integer comparison. Otherwise a new reservation is made
  from the synced total. If the box leaves no step (K = 0) but is wider than a point, the next
  step is checked exactly (ε after one more release of the current (σ, q)), so training stops
  at exactly the step the exact per-step check would stop at.

The box adapts to the run. With constant (σ, q) it is that single point (r̄ is the exact
charge and K the exact horizon: one reservation per run). The margin σ_min = σ(1 − m_σ) starts
at :data:`FIRST_MARGIN` the first time σ drops out of the box and doubles at every further
exit, up to :data:`MAX_MARGIN`; likewise q_max = q(1 + m_q). Both halve when a reservation is
used up with (σ, q) still inside (near the end of the budget a tight box gives more steps).
A σ decaying or q ramping every step thus costs one reservation per few hundred steps, and
random jumps one per exit until the margins cover them.
"""

from __future__ import annotations

from typing import Optional

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.running_rdp import RunningRDP

#: Relative margin of the box the first time σ (q) leaves it; then doubled per exit.
FIRST_MARGIN = 5e-3
#: Largest relative margin of the box.
MAX_MARGIN = 0.25


class BudgetReservation:
    """Answer "does one more release keep ε(δ) ≤ target?" for a run fed from a ledger.

    Example:
        >>> from lightning_dp.accounting import PrivacyLedger, RunningRDP
        >>> ledger, guard = PrivacyLedger(), BudgetReservation(RunningRDP(), delta=1e-5, target_epsilon=1.0)
        >>> while guard.allows_next(ledger, 1.1, 0.004):
        ...     ledger.record(1.1, 0.004)
        >>> ledger.steps, guard.reservations  # the last step with ε ≤ 1; the total was read twice
        (1971, 2)

    Args:
        running: the running RDP total that the budget is measured with (synced from the
            ledger only when a reservation is made).
        delta: δ of the (ε, δ) target.
        target_epsilon: ε that no step may exceed.
    """

    def __init__(self, running: RunningRDP, delta: float, target_epsilon: float) -> None:
        self.running = running
        self.delta = float(delta)
        self.target_epsilon = float(target_epsilon)
        self.reservations = 0  # how many were made (the expensive path), for tests and benchmarks
        self.margin_sigma = 0.0
        self.margin_q = 0.0
        self.reset()

    def reset(self) -> None:
        """Drop the current reservation (the ledger or the total was replaced); margins are kept."""
        self._limit = -1  # ledger step count up to which releases are covered
        self._point: Optional[tuple[float, float]] = None  # the box when it is one (σ, q) …
        self._sigma_min, self._q_max = float("inf"), -1.0  # … else σ ≥ σ_min, q ≤ q_max
        self._index, self._index_steps = 0, 0  # ledger position checked up to

    def allows_next(self, ledger: PrivacyLedger, noise_multiplier: float, sample_rate: float) -> bool:
        """Whether one more release of (σ, q) after the ledger's keeps ε(δ) ≤ target."""
        if not ledger.is_private:
            return False  # ε = inf
        sigma, q = noise_multiplier, sample_rate
        if self._limit >= 0:
            recorded_inside = self._recorded_inside(ledger)
            if recorded_inside and self._inside(sigma, q):
                if ledger.steps < self._limit:
                    return True
                self.margin_sigma, self.margin_q = _halve(self.margin_sigma), _halve(self.margin_q)
            else:
                self._widen(sigma, q, recorded_outside=not recorded_inside)
        return self._reserve(ledger, sigma, q)

    # --------------------------------------------------------------- helpers
    def _inside(self, sigma: float, q: float) -> bool:
        if self._point is not None:
            return (sigma, q) == self._point  # a point box covers its own charge only
        return sigma >= self._sigma_min and q <= self._q_max

    def _recorded_inside(self, ledger: PrivacyLedger) -> bool:
        """Every release recorded since the last check lies in the box (σ or q may have been
        changed after the check, before the step). Reads only the entries since then."""
        last, start = len(ledger) - 1, self._index
        changed = last < start or ledger[start].steps < self._index_steps  # ledger replaced: reserve anew
        fresh = (ledger[i] for i in range(start, last + 1) if i > start or ledger[i].steps > self._index_steps)
        inside = not changed and all(self._inside(e.noise_multiplier, e.sample_rate) for e in fresh)
        self._mark(ledger)
        return inside

    def _mark(self, ledger: PrivacyLedger) -> None:
        last = len(ledger) - 1
        self._index, self._index_steps = max(last, 0), ledger[last].steps if last >= 0 else 0

    def _widen(self, sigma: float, q: float, recorded_outside: bool) -> None:
        """Grow the margin in each direction (σ down, q up) that (σ, q) left the box in."""
        sigma_min, q_max = self._point if self._point is not None else (self._sigma_min, self._q_max)
        below, above = sigma < sigma_min, q > q_max
        if recorded_outside:
            below = above = True  # a release outside the box was recorded: widen both
        elif not (below or above):
            below = True  # a point box left towards cheaper releases: any margin covers those
        if below:
            self.margin_sigma = min(2.0 * self.margin_sigma, MAX_MARGIN) if self.margin_sigma else FIRST_MARGIN
        if above:
            self.margin_q = min(2.0 * self.margin_q, MAX_MARGIN) if self.margin_q else FIRST_MARGIN

    def _reserve(self, ledger: PrivacyLedger, sigma: float, q: float) -> bool:
        """Sync the total, reserve the steps affordable for the box around (σ, q), answer for one step."""
        run = self.running
        run.sync(ledger)
        self.reservations += 1
        point = not (self.margin_sigma or self.margin_q)
        if point:
            step = run.one_step(sigma, q)
        else:
            sigma_min, q_max = sigma * (1.0 - self.margin_sigma), q * (1.0 + self.margin_q)
            step = run.bound_step(sigma_min, q_max)
        n = run.affordable_steps(self.delta, self.target_epsilon, step)
        self.reset()
        self._mark(ledger)
        if n == 0 and not point:  # the box is too coarse for the last step: ask exactly
            return run.epsilon_after(self.delta, sigma, q) <= self.target_epsilon
        if point:
            self._point = (sigma, q)
        else:
            self._sigma_min, self._q_max = sigma_min, q_max
        self._limit = ledger.steps + n
        return n >= 1


def _halve(margin: float) -> float:
    return margin / 2.0 if margin / 2.0 >= FIRST_MARGIN else 0.0
