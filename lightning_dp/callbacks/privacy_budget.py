"""PrivacyBudget: report what a run has spent, and stop before it overspends.

Reads the :class:`~lightning_dp.accounting.PrivacyLedger` that :class:`DPStrategy` keeps
(one entry per release of the sampled Gaussian mechanism, ALGORITHMS.md "The mechanism")
and logs ``privacy/epsilon`` (progress bar and loggers, through ``pl_module.log``), and
``privacy/delta``, ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/steps``
(straight to the trainer's loggers), every ``log_every_n_steps``.

Accounting. A running per-order RDP total (:class:`~lightning_dp.accounting.RunningRDP`) is
synced from *new* ledger entries only, and only when something needs it: when ε is read
(logging, :attr:`epsilon`, end of training, checkpoints) or a stop reservation is made. A new
(σ, q) costs one vectorised evaluation of Opacus' RDP series (1–4 ms) for the first 4 distinct
ones, then the chord upper bound at (σ, q) rounded to a 0.5 % grid (~50 µs per new cell,
batched over the entries of one sync; ``rdp_curve``, :mod:`~lightning_dp.accounting.sgm_rdp`).
``"pld"`` / ``"prv"`` compose the whole ledger (0.1 s to seconds), so they report every
``every_n_steps`` (default 100) and at the end of training.

Stopping (with ``target_epsilon``). After each step, whether one more step with the strategy's
current (σ, q) keeps ε ≤ target is answered by a :class:`~lightning_dp.accounting.BudgetReservation`:
budget reserved for a box of (σ, q) around the current one, re-made only when (σ, q) leaves the
box or the reserved steps are used up (constant σ and q: once per run; σ or q changing every
step: about once per hundred steps), and checked exactly for the last step. Training thus ends
at the last step whose ε stays ≤ target, for a few comparisons per step. σ and q must be set
before ``on_train_batch_end`` of the step before they are used (a release recorded outside the
box cancels the reservation). With banded noise only the first step of each cycle of b steps is
charged a round (``DPStrategy.rounds_charged_next_step``), so the steps inside the last
affordable cycle are all taken. The decision uses ``stop_accountant`` (default ``"rdp"``: the
running total, cheap and a valid upper bound). With ``stop_accountant="pld"`` or ``"prv"``, a
step is taken if RDP *or* the tighter accountant certifies it (both are valid bounds); once RDP
refuses, the number of remaining steps under the current (σ, q) is searched once with the
tighter accountant (a few seconds to a minute) and recomputed only if σ or q changes. A budget
too small for the first step raises ``ValueError`` at ``on_train_start``, before any step; a
resumed run with no budget left stops at once.

Non-private runs (the noiseless baseline, ALGORITHMS.md §5) report ε = inf with a warning.
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dp.accounting import (
    BudgetReservation,
    LedgerEntry,
    PrivacyLedger,
    RunningRDP,
    get_accountant,
    ledger_epsilon,
    running_for,
    steps_within_budget,
)
from lightning_dp.accounting.checks import check_delta, check_target_epsilon

_RUNNING = ("rdp", "integer_rdp")


def default_delta(num_samples: int) -> float:
    """δ = 1 / N^1.1: below 1/N as it must be (ARCHITECTURE.md), the choice of the
    DP-SignSGD paper's experiments."""
    return 1.0 / float(num_samples) ** 1.1


def _ledger_of(trainer: "pl.Trainer") -> PrivacyLedger:
    ledger = getattr(trainer.strategy, "ledger", None)
    if not isinstance(ledger, PrivacyLedger):
        raise ValueError(
            f"PrivacyBudget needs Trainer(strategy=DPStrategy(...)); the strategy is "
            f"{type(trainer.strategy).__name__}, which keeps no privacy ledger."
        )
    return ledger


