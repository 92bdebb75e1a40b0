"""PrivacyBudget: report what a run has spent, and stop before it overspends.

Reads the :class:`~lightning_dp.accounting.PrivacyLedger` that :class:`DPStrategy` keeps
(one entry per release of the sampled Gaussian mechanism, docs/algorithms.md "The mechanism")
and, every ``log_every_n_steps``, writes one row to the trainer's loggers (``privacy/epsilon``,
``privacy/delta``, ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/steps``, and
``privacy/target_epsilon`` when there is a target: ``privacy/epsilon`` once per logged step) and
shows ``privacy/epsilon`` in the progress bar and ``trainer.callback_metrics``
(``pl_module.log(..., logger=False)``). With a TensorBoard logger it also writes, once, a
custom-scalars layout that draws ε against its target (:mod:`lightning_dp.callbacks._tb_layout`).

δ and the accountant: the strategy's. δ is ``DPStrategy.target_delta`` and the accountant
``DPStrategy.accountant`` (:mod:`lightning_dp.accounting.run_privacy`); a different ``delta=``
or ``accountant=`` given here is refused (:class:`~lightning_dp.errors.PrivacyConfigurationError`
naming both values) unless marked with ``allow_mismatch=True``. A strategy without
``target_delta`` (σ given as ``noise_multiplier``) takes ``delta=``, else δ = 1/N^1.1. The δ
used and where it came from are logged at train start.

ε shown is ε spent. At the end of every epoch and of training, ``trainer.callback_metrics``
and the progress bar's ``privacy/epsilon`` are set to the ledger's ε at that moment, not the
value of the last logging step (``"pld"``/``"prv"``: as of the last report, composed afresh
for the last epoch and the end of training). The ledger is the same on every rank, so under
DDP every rank holds the same value (no ``sync_dist`` averaging). The loggers get a last
``privacy/epsilon`` row at the end of training when the final step was not logged with it.

Accounting. A running per-order RDP total (:class:`~lightning_dp.accounting.RunningRDP`) is
synced from *new* ledger entries only, and only when something needs it: when ε is read
(logging, :attr:`epsilon`, end of training, checkpoints) or a stop reservation is made. A new
(σ, q) costs one vectorised evaluation of Opacus' RDP series (1–4 ms) for the first 4 distinct
ones, then the chord upper bound at (σ, q) rounded to a 0.5 % grid (~50 µs per new cell,
batched over the entries of one sync; ``rdp_curve``, :mod:`~lightning_dp.accounting.sgm_rdp`).
``"pld"`` / ``"prv"`` compose the whole ledger (0.1 s to seconds), so they report every
``every_n_steps`` (default 100), at the stopping step and at the end of training.

Stopping (with ``target_epsilon``). The target is an
:class:`~lightning_dp.accounting.ceiling.EpsilonCeiling` over the strategy's ledger, the same kind of object as
the strategy's own ``target_epsilon``: this callback adds it to the private step (``PrivateStep.ceilings``) for
the fit, and the step refuses any release it refuses, asked right before the release with that release's own
(σ, q): a σ or q changed after this callback's check of the step before (a schedule in
``on_train_batch_start``, a recalibration when an epoch rebuilds the loader, a callback after this one) cannot take
a step past the target, nor can ``Trainer(min_steps=...)`` going on after the stop. After each step the callback
asks the same ceiling about one more step with the strategy's current (σ, q), to stop training and say why. The
ceiling answers with a :class:`~lightning_dp.accounting.BudgetReservation`: budget reserved for a box of (σ, q)
around the current one, re-made only when (σ, q) leaves the box or the reserved steps are used up (constant σ
and q: once per run; σ or q changing every step: about once per hundred steps), and checked exactly
for the last step. Training thus ends at the last step whose ε stays ≤ target, for a few comparisons
per step. The stop is said once per fit, on rank 0, as a
warning with ε spent, δ, the step and why (shared with the strategy's own ceiling: one line). With
banded noise only the first step of each cycle of b steps is charged a round
(``DPStrategy.rounds_charged_next_step``), so the steps inside the last affordable cycle are all
taken. The decision uses ``stop_accountant`` (default ``"rdp"``: the running total, cheap and a
valid upper bound). With ``stop_accountant="pld"`` or ``"prv"``, a step is taken if RDP *or* the
tighter accountant certifies it (both are valid bounds); once RDP refuses, the number of remaining
steps under the current (σ, q) is searched once with the tighter accountant (a few seconds to a
minute) and recomputed only if σ or q changes. A budget too small for the first step raises
``ValueError`` at ``on_train_start``, before any step; a resumed run with no budget left stops at
once.

Non-private runs (the noiseless baseline, docs/algorithms.md §5) report ε = inf with a warning.
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dp._warnings import filter_upstream_noise
from lightning_dp.accounting import PrivacyLedger, RunningRDP, get_accountant, ledger_epsilon, running_for
from lightning_dp.accounting.ceiling import EpsilonCeiling
from lightning_dp.accounting.checks import check_delta, check_target_epsilon
from lightning_dp.accounting.run_privacy import default_delta, resolve_accountant, resolve_delta
from lightning_dp.callbacks._tb_layout import BUDGET, EPSILON, NOISE_MULTIPLIER, TARGET_EPSILON, write_layout
from lightning_dp.validators.monitored import NOT_FROM_DATA

__all__ = ["PrivacyBudget", "default_delta"]

_RUNNING = ("rdp", "integer_rdp")
_KEY = EPSILON
NOT_FROM_DATA.add(_KEY)  # ε is the ledger's: monitoring it steers nothing by the data (boundary rule 6)


EPSILON_PER_USER = "privacy/epsilon_per_user"
"""With ``DPStrategy(privacy_unit=Users(...))`` ε is per user: logged under this tag too."""


def _per_unit(ledger: PrivacyLedger) -> str:
    """`` per user`` for a user-level ledger (its ε protects all of a user's records), else nothing."""
    unit = getattr(ledger, "unit", "example")
    return "" if unit == "example" else f" per {unit}"


def _ledger_of(trainer: "pl.Trainer") -> PrivacyLedger:
    ledger = getattr(trainer.strategy, "ledger", None)
    if not isinstance(ledger, PrivacyLedger):
        raise ValueError(
            f"PrivacyBudget needs Trainer(strategy=DPStrategy(...)); the strategy is "
            f"{type(trainer.strategy).__name__}, which keeps no privacy ledger."
        )
    return ledger


def _training_ends_after_this_step(trainer: "pl.Trainer") -> bool:
    """Best effort, for PLD/PRV freshness only: a stop was requested or ``max_steps`` is reached."""
    if getattr(trainer, "should_stop", False):
        return True
    max_steps = getattr(trainer, "max_steps", -1)
    return max_steps is not None and max_steps >= 0 and getattr(trainer, "global_step", 0) >= max_steps


def _fit_ends_after_this_epoch(trainer: "pl.Trainer") -> bool:
    """Best effort, for PLD/PRV freshness only: this epoch is the last (stop, ``max_steps``, ``max_epochs``)."""
    if _training_ends_after_this_step(trainer):
        return True
    max_epochs = getattr(trainer, "max_epochs", None)
    return max_epochs is not None and max_epochs >= 0 and getattr(trainer, "current_epoch", 0) + 1 >= max_epochs


def _plan_ends_here(trainer: "pl.Trainer") -> bool:
    """Training ends after this step anyway (``max_steps`` reached, or the last batch of the last epoch): a budget
    spent exactly by the plan stops nothing, so there is no stop to announce."""
    if _training_ends_after_this_step(trainer):
        return True
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False)) and _fit_ends_after_this_epoch(trainer)


