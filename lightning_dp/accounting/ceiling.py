"""The one ε ceiling: may the next release be made without ε exceeding the target?

Every target a run has is one :class:`EpsilonCeiling` over the private step's ledger (docs/algorithms.md,
"The ε ceiling"): a release of ``rounds`` sampled-Gaussian rounds at (σ, q) (docs/algorithms.md, "The mechanism") is
allowed when ε(ledger followed by the release; δ) ≤ ε* by the ceiling's accountant. Who adds one:

* the private step itself, for its own ``target_epsilon`` (``DPStrategy(target_epsilon=...)``,
  ``PrivateStep.refusal``), with the run's δ and accountant;
* :class:`~lightning_dp.callbacks.PrivacyBudget` ``(target_epsilon=...)``, into ``PrivateStep.ceilings`` for the
  fit, at its δ and ``stop_accountant``; it asks the same object after each step to stop and say so.

The step refuses a release if any ceiling refuses it, with that ceiling's reason; the strategies ask only the step.

How a release is decided (O(1) Python work per step almost always; exact at the boundary):

1. **Fast path.** A :class:`~lightning_dp.accounting.reservation.BudgetReservation` over a running RDP total
   reserves K further releases for a box of (σ, q) and then answers "yes" after a few comparisons
   (ε(T + K·r̄) ≤ ε* with r̄ ≥ every charge in the box: docs/algorithms.md, "The ε ceiling").
2. **Its answer is final** when the running total is the accountant's own running form
   (:func:`~lightning_dp.accounting.running_rdp.running_for`: ``"rdp"``, ``"integer_rdp"``): the reservation checks the
   last step exactly. The step's own ceiling keeps that total on the exact curve, so it allows exactly what
   :func:`~lightning_dp.accounting.epsilon.ledger_epsilon` allows. PrivacyBudget's total is the one it reports
   with (``rdp_curve``, ``rdp_quantum``), so its stop agrees with the ε it shows.
3. **Otherwise** (``"pld"``, ``"prv"``, or an RDP total asked for another accountant) the accountant decides, so
   that the ε it reports never passes the target: the rounds left at (σ, q), k* = max{k : ε(ledger + k·(σ, q)) ≤ ε*}
   (:func:`~lightning_dp.accounting.horizon.steps_within_budget`), searched once per (σ, q) and counted down as
   releases at that (σ, q) are recorded.

A σ or q changed between two steps (a schedule, a recalibration) is simply the (σ, q) of the next question: every
release is judged with its own.
"""

from __future__ import annotations

from typing import Callable, Optional

from lightning_dp.accounting.accountants import get_accountant
from lightning_dp.accounting.checks import check_delta, check_target_epsilon
from lightning_dp.accounting.epsilon import ledger_epsilon
from lightning_dp.accounting.horizon import steps_within_budget
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from lightning_dp.accounting.reservation import BudgetReservation
from lightning_dp.accounting.running_rdp import RunningRDP, running_for

Spent = Callable[[], "tuple[float, str]"]
"""How a ceiling states what is spent in its reason: (ε, the accountant's name)."""