class PrivacyBudget(Callback):
    """Log ε of the run so far; with ``target_epsilon``, never take a step that exceeds it.

    Example::

        trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.1, max_grad_norm=1.0),
                             callbacks=[PrivacyBudget(target_epsilon=3.0, delta=1e-5)])

    Args:
        target_epsilon: stop before ε would exceed this (``None``: only report).
        delta: δ; ``None`` uses 1/N^1.1 for N training examples (announced at train start).
        accountant: accountant for reporting: ``"rdp"``, ``"pld"``, ``"prv"``, ``"integer_rdp"``.
        every_n_steps: report period for ``"pld"``/``"prv"`` (default 100; 1 for RDP accountants).
        stop_accountant: accountant for the stop decision (default ``"rdp"``, see module docs).
        rdp_quantum: ``None`` (exact) or relative grid for conservative σ/q rounding in the
            running RDP total (:class:`~lightning_dp.accounting.RunningRDP`).
        rdp_curve: how the running total evaluates a new (σ, q): ``"auto"`` (default: exact for
            the first 4 distinct (σ, q), then the chord upper bound on a 0.5 % grid, ~50 µs per cell;
            for those steps ε is ≤ ~1–5 % higher at σ ≥ 1, more at σ < 1: for a schedule there,
            ``rdp_curve="exact", rdp_quantum=5e-3`` is exact per 0.5 % cell, ≤ ~1 % above exact),
            ``"exact"`` (Opacus' series, 1–4 ms each) or ``"chord"``
            (:class:`~lightning_dp.accounting.RunningRDP`).
        log_every_n_steps: logging period (default: the trainer's ``log_every_n_steps``); the
            first step and the stopping step are always logged. The stop check still runs
            every step.
    """

    def __init__(
        self,
        target_epsilon: Optional[float] = None,
        delta: Optional[float] = None,
        accountant: str = "rdp",
        every_n_steps: Optional[int] = None,
        stop_accountant: str = "rdp",
        rdp_quantum: Optional[float] = None,
        log_every_n_steps: Optional[int] = None,
        rdp_curve: str = "auto",
    ) -> None:
        get_accountant(accountant)
        get_accountant(stop_accountant)
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon)
        self.delta = None if delta is None else check_delta(delta)
        if every_n_steps is None:
            every_n_steps = 1 if accountant in _RUNNING else 100
        if int(every_n_steps) != every_n_steps or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.accountant = accountant
        self.stop_accountant = stop_accountant
        self.every_n_steps = int(every_n_steps)
        if log_every_n_steps is not None and (int(log_every_n_steps) != log_every_n_steps or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be None or an integer >= 1, got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self._rdp = RunningRDP(quantum=rdp_quantum, curve=rdp_curve)  # the stop decision's running total
        self._report = running_for(accountant, rdp_quantum, rdp_curve) if accountant != "rdp" else self._rdp
        self._ledger: Optional[PrivacyLedger] = None  # the strategy's, seen at the last hook
        self._reservation: Optional[BudgetReservation] = None  # made at the first stop check (needs δ)
        self._epsilon = 0.0  # PLD/PRV: ε as of the last report
        self._reported_at = -1
        self._warned_not_private = False
        self._horizon: Optional[tuple[Any, int]] = None  # ((σ, q, entries), last allowed step)

    # ------------------------------------------------------------------ public
    @property
    def epsilon(self) -> float:
        """ε of the run so far by ``accountant``: computed now for ``"rdp"``/``"integer_rdp"``
        (new ledger entries folded in first), as of the last report for ``"pld"``/``"prv"``."""
        if self._report is not None and self._ledger is not None and self.delta is not None:
            self._report.sync(self._ledger)
            self._epsilon = self._report.epsilon(self.delta)
        return self._epsilon

    # ------------------------------------------------------------------- hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Fail fast when the strategy keeps no ledger (not a DPStrategy)."""
        _ledger_of(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resolve δ, catch up with a restored ledger, refuse a budget too small for one step."""
        ledger = self._ledger = _ledger_of(trainer)
        self._resolve_delta(trainer)
        self._check_private(ledger)
        self._update_epsilon(ledger, force=True)
        self._reservation = None  # a fresh one for this fit (the ledger may have been restored)
        if self.target_epsilon is None or self._next_step_allowed(trainer, ledger):
            return
        if ledger.steps == 0:
            raise ValueError(
                f"PrivacyBudget: one step with σ = {trainer.strategy.noise_multiplier:.4g}, "
                f"q = {trainer.strategy.sample_rate:.4g} already exceeds target_epsilon = {self.target_epsilon} "
                f"at δ = {self.delta:.3g}: raise σ (lightning_dp.accounting.calibrate_noise) or the target."
            )
        rank_zero_warn(f"PrivacyBudget: the budget ε = {self.target_epsilon} is spent ({ledger.steps} steps); stopping.")
        trainer.should_stop = True

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Stop if the next step would exceed the target; log when due (ε computed then)."""
        ledger = self._ledger = _ledger_of(trainer)
        self._check_private(ledger)
        if self.target_epsilon is not None and not self._next_step_allowed(trainer, ledger):
            trainer.should_stop = True
        self._update_epsilon(ledger)
        self._log(trainer, pl_module, ledger)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Final ε by ``accountant``, written straight to the loggers."""
        ledger = self._ledger = _ledger_of(trainer)
        self._update_epsilon(ledger, force=True)
        epsilon = self.epsilon
        for logger in trainer.loggers:
            logger.log_metrics({"privacy/epsilon": epsilon}, step=trainer.global_step)
        rank_zero_info(f"PrivacyBudget: ε = {epsilon:.4g} at δ = {self.delta:.3g} after {ledger.steps} steps")

    # --------------------------------------------------------------- helpers
    def _resolve_delta(self, trainer: "pl.Trainer") -> None:
        if self.delta is not None:
            return
        n = getattr(trainer.strategy, "num_samples", None)
        if not n:
            raise ValueError("PrivacyBudget: give delta=...; the strategy does not know the dataset size N.")
        self.delta = default_delta(n)
        rank_zero_info(f"PrivacyBudget: delta not given, using δ = 1/N^1.1 = {self.delta:.3g} for N = {n} examples.")

    def _check_private(self, ledger: PrivacyLedger) -> None:
        if not ledger.is_private and not self._warned_not_private:
            self._warned_not_private = True
            rank_zero_warn("PrivacyBudget: this run made NON-PRIVATE releases (noiseless baseline): ε = inf.")

    def _update_epsilon(self, ledger: PrivacyLedger, force: bool = False) -> None:
        """PLD/PRV reporting: compose the whole ledger every ``every_n_steps`` (running accountants: nothing to do)."""
        assert self.delta is not None
        if self._report is not None:
            return
        steps = ledger.steps
        if force or (steps != self._reported_at and steps % self.every_n_steps == 0):
            self._epsilon = ledger_epsilon(ledger, self.delta, self.accountant)
            self._reported_at = steps

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", ledger: PrivacyLedger) -> None:
        """ε to the progress bar and loggers (``pl_module.log``); δ, σ, q, steps straight to the loggers.

        Every ``log_every_n_steps`` (the trainer's by default), on the first step and when stopping:
        one ``pl_module.log`` call costs 1–2 ms of Lightning bookkeeping here, far more than the
        accounting itself.
        """
        steps = ledger.steps
        every = self.log_every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        if steps % every and steps != 1 and not trainer.should_stop:
            return
        strategy = trainer.strategy
        epsilon = self.epsilon
        pl_module.log("privacy/epsilon", epsilon, on_step=True, on_epoch=False, prog_bar=True)
        values = {
            "privacy/epsilon": epsilon,
            "privacy/delta": self.delta,
            "privacy/noise_multiplier": strategy.noise_multiplier,
            "privacy/sample_rate": strategy.sample_rate,
            "privacy/steps": float(steps),
        }
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def _next_step_allowed(self, trainer: "pl.Trainer", ledger: PrivacyLedger) -> bool:
        assert self.delta is not None and self.target_epsilon is not None
        sigma, q = trainer.strategy.noise_multiplier, trainer.strategy.sample_rate
        if getattr(trainer.strategy, "rounds_charged_next_step", 1) == 0:
            return True  # banded noise, inside a cycle: the next step adds no sampled-Gaussian round
        if self._reservation is None:
            self._reservation = BudgetReservation(self._rdp, self.delta, self.target_epsilon)
        if self._reservation.allows_next(ledger, sigma, q):
            return True  # RDP certifies it: a valid bound whatever the reporting accountant
        if self.stop_accountant == "rdp" or not ledger.is_private:
            return False
        if self.stop_accountant == "integer_rdp":
            return ledger_epsilon(ledger.entries + (LedgerEntry(sigma, q, 1),), self.delta, "integer_rdp") <= self.target_epsilon
        return ledger.steps + 1 <= self._last_allowed_step(ledger, sigma, q)

    def _last_allowed_step(self, ledger: PrivacyLedger, sigma: float, q: float) -> int:
        """Total step count up to which ``stop_accountant`` certifies the budget at constant (σ, q)."""
        entries = ledger.entries
        key = (sigma, q)
        if self._horizon is not None:
            (old_key, old_len), last = self._horizon
            tail = entries[-1] if entries else None
            same_tail = tail is not None and (tail.noise_multiplier, tail.sample_rate, tail.private) == (sigma, q, True)
            if old_key == key and (len(entries) == old_len or (len(entries) == old_len + 1 and same_tail)):
                return last
        assert self.delta is not None and self.target_epsilon is not None
        more = steps_within_budget(
            entries, sigma, q, self.target_epsilon, self.delta, self.stop_accountant, hint=max(2, ledger.steps // 8)
        )
        last = ledger.steps + more
        # after the next step the tail entry is (σ, q): remember the length it will have
        tail_is_key = bool(entries) and (entries[-1].noise_multiplier, entries[-1].sample_rate) == key
        self._horizon = ((key, len(entries) + (0 if tail_is_key else 1)), last)
        return last

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The running totals, δ in use and the last ε (the ledger itself travels with the strategy)."""
        if self._ledger is not None:
            self._rdp.sync(self._ledger)
        epsilon = self.epsilon  # also syncs the reporting total
        return {
            "rdp": self._rdp.state_dict(),
            "report": self._report.state_dict() if self._report not in (None, self._rdp) else None,
            "delta": self.delta,
            "epsilon": epsilon,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the totals; they are checked against (or rebuilt from) the restored ledger at train start."""
        self._rdp.load_state_dict(state_dict["rdp"])
        if state_dict.get("report") is not None and self._report not in (None, self._rdp):
            self._report.load_state_dict(state_dict["report"])
        if self.delta is None and state_dict.get("delta") is not None:
            self.delta = float(state_dict["delta"])
        self._epsilon = float(state_dict.get("epsilon", 0.0))
        self._horizon = self._reservation = None