class PrivacyBudget(Callback):
    """Log ε of the run so far; with ``target_epsilon``, never take a step that exceeds it.

    Example::

        trainer = pl.Trainer(strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-5),
                             callbacks=[PrivacyBudget()])  # ε at the strategy's δ = 1e-5, its accountant
        trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.1, max_grad_norm=1.0),
                             callbacks=[PrivacyBudget(target_epsilon=3.0, delta=1e-5)])

    δ and the accountant are the strategy's (module docs, :mod:`lightning_dp.accounting.run_privacy`):
    a ``delta`` or ``accountant`` different from ``DPStrategy.target_delta`` / ``DPStrategy.accountant``
    raises :class:`~lightning_dp.errors.PrivacyConfigurationError` at setup, unless
    ``allow_mismatch=True``.

    Args:
        target_epsilon: stop before ε would exceed this (``None``: only report).
        delta: δ. ``None`` (default): the strategy's ``target_delta``; a strategy without one
            (σ given as ``noise_multiplier``) uses δ = 1/N^1.1 for N training examples. The δ
            used and its source are logged at train start. A value different from the strategy's
            ``target_delta`` needs ``allow_mismatch=True``.
        accountant: accountant for reporting: ``"rdp"``, ``"pld"``, ``"prv"``, ``"integer_rdp"``.
            ``None`` (default): the strategy's ``accountant`` (``"rdp"`` for a strategy without one).
            A different one needs ``allow_mismatch=True``.
        every_n_steps: report period for ``"pld"``/``"prv"`` (default 100; 1 for RDP accountants).
        stop_accountant: accountant for the stop decision (default ``"rdp"``, see module docs).
        rdp_quantum: ``None`` (exact) or relative grid for conservative σ/q rounding in the
            running RDP total (:class:`~lightning_dp.accounting.RunningRDP`).
        log_every_n_steps: logging period (default: the trainer's ``log_every_n_steps``); the
            first step and the stopping step are always logged. The stop check still runs
            every step.
        rdp_curve: how the running total evaluates a new (σ, q): ``"auto"`` (default: exact for
            the first 4 distinct (σ, q), then the chord upper bound on a 0.5 % grid, ~50 µs per cell;
            for those steps ε is ≤ ~1–5 % higher at σ ≥ 1, more at σ < 1: for a schedule there,
            ``rdp_curve="exact", rdp_quantum=5e-3`` is exact per 0.5 % cell, ≤ ~1 % above exact),
            ``"exact"`` (Opacus' series, 1–4 ms each) or ``"chord"``
            (:class:`~lightning_dp.accounting.RunningRDP`).
        allow_mismatch: the one way to report at a ``delta`` / with an ``accountant`` that differs
            from the strategy's on purpose (both values are then named in the log).
    """

    layout_role = BUDGET
    """What this callback draws in the TensorBoard layout (:mod:`lightning_dp.callbacks._tb_layout`)."""

    def __init__(
        self,
        target_epsilon: Optional[float] = None,
        delta: Optional[float] = None,
        accountant: Optional[str] = None,
        every_n_steps: Optional[int] = None,
        stop_accountant: str = "rdp",
        rdp_quantum: Optional[float] = None,
        log_every_n_steps: Optional[int] = None,
        rdp_curve: str = "auto",
        allow_mismatch: bool = False,
    ) -> None:
        if accountant is not None:
            get_accountant(accountant)
        get_accountant(stop_accountant)
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon)
        self._given_delta = None if delta is None else check_delta(delta)
        self._given_accountant = accountant
        self.allow_mismatch = bool(allow_mismatch)
        if every_n_steps is not None and (int(every_n_steps) != every_n_steps or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self._given_every_n_steps = None if every_n_steps is None else int(every_n_steps)
        self.stop_accountant = stop_accountant
        if log_every_n_steps is not None and (int(log_every_n_steps) != log_every_n_steps or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be None or an integer >= 1, got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self._rdp_quantum, self._rdp_curve = rdp_quantum, rdp_curve
        self._rdp = RunningRDP(quantum=rdp_quantum, curve=rdp_curve)  # the stop decision's running total
        # Resolved against the strategy at setup (δ's default at train start, when N is known):
        self.delta: Optional[float] = self._given_delta
        self.accountant: Optional[str] = accountant
        self.every_n_steps: Optional[int] = self._given_every_n_steps
        self._delta_source = "delta"
        self._accountant_source = "accountant"
        self._restored_delta: Optional[float] = None
        self._report: Optional[RunningRDP] = None  # the reporting total (None for PLD/PRV), built for:
        self._report_kind: Optional[str] = None
        self._pending_report: Optional[tuple[Optional[str], dict[str, Any]]] = None  # loaded before setup
        self._ledger: Optional[PrivacyLedger] = None  # the strategy's, seen at the last hook
        self._ceiling: Optional[EpsilonCeiling] = None  # the target over the strategy's ledger (made at train start)
        self._epsilon = 0.0  # PLD/PRV: ε as of the last report
        self._reported_key: Optional[tuple[int, Optional[float], Optional[str]]] = None  # (steps, δ, accountant) of it
        self._logged: Optional[tuple[int, float]] = None  # (global step, ε) of the last logger row
        self._warned_not_private = False
        self._guarded: Optional[Any] = None  # the private step this budget's ceiling is added to (this fit)
        self._stop_announced = False

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
        """Fail fast: a strategy that keeps no ledger (not a DPStrategy), or a δ / accountant
        that differs from the strategy's without ``allow_mismatch=True``."""
        filter_upstream_noise()  # again here: a filter set at import is lost if that import ran in catch_warnings
        _ledger_of(trainer)
        self._resolve(trainer)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Write the TensorBoard custom-scalars layout (once per writer, shared with SecondMomentMonitor)."""
        write_layout(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resolve δ, catch up with a restored ledger, refuse a budget too small for one step."""
        ledger = self._ledger = _ledger_of(trainer)
        self._resolve(trainer)
        self._resolve_default_delta(trainer)
        rank_zero_info(
            f"PrivacyBudget: ε{_per_unit(ledger)} reported at δ = {self.delta:.3g} ({self._delta_source}) with the "
            f"{self.accountant!r} accountant ({self._accountant_source})."
        )
        self._check_private(ledger)
        self._update_epsilon(ledger, force=True)
        self._unguard()
        self._ceiling = None  # a fresh one for this fit (the ledger may have been restored)
        self._stop_announced = False
        self._guard(trainer)
        if self.target_epsilon is None or self._next_step_allowed(trainer, ledger):
            return
        if ledger.steps == 0:
            raise ValueError(
                f"PrivacyBudget: one step with σ = {trainer.strategy.noise_multiplier:.4g}, "
                f"q = {trainer.strategy.sample_rate:.4g} already exceeds target_epsilon = {self.target_epsilon} "
                f"at δ = {self.delta:.3g}: raise σ (lightning_dp.accounting.calibrate_noise) or the target."
            )
        self._say(trainer, f"PrivacyBudget: training stops before its first step: the budget target_epsilon = "
                           f"{self.target_epsilon} is spent (ε = {self.epsilon:.4g} at δ = {self.delta:.3g} over "
                           f"{ledger.steps} release(s), {self.accountant} accountant).")
        trainer.should_stop = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Take this budget's ceiling off the private step (this fit is over)."""
        self._unguard()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Stop if the next step would exceed the target; log when due (ε computed then)."""
        ledger = self._ledger = _ledger_of(trainer)
        self._check_private(ledger)
        if self.target_epsilon is not None and not self._next_step_allowed(trainer, ledger):
            if not trainer.should_stop and not _plan_ends_here(trainer):
                # not already stopping (the strategy refused a release and said why) nor at the plan's own end
                self._announce_stop(trainer, ledger)
            trainer.should_stop = True
        self._update_epsilon(ledger, force=_training_ends_after_this_step(trainer))
        self._log(trainer, pl_module, ledger)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The ledger's ε now into ``callback_metrics`` and the progress bar (shown at epoch end)."""
        ledger = self._ledger = _ledger_of(trainer)
        self._update_epsilon(ledger, force=_fit_ends_after_this_epoch(trainer))
        self._show(trainer, self.epsilon)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Final ε by ``accountant``: into ``callback_metrics`` and the progress bar metrics, and
        to the loggers unless the last logged row (this step) already holds it."""
        ledger = self._ledger = _ledger_of(trainer)
        self._update_epsilon(ledger, force=True)
        epsilon = self.epsilon
        step = int(getattr(trainer, "global_step", ledger.steps))
        if self._logged != (step, epsilon):
            for logger in trainer.loggers:
                logger.log_metrics({_KEY: epsilon}, step=step)
            self._logged = (step, epsilon)
        self._show(trainer, epsilon)
        rank_zero_info(
            f"PrivacyBudget: ε = {epsilon:.4g}{_per_unit(ledger)} at δ = {self.delta:.3g} ({self.accountant} "
            "accountant) "
            f"after {ledger.steps} steps"
        )

    # --------------------------------------------------------------- helpers
    def _resolve(self, trainer: "pl.Trainer") -> None:
        """δ and the accountant from the strategy (or the given ones; run_privacy's rules)."""
        strategy = trainer.strategy
        accountant = resolve_accountant(strategy, self._given_accountant, allow_mismatch=self.allow_mismatch)
        delta = resolve_delta(strategy, self._given_delta, allow_mismatch=self.allow_mismatch)
        self.accountant, self._accountant_source = accountant.value, accountant.source
        if self._given_every_n_steps is None:
            self.every_n_steps = 1 if self.accountant in _RUNNING else 100
        if self._report_kind != self.accountant:
            self._build_report()
        if delta is not None:
            self.delta, self._delta_source = delta.value, delta.source
        elif self._restored_delta is not None:
            self.delta, self._delta_source = self._restored_delta, "restored from the checkpoint"
        else:
            self.delta = None  # the default needs N: at train start

    def _build_report(self) -> None:
        assert self.accountant is not None
        if self.accountant == "rdp":
            self._report = self._rdp
        else:
            self._report = running_for(self.accountant, self._rdp_quantum, self._rdp_curve)
        self._report_kind = self.accountant
        self._reported_key = None
        if self._pending_report is not None:
            kind, state = self._pending_report
            if self._report not in (None, self._rdp) and kind in (None, self.accountant):
                self._report.load_state_dict(state)
            self._pending_report = None

    def _resolve_default_delta(self, trainer: "pl.Trainer") -> None:
        if self.delta is not None:
            return
        n = getattr(trainer.strategy, "num_samples", None)
        if not n:
            raise ValueError("PrivacyBudget: give delta=...; the strategy does not know the dataset size N.")
        resolved = resolve_delta(trainer.strategy, None, num_samples=n)
        assert resolved is not None
        self.delta, self._delta_source = resolved.value, resolved.source

    def _check_private(self, ledger: PrivacyLedger) -> None:
        if not ledger.is_private and not self._warned_not_private:
            self._warned_not_private = True
            rank_zero_warn("PrivacyBudget: this run made NON-PRIVATE releases (noiseless baseline): ε = inf.")

    def _update_epsilon(self, ledger: PrivacyLedger, force: bool = False) -> None:
        """PLD/PRV reporting: compose the whole ledger every ``every_n_steps`` (running accountants: nothing to do)."""
        assert self.delta is not None and self.accountant is not None and self.every_n_steps is not None
        if self._report is not None:
            return
        steps = ledger.steps
        key = (steps, self.delta, self.accountant)
        if key != self._reported_key and (force or steps % self.every_n_steps == 0):
            self._epsilon = ledger_epsilon(ledger, self.delta, self.accountant)
            self._reported_key = key

    @staticmethod
    def _show(trainer: "pl.Trainer", epsilon: float) -> None:
        """``epsilon`` into ``trainer.callback_metrics`` and ``trainer.progress_bar_metrics``.

        Written directly (Lightning's ``self.log`` is not allowed in ``on_train_end``, and an
        epoch-level ``self.log`` would average over steps): the same value on every rank.
        """
        callback_metrics = getattr(trainer, "callback_metrics", None)
        if isinstance(callback_metrics, dict):
            callback_metrics[_KEY] = torch.tensor(epsilon, dtype=torch.float64)
        progress_bar_metrics = getattr(trainer, "progress_bar_metrics", None)
        if isinstance(progress_bar_metrics, dict):
            progress_bar_metrics[_KEY] = float(epsilon)

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", ledger: PrivacyLedger) -> None:
        """ε to the progress bar and ``callback_metrics`` (``pl_module.log(..., logger=False)``);
        ε, δ, σ, q, steps as one row straight to the loggers (so ``privacy/epsilon`` is written
        once per logged step).

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
        pl_module.log(_KEY, epsilon, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        values = {
            _KEY: epsilon,
            "privacy/delta": self.delta,
            NOISE_MULTIPLIER: strategy.noise_multiplier,
            "privacy/sample_rate": strategy.sample_rate,
            "privacy/steps": float(steps),
        }
        if self.target_epsilon is not None:
            values[TARGET_EPSILON] = self.target_epsilon
        if getattr(ledger, "unit", "example") == "user":  # user-level DP: the same ε, under a tag that says so
            values[EPSILON_PER_USER] = epsilon
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)
        self._logged = (int(trainer.global_step), epsilon)

    def _guard(self, trainer: "pl.Trainer") -> None:
        """With a target, add its ceiling to the private step (``PrivateStep.ceilings``): the step then refuses a
        release it refuses, decided with that release's own (σ, q). The check after each step
        (:meth:`on_train_batch_end`) reads the σ set then; a σ changed before the next release (a schedule in
        ``on_train_batch_start``, a recalibration at an epoch's loader rebuild, a callback after this one) is only
        seen there. Taken off at :meth:`teardown`."""
        step = getattr(trainer.strategy, "private_step", None)
        ceilings = getattr(step, "ceilings", None)
        if self.target_epsilon is None or not isinstance(ceilings, list):
            return
        ceilings.append(self._ceiling_over(_ledger_of(trainer)))
        self._guarded = step

    def _unguard(self) -> None:
        if self._guarded is not None:
            self._guarded.ceilings[:] = [c for c in self._guarded.ceilings if c is not self._ceiling]
            self._guarded = None

    def _ceiling_over(self, ledger: PrivacyLedger) -> EpsilonCeiling:
        """This budget's ceiling over ``ledger`` (:mod:`~lightning_dp.accounting.ceiling`): ``target_epsilon`` at δ by
        ``stop_accountant`` on this callback's running RDP total (its stop agrees with the ε it reports), its reasons
        stating ε as reported."""
        assert self.delta is not None and self.target_epsilon is not None
        held = self._ceiling
        if held is None or (held.ledger, held.delta, held.target_epsilon, held.accountant) != (
                ledger, self.delta, self.target_epsilon, self.stop_accountant):
            held = EpsilonCeiling(self.target_epsilon, self.delta, ledger, self.stop_accountant, running=self._rdp,
                                  owner="PrivacyBudget's target_epsilon",
                                  spent=lambda: (self.epsilon, str(self.accountant)))
            if self._guarded is not None:  # the step asks the new one from now on
                self._guarded.ceilings[:] = [held if c is self._ceiling else c for c in self._guarded.ceilings]
            self._ceiling = held
        return held

    def _announce_stop(self, trainer: "pl.Trainer", ledger: PrivacyLedger) -> None:
        """Say that the budget stopped training: ε spent, δ, the step, why."""
        strategy = trainer.strategy
        self._say(trainer, f"PrivacyBudget: training stops after step {trainer.global_step}: one more step at "
                           f"σ = {strategy.noise_multiplier:.4g}, q = {strategy.sample_rate:.4g} would take ε past "
                           f"target_epsilon = {self.target_epsilon} (ε = {self.epsilon:.4g} spent at δ = "
                           f"{self.delta:.3g} over {ledger.steps} release(s), {self.accountant} accountant).")

    def _say(self, trainer: "pl.Trainer", message: str) -> None:
        """``message`` once per fit, on rank 0, as a warning: through the strategy's ``announce_budget_stop`` when
        it has one (its own ceiling shares the once), else here."""
        if self._stop_announced:
            return
        self._stop_announced = True
        announce = getattr(trainer.strategy, "announce_budget_stop", None)
        if callable(announce):
            announce(message)
        else:
            rank_zero_warn(message)

    def _next_step_allowed(self, trainer: "pl.Trainer", ledger: PrivacyLedger) -> bool:
        """Whether the ceiling allows one more step at the strategy's current (σ, q) (banded noise, inside a cycle:
        the next step adds no sampled-Gaussian round)."""
        rounds = getattr(trainer.strategy, "rounds_charged_next_step", 1)
        strategy = trainer.strategy
        return self._ceiling_over(ledger).allows(strategy.noise_multiplier, strategy.sample_rate, rounds)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The running totals, δ and accountant in use and the last ε (the ledger itself travels with the strategy)."""
        if self._ledger is not None:
            self._rdp.sync(self._ledger)
        epsilon = self.epsilon  # also syncs the reporting total
        return {
            "rdp": self._rdp.state_dict(),
            "report": self._report.state_dict() if self._report not in (None, self._rdp) else None,
            "accountant": self.accountant,
            "delta": self.delta,
            "epsilon": epsilon,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the totals; they are checked against (or rebuilt from) the restored ledger at train start.

        The checkpoint's δ is used only when neither the strategy nor ``delta=`` gives one.
        """
        self._rdp.load_state_dict(state_dict["rdp"])
        report, kind = state_dict.get("report"), state_dict.get("accountant")
        if report is not None:
            if self._report_kind is None:  # not resolved yet: applied when the reporting total is built
                self._pending_report = (kind, report)
            elif self._report not in (None, self._rdp) and kind in (None, self.accountant):
                self._report.load_state_dict(report)
        if state_dict.get("delta") is not None:
            self._restored_delta = float(state_dict["delta"])
            if self.delta is None:
                self.delta, self._delta_source = self._restored_delta, "restored from the checkpoint"
        self._epsilon = float(state_dict.get("epsilon", 0.0))
        self._reported_key = None
        self._ceiling = None