class EpsilonCeiling:
    """``target_epsilon`` at ``delta`` by ``accountant``, over ``ledger``: the one question asked before a release.

    Example:
        >>> from lightning_dp.accounting import PrivacyLedger
        >>> ledger = PrivacyLedger()
        >>> ceiling = EpsilonCeiling(1.0, 1e-5, ledger)
        >>> while ceiling.refusal(1.1, 0.004) is None:
        ...     ledger.record(1.1, 0.004)
        >>> ledger.steps  # the last release with ε ≤ 1
        1971

    Args:
        target_epsilon: ε* that no release may take ε past.
        delta: δ of the target.
        ledger: the releases made so far (the private step's); read, never written.
        accountant: the accountant ε is measured by (module docs).
        running: the running RDP total of the fast path (default: the accountant's own running form on the exact
            curve, or an RDP total for ``"pld"``/``"prv"``). PrivacyBudget passes the total it reports with.
        owner: how the target is named in the reason (``"target_epsilon"``, ``"PrivacyBudget's target_epsilon"``).
        spent: how the reason states ε spent (default: :meth:`spent` by ``accountant``).
    """

    def __init__(self, target_epsilon: float, delta: float, ledger: PrivacyLedger, accountant: str = "rdp", *,
                 running: Optional[RunningRDP] = None, owner: str = "target_epsilon",
                 spent: Optional[Spent] = None) -> None:
        get_accountant(accountant)  # an unknown name: ValueError naming the choices
        self.target_epsilon = check_target_epsilon(target_epsilon)
        self.delta = check_delta(delta)
        self.ledger = ledger
        self.accountant = accountant
        own = running_for(accountant, curve="exact")
        self.running = running if running is not None else own or RunningRDP()
        self.final = own is not None and (own.orders, own.conversion) == (self.running.orders, self.running.conversion)
        """The reservation's answer is the accountant's (module docs, 2); else the accountant decides what RDP
        does not certify (3)."""
        self.reservation = BudgetReservation(self.running, self.delta, self.target_epsilon)
        self.owner = owner
        self._spent_by = spent
        self._horizon: Optional[tuple[tuple[float, float], int, int, Optional[LedgerEntry], int]] = None
        self._spent: Optional[tuple[tuple[int, int], float]] = None  # (ledger (entries, steps), ε) of the last spent()

    def allows(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> bool:
        """Whether ``rounds`` more releases of (σ, q) after the ledger keep ε(δ) ≤ ``target_epsilon`` (module
        docs). No round (a banded cycle's later steps, q = 0) spends nothing; a non-private ledger (ε = ∞) allows
        none."""
        sigma, q, ledger = noise_multiplier, sample_rate, self.ledger
        if rounds <= 0 or q == 0:
            return True
        if not ledger.is_private or not sigma > 0:
            return False
        if not self.final:  # the accountant's own count, so that the ε it reports never passes the target
            return rounds <= self.rounds_left(sigma, q, hint=rounds)
        if rounds == 1:
            return self.reservation.allows_next(ledger, sigma, q)  # exact at the boundary (module docs, 2)
        self.running.sync(ledger)
        return self.running.epsilon_after(self.delta, sigma, q, rounds) <= self.target_epsilon

    def refusal(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> Optional[str]:
        """Why a release of ``rounds`` rounds at (σ, q) must not be made now (``None``: :meth:`allows` it)."""
        if self.allows(noise_multiplier, sample_rate, rounds):
            return None
        spent, accountant = self._spent_by() if self._spent_by is not None else (self.spent(), self.accountant)
        return (f"its release at σ = {noise_multiplier:.4g}, q = {sample_rate:.4g} would spend more than "
                f"{self.owner} = {self.target_epsilon} (ε = {spent:.4g} spent at δ = {self.delta:.3g} over "
                f"{self.ledger.steps} release(s), {accountant} accountant)")

    def rounds_left(self, noise_multiplier: float, sample_rate: float, hint: int = 2) -> int:
        """k* = max{k ≥ 0 : ε(ledger + k·(σ, q)) ≤ ``target_epsilon``} by the accountant (docs/algorithms.md,
        "The ε ceiling"). A running accountant reads it off the synced total
        (:meth:`~lightning_dp.accounting.running_rdp.RunningRDP.affordable_steps`); PLD/PRV search it
        (:func:`~lightning_dp.accounting.horizon.steps_within_budget`, ``hint`` a guess of k*) once per (σ, q),
        then count it down by the releases at (σ, q) recorded since."""
        sigma, q, ledger = noise_multiplier, sample_rate, self.ledger
        if not ledger.is_private or not sigma > 0:
            return 0
        if self.final:
            self.running.sync(ledger)
            return self.running.affordable_steps(self.delta, self.target_epsilon, self.running.one_step(sigma, q))
        since = self._recorded_since(sigma, q)
        if since is not None:
            assert self._horizon is not None
            left = max(self._horizon[4] - since, 0)
        else:
            left = steps_within_budget(ledger, sigma, q, self.target_epsilon, self.delta, self.accountant,
                                       hint=max(2, hint, ledger.steps // 8))
        tail = ledger[-1] if len(ledger) else None
        self._horizon = ((sigma, q), len(ledger), ledger.steps, tail, left)
        return left

    def _recorded_since(self, sigma: float, q: float) -> Optional[int]:
        """Releases recorded since the last search at (σ, q), when they are all at (σ, q) (``None``: search again)."""
        if self._horizon is None or self._horizon[0] != (sigma, q):
            return None
        _, length, steps, tail, _ = self._horizon
        ledger, grown = self.ledger, self.ledger.steps - steps
        if (len(ledger), grown) == (length, 0):
            return 0
        last = ledger[-1] if len(ledger) else None
        if grown <= 0 or last is None or (last.noise_multiplier, last.sample_rate, last.private) != (sigma, q, True):
            return None
        if len(ledger) == length and tail is not None and last.steps == tail.steps + grown:
            same = (tail.noise_multiplier, tail.sample_rate, tail.private) == (sigma, q, True)
        else:  # one new entry, after the tail seen then
            same = len(ledger) == length + 1 and last.steps == grown and (not length or ledger[length - 1] == tail)
        return grown if same else None

    def spent(self) -> float:
        """ε(δ) of the ledger by the accountant (:func:`~lightning_dp.accounting.epsilon.ledger_epsilon`; kept until
        the ledger grows)."""
        key = (len(self.ledger), self.ledger.steps)
        if self._spent is None or self._spent[0] != key:
            self._spent = (key, ledger_epsilon(self.ledger, self.delta, self.accountant))
        return self._spent[1]
