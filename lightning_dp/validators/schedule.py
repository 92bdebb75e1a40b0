"""When the batch check (:mod:`.batch_check`) runs: on the first step, then at random later steps within a cost cap.

``verify="sampled"`` (the default): the first step's batch is always checked (with the first probe, before the
first release). Later, every step earns ``budget × its duration`` of credit; a check runs when the credit reaches a
random threshold drawn after each check, exponential with mean the last check's duration, and costs its duration.
On average the checks then take ``budget`` of the training time (default 2 %), at times nobody can predict (a
behaviour that switches on at a fixed step is met at a random later step, never at a fixed period), and checks are
denser when they are cheap relative to a step. Besides, one step drawn at random in each doubling window of steps
([1, 2), [2, 4), [4, 8), …, counted from the first) is checked whatever the credit (and paid from it): a behaviour
that switches on at step k and stays is met by step 4k at the latest even in a run too short for the budget to
buy a check, for log₂ T checks in T steps. ``"every_step"`` checks every step (a batch check costs about two
steps); ``"first_step"`` only the first (the behaviour before this setting existed). The times come from the OS
clock and the choice from an OS-seeded generator: nothing here depends on the data.
"""

from __future__ import annotations

import random
import time
from typing import Literal, Optional

Verify = Literal["first_step", "sampled", "every_step"]
VERIFY_MODES: tuple[str, ...] = ("first_step", "sampled", "every_step")


def check_verify(mode: str, budget: float) -> None:
    """Refuse an unknown mode or a budget outside (0, 1] (``ValueError``)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    if not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ValueError(f"verify_budget must be a fraction of the training time in (0, 1], got {budget!r}")


class VerificationSchedule:
    """Decides, step by step, whether the batch check runs (module docstring).

    Args:
        mode: ``"first_step"``, ``"sampled"`` or ``"every_step"``.
        budget: the share of training time the later checks may take (``"sampled"``).
        rng: the random choice (default: OS-seeded).
        clock: seconds (default ``time.perf_counter``).
    """

    def __init__(self, mode: str = "sampled", budget: float = 0.02, rng: Optional[random.Random] = None,
                 clock=time.perf_counter) -> None:
        check_verify(mode, budget)
        self._mode, self._budget = mode, float(budget)
        self.rng = rng or random.Random()
        self.clock = clock
        self.checks = 0
        """Batch checks run so far."""
        self._credit = 0.0
        self._threshold: Optional[float] = None
        self._last: Optional[float] = None
        self._checking = 0.0
        self._step_seconds: Optional[float] = None  # a running mean of a step's duration (checks excluded)
        self._check_seconds: Optional[float] = None  # a running mean of a later check's duration
        self._forced = False
        self._steps = 0  # steps begun (calls of :meth:`due`)
        self._window_pick: Optional[int] = None  # the step checked in the current doubling window

    @property
    def mode(self) -> str:
        """``"first_step"``, ``"sampled"`` or ``"every_step"`` (read-only: a run's checks are not switched off)."""
        return self._mode

    @property
    def budget(self) -> float:
        """The share of training time the later checks may take (read-only)."""
        return self._budget

    def at_least(self, mode: str, budget: float) -> bool:
        """Whether this schedule checks at least as often as ``mode`` with ``budget`` would (the same mode, no smaller
        budget; ``"every_step"`` checks every step whatever the other's)."""
        return self._mode == "every_step" or (self._mode == mode and self._budget >= budget)

    def due(self) -> bool:
        """Whether the step starting now is checked (call once per step, before the check)."""
        now = self.clock()
        if self._last is not None:
            elapsed = max(0.0, now - self._last - self._checking)
            self._credit += self.budget * elapsed
            self._step_seconds = elapsed if self._step_seconds is None else 0.9 * self._step_seconds + 0.1 * elapsed
        self._last, self._checking = now, 0.0
        step, self._steps = self._steps, self._steps + 1
        if self.mode == "every_step" or self.checks == 0:
            return True
        if self.mode == "sampled" and (self._forced or self._window_checks(step)):
            self._forced = False
            return True
        if self.mode == "first_step" or self._step_seconds is None:
            return False
        if self._threshold is None:
            expected = self._check_seconds if self._check_seconds is not None else 2.0 * self._step_seconds
            self._threshold = self.rng.expovariate(1.0 / max(expected, 1e-9))
        return self._credit >= self._threshold

    def _window_checks(self, step: int) -> bool:
        """Whether ``step`` is the one drawn in its doubling window [2ʲ, 2ʲ⁺¹) (drawn as the window opens)."""
        if step >= 1 and step & (step - 1) == 0:  # a power of two: a window opens
            self._window_pick = self.rng.randrange(step, 2 * step)
        return step == self._window_pick

    def force(self) -> None:
        """The next step is checked (``"sampled"``): an epoch begins, a validation ended — where behaviour keyed on
        the user's own counters or flags switches on (centring the batch from an epoch on, after a validation). Paid
        from the credit like the others."""
        self._forced = True

    def checked(self, seconds: float) -> None:
        """A check ran for ``seconds``: it is paid from the credit and the next threshold will be drawn. The first
        check is free and not taken as the typical cost (it pays for first-call warm-ups); until a later one is
        measured a check is reckoned at two steps (three passes over at most the batch)."""
        if self.checks > 0:
            self._credit -= seconds
            self._check_seconds = (seconds if self._check_seconds is None
                                   else 0.8 * self._check_seconds + 0.2 * seconds)
        self.checks += 1
        self._checking += seconds
        self._threshold = None
