"""The Lightning glue every private strategy shares: :class:`PrivateTraining`, hooks around one
:class:`~lightning_dp.privacy.private_step.PrivateStep`.

docs/architecture.md: "Several strategies (replicated, sharded) share one piece of mechanism glue
(sampling, clipping request, privatising, ledger); each adds only how its gradients are laid out
and reduced." This module is that piece. Per logical step (docs/algorithms.md, "The mechanism"):

    process_dataloader   the training loader rebuilt around Poisson sampling; σ calibrated/refit
    training_step        the sampler's batch (never read from the data), the first step's probe,
                         empty batches and physical batches
    optimizer_step       the ceiling (no release past target_epsilon or PrivacyBudget's target, decided with
                         this step's σ), then the closure wrapped:
                         forward + backward, then PrivateStep.release → p.grad = ĝ_t, ledger += 1
    save/load_checkpoint the privacy state (ledger, σ, C, target, noise state) travels in checkpoints; a
                         restored ledger never shortens the one held, and setup continues the module's
                         record of this process (lightning_dp.accounting.module_ledgers)

:class:`~lightning_dp.strategy.DPStrategy` (replicated, a ``DDPStrategy``) and
:class:`~lightning_dp.sharded_strategy.DPShardedStrategy` (FSDP2, a ``ModelParallelStrategy``) mix
it in before their Lightning base; each adds its ``setup`` (how the model is placed and which
:class:`~lightning_dp.privacy.private_step.Distribution` the mechanism gets) and its launcher.
"""

from __future__ import annotations

import io
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, ClassVar, Iterator, Literal, Optional, Union

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.callbacks import BatchSizeFinder, LearningRateFinder, Timer
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.trainer.states import RunningStage, TrainerFn, TrainerStatus
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_dp.accounting import data_ledgers, module_ledgers
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.loaded_checkpoints import CHECKPOINT_KEY
from lightning_dp._accumulation import (Accumulation, adopt_accumulation, batches_per_step, keep_planned,
                                        physical_batch_size, restore_accumulation)
from lightning_dp._accumulation import changed_error as accumulation_changed
from lightning_dp._gradient_clip import DEFAULT_MAX_GRAD_NORM, adopt_gradient_clip, restore_gradient_clip
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.validators.batch_start_settings import BatchStartSettings
from lightning_dp.validators.checkpoint_replays import check_checkpoint_hooks, check_checkpoint_records
from lightning_dp.validators.end_of_fit import EndOfFit, averaging, unwrap_teardown
from lightning_dp.validators.step_replays import (EPOCH_BOUNDARY_HOOKS, VALIDATION_HOOKS, StepReplays, observers,
                                                  users_objects)
from lightning_dp.validators.pre_hook_state import PreHookState
from lightning_dp.fingerprints.callback_state import trusted_callback
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.fingerprints.state_walker import user_modules
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.mechanism_settings import mechanism_decisions
from lightning_dp.validators.steered_settings import hyperparameters_error, step_decisions
from lightning_dp.validators.probe import frozen_parameters, parameter_entry
from lightning_dp.validators.layers import sparse_optimizer_error
from lightning_dp.validators.model_pruning import PruningWatch
from lightning_dp.validators.logged_reads import STEP_HOOKS, LoggedReads
from lightning_dp.validators.monitored import (NOT_FROM_DATA, fed_back, private_logged, training_rows,
                                               validates_on_training_data)
from lightning_dp.validators.loaders import population_changed_error, record_set
from lightning_dp.record_checks.stored_records import (StoredRecords, changed_records, changed_records_error,
                                                       stored_records)
from lightning_dp.record_checks.stored_records import check_stored_unchanged
from lightning_dp.validators.record_reads import RecordWatch
from lightning_dp.validators.released_gradients import ReleasedGradients
from lightning_dp.validators.evaluated_records import check_evaluation, note_training, trained_dataset
from lightning_dp.validators.hook_replays import overrides_epoch_hooks, replaying_now, users_hook
from lightning_dp.validators.sanity_reads import SanityReads
from lightning_dp.validators.validation_reads import (EvaluationReads, copies_after_fit, evaluation_read_error, forget,
                                                      watch_from_run_start,
                                                      validation_read_error)
from lightning_dp.validators import diagnostic_reads, epoch_ends, judged_writes, logger_judge, metric_writes
from lightning_dp.validators.judged_schedules import ScheduleJudge
from lightning_dp.validators.judged_updates import UpdateJudge, users_update_code
from lightning_dp.validators.sealed_loss import check_kept, handed, sealed
from lightning_dp.validators.sealed_loss import watch as watch_loss
from lightning_dp.validators.patched_torch import note_replaced_operations
from lightning_dp.privacy.release import Release
from lightning_dp.clipping import ClippingPolicy, FlatClipping
from lightning_dp.diagnostics import StepDiagnostics
from lightning_dp._warnings import output_hook_notice_quieted
from lightning_dp.losses import loss_tensor, mean_loss
from lightning_dp.performance.fixed_batch import chunks as padded_chunks
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig, check_target
from lightning_dp.privacy.private_step import Distribution, PrivateStep
from lightning_dp.records.collate import rows_held
from lightning_dp.records.fresh_randomness import step_callback
from lightning_dp.units.physical import user_chunks

SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed")


class PrivateTraining:
    """Lightning hooks that drive a :class:`PrivateStep`; mixed in before a ``ParallelStrategy``.

    The concrete strategy calls :meth:`_init_privacy` from its ``__init__``, :func:`check_trainer` and
    :meth:`_attach` from its ``setup``, and says how many processes there are (:attr:`_distributed`).
    Everything else (data, step, ceiling, checkpoints, public privacy state) is here, once.
    """

    label: ClassVar[str] = "DPStrategy"
    """The strategy's name in messages and errors."""

    private_step: PrivateStep
    resume_privacy: Literal["strict", "new"]
    secure_mode: bool
    max_physical_batch_size: Optional[int]

    def _init_privacy(self, privacy: PrivacyConfig, execution: ExecutionConfig,
                      resume_privacy: Literal["strict", "new"]) -> None:
        """Check the strategy's privacy settings (see ``DPStrategy``) and build the private step from them: the two
        frozen configurations are built once, by the strategy from its keyword arguments, and handed down unchanged
        (:mod:`~lightning_dp.privacy.config`)."""
        check_noise_arguments(privacy.noise_multiplier, privacy.target_epsilon, privacy.target_delta)
        if resume_privacy not in ("strict", "new"):
            raise ValueError(f"resume_privacy must be 'strict' or 'new', got {resume_privacy!r}")
        if execution.fixed_batch_size is not None and execution.views_per_example != 1:
            raise ValueError("fixed_batch_size is not supported with augmentation_multiplicity > 1 yet (padding "
                             "records would have to be padded views): use one of the two")
        if privacy.secure_mode:
            if privacy.sampler_seed is not None:
                raise ValueError("secure_mode draws the sampling from the OS's CSPRNG: remove sampler_seed")
            if privacy.noise not in (None, "gaussian"):
                raise ValueError(f"secure_mode supports noise='gaussian' only, got {privacy.noise!r}")
        # else C may come from Trainer(gradient_clip_val); a clipping policy gives its own bound
        self._max_grad_norm_given = privacy.max_grad_norm is not None or privacy.clipping is not None
        self._clip_restore: Optional[tuple[Any, Any]] = None  # the Trainer's gradient_clip_val while a fit runs
        self._accumulation: Optional[Accumulation] = None  # the Trainer's accumulate_grad_batches while a fit runs
        self.private_step = PrivateStep.from_config(privacy, execution)
        self.private_step.loop.driven_by_strategy()  # training_step is the verified loss; the loop draws and seals
        """The Lightning-free mechanism (:class:`~lightning_dp.privacy.private_step.PrivateStep`) these hooks drive."""
        self._requested_sigma = self.private_step.noise_multiplier
        self.resume_privacy = resume_privacy
        self.secure_mode = bool(privacy.secure_mode)
        self.max_physical_batch_size = execution.max_physical_batch_size
        self._examples_this_step = -1
        self._mechanism_at_step: Optional[Fingerprint] = None  # σ and C as the user's step began (rule 3)
        self._over_budget = False
        self._loaded_for: Optional[tuple[int, int]] = None  # (trainer, epoch) whose training loader was rebuilt
        self._records: Optional[tuple[int, frozenset[int]]] = None  # the records its loader trains on (loaders.py)
        self._stored: Optional[StoredRecords] = None  # what the fit's first loader stores (stored_records.py)
        self._stored_dataset: Any = None  # the dataset of the loader that trains now
        self._stop_announced = False  # the budget stop is said once per fit
        self._logged_reads: Optional[LoggedReads] = None  # the trainer's logged metrics, watched while a fit trains
        self._record_watch: Optional[RecordWatch] = None  # the training records, watched in the step's hooks
        self._decision_windows: Optional[pl.Callback] = None  # decisions outside a step, verified when made
        self._fresh_step: Optional[pl.Callback] = None  # reseeds the global generators as each step starts
        self._pruning: Optional[PruningWatch] = None  # ModelPruning's writes accepted as made (model_pruning.py)
        self._released_grads = ReleasedGradients()  # .grad as a step starts: the release, zeros or None
        self._updates: Optional[UpdateJudge] = None  # the optimizer's update, judged when it runs the user's code
        self._schedules: Optional[ScheduleJudge] = None  # the schedulers' updates, alike
        self._replays = StepReplays(self)  # the user's hooks run again around the step (validators/step_replays.py)
        self._batch_start = BatchStartSettings(self._replays)  # what on_train_batch_start sets from the batch
        """The run-time checks that replay the user's hooks: the first step's, the batch checks, before a release."""
        self._end = EndOfFit(self, self._replays)  # what the hooks after the last update write (end_of_fit.py)
        self._read_in_validation: Optional[tuple[Any, Any]] = None  # (fingerprint, state) at a logged read there
        self._evaluation_reads: Optional[EvaluationReads] = None  # validation's hooks reading the training data
        self._sanity_reads: Optional[SanityReads] = None  # the sanity check's hooks: judged as training starts
        self._unwrap_run_start: Optional[Callable[[], None]] = None  # the evaluation loops' start as it was

    # ------------------------------------------------------------------ public state (the private step's)
    @property
    def privacy_config(self) -> PrivacyConfig:
        """The frozen privacy configuration built from this strategy's keyword arguments and handed to the private
        step unchanged (:class:`~lightning_dp.privacy.config.PrivacyConfig`)."""
        return self.private_step.config

    @property
    def execution_config(self) -> ExecutionConfig:
        """How the private step runs (:class:`~lightning_dp.privacy.config.ExecutionConfig`), frozen."""
        return self.private_step.execution

    @property
    def ledger(self) -> PrivacyLedger:
        """Every noisy release of this run: restored from checkpoints on resume, and continuing every release
        this process already made on the module (an earlier fit; :mod:`lightning_dp.accounting.module_ledgers`)."""
        return self.private_step.ledger

    @property
    def noise_multiplier(self) -> float:
        """σ in use (calibrated from ``target_epsilon`` once the train loader is known)."""
        if self.private_step.noise_multiplier is None:
            raise RuntimeError("σ is calibrated from target_epsilon when training starts; it is not known yet.")
        return self.private_step.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        """C, the per-example (per-user) clipping norm now: the clipping policy's bound (the adaptive policy's moves
        after every step)."""
        return self.private_step.max_grad_norm

    @property
    def clipping(self) -> ClippingPolicy:
        """The clipping policy (:mod:`lightning_dp.clipping`; flat clipping unless one was given)."""
        return self.private_step.clipping

    @property
    def privacy_unit(self) -> str:
        """What ε protects: ``"example"``, or ``"user"`` with ``privacy_unit=Users(...)`` (N, q and the expected
        batch are then counted in users)."""
        return self.private_step.unit

    @property
    def target_epsilon(self) -> Optional[float]:
        """The ε σ is calibrated for (``None`` when σ was given)."""
        return self.private_step.target_epsilon

    @property
    def target_delta(self) -> Optional[float]:
        """δ of ``target_epsilon`` (``None`` when σ was given)."""
        return self.private_step.target_delta

    @target_delta.setter
    def target_delta(self, delta: Optional[float]) -> None:
        self.private_step.target_delta = delta

    @property
    def accountant(self) -> str:
        """The accountant σ is calibrated with (a name of :func:`lightning_dp.accounting.available_accountants`)."""
        return self.private_step.accountant

    @property
    def sample_rate(self) -> Optional[float]:
        """Global Poisson rate q = B / N (``None`` before the train loader is built)."""
        plan = self.private_step.plan
        return None if plan is None else plan.sample_rate

    @property
    def expected_batch_size(self) -> Optional[float]:
        """Global expected batch B = world_size × loader batch_size (user-level DP: k, in users)."""
        plan = self.private_step.plan
        return None if plan is None else plan.expected_batch_size

    @property
    def num_samples(self) -> Optional[int]:
        """N, the size of the training set (user-level DP: the number of users)."""
        plan = self.private_step.plan
        return None if plan is None else plan.num_samples

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Logical steps per epoch, round(1/q)."""
        plan = self.private_step.plan
        return None if plan is None else plan.steps_per_epoch

    @property
    def rounds_charged_next_step(self) -> int:
        """Sampled-Gaussian rounds the next optimizer step adds to the ledger: 1 with independent
        noise; with banded noise 1 on the first step of each cycle of b steps and 0 on the others
        (Choquette-Choo et al. 2023, Thm. 5). :class:`~lightning_dp.callbacks.PrivacyBudget` uses it
        to stop exactly at the budget. At the release's own index (the count of releases), not ``global_step``."""
        return self.private_step.rounds_at(self.private_step.steps_taken)

    @property
    def last_release(self) -> Optional[Release]:
        """The :class:`~lightning_dp.privacy.release.Release` of the last step (``None`` before the first)."""
        return self.private_step.last_release

    @property
    def non_private_diagnostics(self) -> Optional[StepDiagnostics]:
        """Un-noised statistics of the last step, or ``None`` unless enabled (NOT private)."""
        return self.private_step.diagnostics

    def enable_non_private_diagnostics(self) -> None:
        """Compute :class:`~lightning_dp.diagnostics.StepDiagnostics` every step.

        They are read from un-noised per-example data: anything logged from them is not
        covered by the DP guarantee (the model still is, since nothing may feed them back: a read
        inside a step, or a decision, kept state or checkpoint entry set from them elsewhere, is
        refused, :mod:`~lightning_dp.validators.diagnostic_reads`). Warns once.
        """
        if not self.private_step.diagnostics_enabled:
            rank_zero_warn(
                f"{self.label}: non-private diagnostics enabled. Statistics computed from un-noised "
                "per-example gradients (clean clipped mean, norms, clip fraction) are NOT covered by the "
                "differential-privacy guarantee; the trained model still is. Do not publish these logs."
            )
        self.private_step.diagnostics_enabled = True

    @property
    def engine_name(self) -> str:
        """Name of the per-example gradient engine in use (``"auto"`` until chosen at setup)."""
        return self.private_step.engine_name

    # ------------------------------------------------------------------ processes and setup
    @property
    def _distributed(self) -> bool:
        return self.num_nodes * self.num_processes > 1  # type: ignore[attr-defined]

    def _attach(self, where: Distribution) -> None:
        """Attach the engine and choose the release rule for ``where`` (after the optimizers exist)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        engine = self.private_step.attach(module, self.optimizers[0], where)  # type: ignore[attr-defined]
        if self._replays.pre_hooks is not None:  # as configure_optimizers built them, before on_fit_start
            self._replays.pre_hooks.note_optimizers(self.optimizers)  # type: ignore[attr-defined]
        boundary = self.private_step.boundary
        boundary.callbacks = lambda: observers(module.trainer)
        boundary.library_objects = lambda: _loop_objects(module.trainer)
        boundary.global_modules = lambda: user_modules([type(module)] + [type(cb) for cb in boundary.callbacks()
                                                                          if not trusted_callback(cb)])
        boundary.fed_back = lambda: self._reads_and_feedback(module.trainer)
        logger_judge.watch_fit(  # media written to a logger by a training hook (from on_train_start), judged
            module.trainer, lambda name: is_public(name, self.private_step.boundary.public_state))
        self._stop_announced = False
        if self.private_step.adopted:
            rank_zero_info(f"{self.label}: {self.private_step.adopted}.")
        if self.private_step.mechanism == "sign_vote":
            rank_zero_info(f"{self.label}: DP-SignSGD majority vote over {where.world_size} worker(s), each adding "
                           "its own noise")
        rank_zero_info(f"{self.label}: per-example gradients by engine '{engine}'")
        if not isinstance(self.private_step.clipping, FlatClipping):
            rank_zero_info(f"{self.label}: {self.private_step.clipping.describe()}")

    def connect(self, model: "pl.LightningModule") -> None:
        """Lightning's, then refuse a tuner in a fit (:func:`check_no_tuner`), before any callback's setup."""
        super().connect(model)  # type: ignore[misc]
        if _compiled(model):  # the checks run a compiled backward more than once per graph (retained)
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
        if model._current_fx_name in STEP_HOOKS:  # left by a hook that raised (Lightning restores it on return only):
            model._current_fx_name = None         # a module whose fit crashed (or its copy) is not inside a step
        trainer = model._trainer
        if trainer is not None:  # the evaluation hooks watched from the loop's start, before the user's first
            self._restore_run_start()
            self._unwrap_run_start = watch_from_run_start(trainer, self._open_evaluation_watch)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_no_tuner(trainer, self.label)
            adopt_gradient_clip(trainer, self, self.label)  # before a resumed checkpoint's C is compared
            self._note_pre_hook_state(model, trainer)

    def _note_pre_hook_state(self, model: "pl.LightningModule", trainer: "pl.Trainer") -> None:
        """The state before any ``setup`` runs, where the first step's replays of the hooks that see no batch start
        (:mod:`~lightning_dp.validators.pre_hook_state`); none when the user's code has none of those hooks."""
        self._replays.pre_hooks = None
        if not overrides_epoch_hooks(model) and not users_hook(getattr(type(model), "configure_optimizers", None)):
            return
        boundary = self.private_step.boundary  # type: ignore[attr-defined]
        users = users_objects(trainer)
        modules = user_modules([type(model)] + [type(cb) for cb in observers(trainer) if not trusted_callback(cb)])
        self._replays.pre_hooks = PreHookState(trainer, model, users, modules, lambda: boundary.engine_keys)

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        """Before Lightning's loop decides whether the batch accumulates: a constant ``GradientAccumulationScheduler``
        set the planned value again at the epoch's start; the private step accumulates it (:mod:`._accumulation`)."""
        keep_planned(self.lightning_module.trainer, self)  # type: ignore[attr-defined]
        super().on_train_batch_start(batch, batch_idx, *args)  # type: ignore[misc]

    # ------------------------------------------------------------------ the release boundary's baselines
    def on_train_start(self) -> None:
        """The state as training starts (after every ``on_train_start`` hook) is what the first release is compared
        with (:mod:`~lightning_dp.privacy.boundary`); the logged metrics are watched from now on
        (:mod:`~lightning_dp.validators.logged_reads`)."""
        super().on_train_start()  # type: ignore[misc]
        self._judge_sanity_check()
        self.private_step.boundary.baseline()
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer
        forget(trainer)  # an earlier fit's validation reads
        self._logged_reads = LoggedReads(trainer, lambda: [n for n in private_logged(trainer) if not self._exempt(n)],
                                         lambda reader, names: self._read_logged(trainer, reader))
        self._logged_reads.install()
        metric_writes.install(self._logged_reads)  # and their entries must be Lightning's (self.log), not written
        self._logged_reads.watch_metrics(module, self._exempt)
        diagnostic_reads.watch(lambda: module._current_fx_name if module._current_fx_name in STEP_HOOKS else None)
        datasets = self.private_step.boundary.datasets()  # the training loader's (PrivateStep.poisson_loader)
        self._record_watch = RecordWatch(datasets[0] if datasets else None,
                                         lambda: module._current_fx_name in STEP_HOOKS,
                                         "The step (training_step or a hook Lightning runs in it)")
        self._record_watch.start()
        watch_loss(module)
        from lightning_dp.validators.decisions import DecisionWindows  # a Callback: imports Lightning, which imports us

        replays, step = self._replays, self.private_step
        logs_moved = self._logged_reads.moved

        @contextmanager
        def reads_moved() -> Iterator[None]:  # a batch's loss moved far: the logged values and the diagnostics too
            with logs_moved(), diagnostic_reads.moved(step, up=True):
                yield

        self._decision_windows = DecisionWindows(replays.other_data, replays.replay_settings, step.boundary,
                                                 reads_moved, set,  # batch-end writes: judged_writes judges them
                                                 replays.judged_this_step, self._end.before_end_hooks,
                                                 step.any_rank, step.on_every_rank,
                                                 lambda: diagnostic_reads.moved(step, up=False),
                                                 lambda: getattr(self._logged_reads, "count", 0))
        trainer.callbacks.insert(0, self._decision_windows)  # first: it notes the decisions before the user's hooks
        self._decision_windows.notes.watch_scheduler_step(trainer)  # σ or C set in the scheduler's step: refused
        self._fresh_step = step_callback(step.fresh, lambda: step.steps_taken)  # next (once it closed the last
        trainer.callbacks.insert(1, self._fresh_step)  # window): each step's randomness starts afresh
        self._updates = UpdateJudge(trainer)  # an optimizer step running the user's code: judged at every step
        self._schedules = ScheduleJudge(trainer, step)  # so is a scheduler update running the user's code
        self._schedules.watch()
        epoch_ends.watch_fit(trainer)  # an epoch ended by on_train_batch_start's -1: judged as it is returned
        judged_writes.watch_fit(trainer, lambda: bool(replays.batch_end_writes),  # post-processing writes, judged
                                updates=any(users_update_code(o) for o in trainer.optimizers))
        self._pruning = PruningWatch(module, step.boundary, trainer.callbacks)  # ModelPruning: post-processing
        self._released_grads.watch(trainer.optimizers)  # what an optimizer's own step leaves in .grad is released

    def on_exception(self, exception: BaseException) -> None:
        """A user's hook ended the fit with an exception while a decision window was open: raised on the data and not
        on other data, it was decided from the data (a stop once the training loss is low, caught by the user's
        script): refused in its place (:meth:`~lightning_dp.validators.decisions.DecisionWindows.on_exception`), after
        Lightning's teardown (this raise ends Lightning's handling of the exception). A refusal names the torch
        operations the process replaced, if any (:mod:`~lightning_dp.validators.patched_torch`)."""
        super().on_exception(exception)  # type: ignore[misc]
        note_replaced_operations(exception)
        windows = self._decision_windows
        refusal = None if windows is None else windows.refusal
        if refusal is None:
            return
        note_replaced_operations(refusal)
        windows.refusal = None
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        for logger in trainer.loggers:
            logger.finalize("failed")
        trainer._teardown()
        trainer.state.stage = None
        raise refusal from exception

    def _exempt(self, name: str) -> bool:
        """A logged name whose value is not the training data's: ε, or declared public."""
        return name in NOT_FROM_DATA or is_public(name, self.private_step.boundary.public_state)

    def _reads_and_feedback(self, trainer: "pl.Trainer") -> list[Any]:
        """What the boundary asks before every release and when validation starts: refuse a hyper-parameter set
        after a logged value was read and a training record read in the step's hooks (rules 8, 10); then rule 10's
        monitored values."""
        windows = self._decision_windows  # the decisions its windows judged since: not from a logged value
        if self._logged_reads is not None:
            self._logged_reads.check_release(getattr(windows, "judged", None))
        if windows is not None:
            windows.judged = {}
        if self._record_watch is not None:
            self._record_watch.check()
        diagnostic_reads.check()
        return fed_back(trainer, self._exempt)

    def _read_logged(self, trainer: "pl.Trainer", reader: Any) -> None:
        """The user's code read a training-logged value outside a step: a callback that did keeps state from now on;
        during validation (whose writes the boundary does not watch) the state as it is now is what validation must
        end with (:meth:`on_validation_end`)."""
        if any(reader is cb for cb in trainer.callbacks):
            self.private_step.boundary.watch(reader)
        self._validation_read_training_data(trainer)

    def _validation_read_training_data(self, trainer: "pl.Trainer", now: bool = False) -> None:
        """During validation (``now``: it is starting), a training-logged value or a training record was read (by its
        hooks, or by a validation loader over the training records): the state now is what validation must end
        with."""
        if self._read_in_validation is None and (now or trainer.validating or trainer.sanity_checking):
            boundary = self.private_step.boundary
            fingerprint = boundary.fingerprint(trainer.lightning_module)
            self._read_in_validation = (fingerprint, fingerprint.take(boundary.callbacks()))

    def _check_read_in_validation(self, trainer: "pl.Trainer") -> None:
        """Validation read training data: nothing it kept may have changed since (else it could carry it)."""
        taken, self._read_in_validation = self._read_in_validation, None
        if taken is None:
            return
        fingerprint, before = taken
        skip = ("contents of ", "parameter ") if averaging(trainer) else ("contents of ",)  # EMA swaps its weights
        changed = [c for c in StateFingerprint.changed(before, fingerprint.take(self.private_step.boundary.callbacks()))
                   if not c.startswith(skip)]
        if changed:
            raise self.private_step.boundary.written_error(
                changed, "during validation after it read training data (a value logged from it, or its records: "
                "what validation keeps from them would steer later steps)")

    def on_validation_start(self) -> None:
        """Check the state kept since the last update, then leave validation (held-out data) unwatched."""
        super().on_validation_start()  # type: ignore[misc]
        if self._fitting():
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            if self._record_watch is not None:  # told of validation's reads of the training records, while it runs
                self._record_watch.elsewhere = lambda: self._validation_read_training_data(trainer)
                self._record_watch.rows = training_rows(trainer)  # reads of held-out rows of them are not told
            if validates_on_training_data(trainer):  # its loader may prefetch a batch before this hook
                self._validation_read_training_data(trainer, now=True)
            self._watch_evaluation_reads(trainer)
            self.private_step.pause_boundary("between the last update and validation (in a batch-end or epoch hook)")
        else:
            self._watch_after_fit()

    def _open_evaluation_watch(self) -> None:
        """An evaluation loop starts (before its first hook: ``on_validation_model_eval``, the user's
        ``on_validation_start``): watch its hooks' reads of the training data, in a fit and after it."""
        if self._evaluation_reads is not None:
            return
        if self._fitting():
            self._watch_evaluation_reads(self.lightning_module.trainer)  # type: ignore[attr-defined]
        else:
            self._watch_after_fit()

    def _restore_run_start(self) -> None:
        undo, self._unwrap_run_start = self._unwrap_run_start, None
        if undo is not None:
            undo()

    def _watch_evaluation_reads(self, trainer: "pl.Trainer") -> None:
        """Watch validation's hooks for reads of the training data's copies in memory
        (:mod:`~lightning_dp.validators.validation_reads`), unless ``trainer.validate`` is declared public."""
        if self._evaluation_reads is not None:  # opened as the loop started
            return
        copies = self._replays.training_copies()  # None before training (the sanity check)
        if is_public("trainer.validate", self.private_step.boundary.public_state):
            return
        if copies is not None:
            self._evaluation_reads = EvaluationReads(
                trainer, copies.arrays, lambda hook: self._evaluation_read(trainer, hook), replaying_now).open()
        elif trainer.sanity_checking and self._sanity_reads is None:  # its reads judged as training starts
            boundary = self.private_step.boundary
            fingerprint = boundary.fingerprint(trainer.lightning_module)
            self._sanity_reads = SanityReads(trainer, lambda: fingerprint.take(boundary.callbacks())).__enter__()

    def _judge_sanity_check(self) -> None:
        """Training starts, its data's copies known: refuse the state the sanity check changed after its hooks read
        one of them (:mod:`~lightning_dp.validators.sanity_reads`, zoo39 L02, L25)."""
        reads, self._sanity_reads = self._sanity_reads, None
        if reads is None:
            return
        reads.close()
        changed = reads.changed()
        copies = self._replays.training_copies() if changed else None
        hook = reads.read(copies.arrays) if copies is not None else None
        if hook is not None:
            raise self.private_step.boundary.written_error(
                changed, f"during the sanity check (num_sanity_val_steps), after its {hook} read the training data: "
                "what validation keeps from the training records would be trained with from the first step")

    def _watch_after_fit(self) -> None:
        """Outside a fit (``trainer.validate``/``test``/``predict``): the evaluation hooks reading the training data of
        this strategy's or this module's last private fit refuse the evaluation, unless declared public."""
        if self._evaluation_reads is not None:  # opened as the loop started
            return
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        stage, module = trainer.state.fn.value, trainer.lightning_module
        dataset = trained_dataset(self, module)
        if dataset is None or is_public(f"trainer.{stage}", self.private_step.boundary.public_state):
            return

        def refuse(hook: str) -> None:
            raise evaluation_read_error(hook, stage, self.label)
        self._evaluation_reads = EvaluationReads(trainer, copies_after_fit(dataset, module, observers(trainer)),
                                                 refuse).open()

    def on_test_start(self) -> None:
        """The test loop's hooks watched as validation's outside a fit (:meth:`_watch_after_fit`)."""
        super().on_test_start()  # type: ignore[misc]
        self._watch_after_fit()

    def on_predict_start(self) -> None:
        """The predict loop's hooks watched as validation's outside a fit (:meth:`_watch_after_fit`)."""
        super().on_predict_start()  # type: ignore[misc]
        self._watch_after_fit()

    def on_test_end(self) -> None:
        """Stop watching the test loop's hooks."""
        super().on_test_end()  # type: ignore[misc]
        self._close_evaluation_reads()

    def on_predict_end(self) -> None:
        """Stop watching the predict loop's hooks."""
        super().on_predict_end()  # type: ignore[misc]
        self._close_evaluation_reads()

    def _close_evaluation_reads(self) -> None:
        """Stop watching the evaluation hooks; raise again a refusal a handler in a hook swallowed."""
        reads, self._evaluation_reads = self._evaluation_reads, None
        if reads is not None:
            reads.close()

    def _evaluation_read(self, trainer: "pl.Trainer", hook: str) -> None:
        """Validation's ``hook`` read the training records: what validation keeps from now on is refused, and so is
        any value monitored (every value validation logs is the training data's from now on)."""
        self._validation_read_training_data(trainer)
        found = [(who, name) for who, name, _ in fed_back(trainer, self._exempt)]
        if found:
            raise validation_read_error(hook, found)

    def on_validation_end(self) -> None:
        """Validation is over: the state now is the baseline of the next release."""
        super().on_validation_end()  # type: ignore[misc]
        if not self._fitting():
            self._close_evaluation_reads()  # trainer.validate (:meth:`_watch_after_fit`)
            return
        if self._record_watch is not None:
            self._record_watch.elsewhere = None
        self._close_evaluation_reads()  # raises again a refusal a handler in the hook swallowed
        if self._sanity_reads is not None:
            self._sanity_reads.close()  # the state it left: judged as training starts
        self._check_read_in_validation(self.lightning_module.trainer)  # type: ignore[attr-defined]
        self.private_step.boundary.baseline()
        if self._replays.users_code_runs(VALIDATION_HOOKS):
            self.private_step.schedule.force()  # what validation switched on is checked at the next step

    def on_train_end(self) -> None:
        """After the last update: nothing may have been kept from the last batch (batch-end and epoch-end hooks) or
        from the training data by the ``on_train_end`` hooks."""
        super().on_train_end()  # type: ignore[misc]
        self._stop_watching()
        self._end.judge("after the last update (in a batch-end or epoch-end hook, or on_train_end)",
                        self._end.averaged())

    def _stop_watching(self) -> None:
        """Training is over (or failed): the logged metrics and the records are no longer watched."""
        if self._logged_reads is not None:
            self._logged_reads.stop()
        if self._record_watch is not None:
            self._record_watch.stop()
        reads, self._evaluation_reads = self._evaluation_reads, None
        if reads is not None:
            reads.error = None
            reads.close()
        sanity, self._sanity_reads = self._sanity_reads, None
        if sanity is not None:
            sanity.close()
        diagnostic_reads.unwatch()
        judged_writes.unwatch()
        epoch_ends.unwatch()
        logger_judge.unwatch()
        watch_loss(None)
        schedules, self._schedules = self._schedules, None
        if schedules is not None:  # (first: its wrap of the scheduler update is over the decision windows')
            schedules.unwatch()
        windows, self._decision_windows = self._decision_windows, None
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if windows is not None:
            windows.notes.unwatch()  # type: ignore[attr-defined]
        if windows is not None and trainer is not None and windows in trainer.callbacks:
            trainer.callbacks.remove(windows)
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            pruning.stop()
        self._released_grads.close()
        self._updates = None
        fresh, self._fresh_step = self._fresh_step, None
        if fresh is not None and trainer is not None and fresh in trainer.callbacks:
            trainer.callbacks.remove(fresh)

    def _fitting(self) -> bool:
        module = self.lightning_module  # type: ignore[attr-defined]
        return module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING

    def teardown(self) -> None:
        """Detach the engine's hooks, then Lightning's teardown; a fit that ends without error has its end judged
        after the user's ``on_fit_end`` and ``teardown``
        (:meth:`~.validators.end_of_fit.EndOfFit.judge_after_users_teardown`)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        ended = module is not None and self._fitting() and module.trainer.state.status == TrainerStatus.RUNNING
        if module is not None:
            unwrap_teardown(module)  # a fit that failed in on_fit_end: its module's teardown never ran
        self._end.forget()
        self.private_step.detach()
        data_ledgers.persist(self.private_step.ledger)  # the data's record on disk: a fit in a new process finds it
        self._stop_watching()
        self._restore_run_start()
        self._loaded_for = None  # a later fit rebuilds its loader afresh
        self._records = None
        self._stored = None
        self._replays.reset()
        restore_gradient_clip(self)
        restore_accumulation(self)
        super().teardown()  # type: ignore[misc]
        if ended:  # verified at on_train_end; Lightning's teardown moved the model (an RNN's weight references anew)
            self.private_step.boundary.baseline()
            self._end.before_end_hooks()
            self._end.judge_after_users_teardown()  # (which then lets the training statistics go)
        else:  # a failed fit, or not a fit: nothing more is judged against the training data's statistics
            self.private_step.forget_written_statistics()

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """Rebuild the training loader around Poisson sampling (other stages untouched)."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if trainer.state.fn != TrainerFn.FITTING:  # the training records evaluated outside a fit: refused
            check_evaluation(dataloader, trainer.state.fn.value, self.private_step.boundary.public_state, self.label,
                             self, self.lightning_module)  # type: ignore[attr-defined]
        if trainer.state.fn != TrainerFn.FITTING or not _is_train_loader(trainer, dataloader):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise PrivacyConfigurationError(
                f"{self.label} needs a torch DataLoader for training, got {type(dataloader).__name__}."
            )
        when = (id(trainer), trainer.current_epoch)
        if self._loaded_for == when:  # Lightning processes each loader of a dict/list (CombinedLoader) in turn
            raise PrivacyConfigurationError(
                f"{self.label} got several training DataLoaders (a dict or list of loaders, a CombinedLoader): "
                "Poisson sampling draws every step from one population, and the accounting is for one. Put "
                "the datasets in one DataLoader (torch.utils.data.ConcatDataset, returning a tag per source "
                "if training_step needs to tell them apart).")
        self._loaded_for = when
        if (dataloader.batch_size is None and dataloader.batch_sampler is None) or _injected(dataloader.sampler):
            dataloader = _loader_before_sampler_injection(trainer, dataloader)
        records = record_set(dataloader.dataset)
        if self._records is not None and self._records[0] == records[0] and self._records[1] != records[1]:
            raise population_changed_error(len(self._records[1]), len(records[1]))
        self._records = records
        stored = stored_records(dataloader.dataset, records[1])  # the first loader's, kept (stored_records.py)
        changed = [] if self._stored is None else changed_records(self._stored, stored)
        if changed:
            raise changed_records_error(changed)
        self._stored = self._stored or stored
        population = note_training(dataloader, self, self.lightning_module)  # type: ignore[attr-defined]
        use = data_ledgers.data_use(*population) if population else data_ledgers.data_use(dataloader.dataset)
        users = self.private_step.users  # earlier fits on these records (per example: charged per user by group size)
        group = None if users is None else data_ledgers.UserGroups(users, dataloader.dataset)  # m, partition
        note = data_ledgers.continue_on_data(self.private_step.ledger, use, self.private_step.unit, group)
        if note:
            rank_zero_info(f"{self.label}: {note}.")
        self._stored_dataset = dataloader.dataset
        physical_batch_size(self, dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", 1))
        loader = self.private_step.poisson_loader(dataloader,  # its group cycle starts at the ledger's count
                                                  batches_per_step=batches_per_step(self))
        if self.private_step.users is not None:
            rank_zero_info(f"{self.label}: user-level DP: ε per user; {self.num_samples} users, "
                           f"{self.private_step.users.users_per_batch} expected per step (q = {self.sample_rate:.4g}); "
                           "the DataLoader's batch_size is not used")
        before, windows = mechanism_decisions(trainer), self._decision_windows
        self._calibrate(trainer)
        if windows is not None:  # σ refit for the plan (a loader rebuilt at an epoch): the library's own move
            windows.notes.library_moved(before, trainer)  # type: ignore[attr-defined]
        return loader

    def _calibrate(self, trainer: "pl.Trainer") -> None:
        step = self.private_step
        if step.target_epsilon is None:
            step.calibrate(0)  # σ given: only the δ ≥ 1/N warning
            return
        planned = self._planned_steps()
        if getattr(trainer, "fast_dev_run", False):  # qa12 b14/b15: the smoke run spent the real fit's budget
            rank_zero_warn(f"{self.label}: fast_dev_run with target_epsilon={step.target_epsilon}: σ is calibrated "
                           f"for this {planned}-step smoke run, which spends the whole budget, and its releases stay "
                           "in this module's ledger (a later fit of this module or of its weights continues it and "
                           "finds the budget spent). For a smoke test pass noise_multiplier=<σ> instead of "
                           "target_epsilon, or smoke-test a separate instance of the model.")
        first = step.steps_taken  # the releases' own indices (a step refused by a ceiling counted in global_step only)
        message = step.fit_target(first, planned - trainer.global_step + first)
        if message:
            rank_zero_info(f"{self.label}: {message}")

    def _planned_steps(self) -> int:
        """Optimizer steps this fit will take (:func:`planned_steps`)."""
        return planned_steps(self.lightning_module.trainer, self.steps_per_epoch or 1)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the private step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the user's ``training_step`` on the sampled examples, verified.

        The number of examples is the sampler's (:class:`RecordedBatches`), never read from
        the batch; the engine checks every layer against it. Before the first release the
        probe of :mod:`~lightning_dp.validators.probe` runs once. A returned vector of
        per-example losses (shape ``[n]``) is averaged here.

        An empty Poisson batch: with one process the step is skipped (zero loss). With several,
        the other ranks run the user's step, which may hold collectives
        (``self.log(..., sync_dist=True)``, FSDP's all-gathers): this rank runs it too, on a stand-in
        example whose gradient is discarded, so that every rank takes part in every collective. Its
        logged values have batch size 0 (they do not enter epoch means); an ``on_step`` value is that
        of the stand-in. With ``max_physical_batch_size`` a sharded strategy runs as many physical
        batches on every rank (:meth:`_physical_batches_in_lockstep`), the extra ones on a stand-in.
        """
        step = self.private_step
        if self._decision_windows is not None:  # what on_train_batch_start set is this step's (judged with it)
            self._decision_windows.notes.note(self.lightning_module.trainer)  # type: ignore[attr-defined]
        indices = step.take()
        source = getattr(step, "_source", None)  # the loader's dataset and collate (poisson_loader)
        if indices and source is not None:  # records the collate dropped (None: unreadable files) are no rows
            indices = rows_held(source[0], indices, args[0] if args else kwargs.get("batch"))
        self._batch_start.judge(indices, _batch_idx(args, kwargs))  # σ, C, an lr set there from the batch
        n = self._examples_this_step = len(indices)
        if self._over_budget:  # decided in optimizer_step: this step is not taken (nothing is computed)
            return None
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        check_loop(trainer, self.label)
        released = lambda: self._released_grads.check(step.boundary.trainable(), step.boundary.public_state)  # noqa: E731
        if self._distributed:  # a .grad rewritten on one rank's data: every rank raises (none waits in a collective)
            step.on_every_rank(released, "found a .grad rewritten since the last update")
        else:
            released()  # rewritten since the update (validators/released_gradients.py)
        if self._logged_reads is not None:
            self._logged_reads.install()  # Lightning replaces the dicts when it resets its metrics
            metric_writes.install(self._logged_reads)
        if self._pruning is not None and step.boundary.parameters_changed():
            self._pruning.check()  # a layer pruned during the fit by other code than ModelPruning: refused by name
        if step.refresh_parameters():
            rank_zero_info(f"{self.label}: the trainable parameters changed; the engine was re-attached and the "
                           "probe runs again before the next release")
        if not step.verified:
            self._replays.verify()
        if trainer.fit_loop.epoch_loop.batch_idx == 0 and self._stored is not None and self._records is not None:
            check_stored_unchanged(self._stored, self._stored_dataset, self._records[1])  # written since (zoo17 c3)
        if trainer.fit_loop.epoch_loop.batch_idx == 0 and self._replays.users_code_runs(EPOCH_BOUNDARY_HOOKS):
            step.schedule.force()  # an epoch begins: what switches on there (a counter of the user's) is checked
        # the user's code may not set σ, C or a stop from the batch: taken before the batch check, whose runs of
        # training_step on this batch would otherwise leave such a write in what the real run is compared with
        self._mechanism_at_step = step_decisions(trainer)
        if step.batch_check_due():
            self._replays.batch_checked = True
            first = step.schedule.checks == 0
            self._replays.check_batch(indices, _batch_idx(args, kwargs))
            if first:
                self._replays.check_later_in_the_plan(indices)
            else:
                self._replays.judge_before_release(indices, _batch_idx(args, kwargs))
        if step.fixed_batch_size is not None:  # fixed shapes: the loader's batch is padded already (fixed_batch.py)
            return self._fixed_shape_step(indices, args, kwargs)
        if n == 0:
            if not self._distributed:
                # Nothing to differentiate: the step still happens, its clipped sum is zero.
                step.begin(0)
                return torch.zeros((), device=self.root_device, requires_grad=True)  # type: ignore[attr-defined]
            args, kwargs = _with_batch(args, kwargs, self._collated([0]))
            n = 1
        limit = self.max_physical_batch_size
        own: Optional[list[int]] = indices if len(indices) else None  # the records of this (physical) batch
        if limit is not None:
            # Physical batches are collated anew from the step's indices (any collate layout is split right).
            chunks = self._chunks(indices, limit) if len(indices) else [[0]]
            for _ in range(self._physical_batches_in_lockstep(len(chunks)) - len(chunks)):
                self._stand_in_step(args, kwargs)
            if len(chunks) > 1:
                *heads, last = chunks
                for head in heads:
                    self._physical_step(len(head), *_with_batch(args, kwargs, self._collated(head)), indices=head)
                args, kwargs, n = *_with_batch(args, kwargs, self._collated(last)), len(last)
                own = last
        step.begin(n, own, stand_in=own is None)
        out = self._users_step(args, kwargs)
        if out is None or (isinstance(out, dict) and out.get("loss") is None):
            raise PrivacyConfigurationError(
                f"training_step returned {type(out).__name__} without a loss on a step with {n} sampled example(s): "
                "skipping a sampled batch depends on private data (which batches were skipped is released by the "
                "missing update). Return the loss on every step; to ignore some examples, zero their per-example "
                "losses instead (a mean over the batch, or a vector of per-example losses).")
        if getattr(trainer, "_detect_anomaly", False):  # Lightning's finiteness check reads it in optimizer_step
            return mean_loss(out, n)
        return sealed(mean_loss(out, n))  # its value not readable in optimizer_step (validators/sealed_loss.py)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Lightning's, noting the settings as a training batch arrives from the loop, before the batch-start hooks
        (:mod:`~lightning_dp.validators.batch_start_settings`; not the step's own collations, made after them)."""
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
        if trainer is not None and trainer.training and progress is not None \
                and progress.current.ready == progress.current.completed:
            self._batch_start.arrived(trainer)
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def _users_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The user's ``training_step``, refused when it (or a hook before it) read training records itself
        (:mod:`~lightning_dp.validators.record_reads`)."""
        out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        if self._record_watch is not None:
            self._record_watch.check()
        return out

    def _chunks(self, indices: list[int], limit: int) -> list[list[int]]:
        """The step's records cut into physical batches of at most ``limit``; user-level DP cuts between users only
        (:func:`~lightning_dp.units.physical.user_chunks`)."""
        groups = self.private_step.groups_of(indices)
        if groups is not None:
            return user_chunks(indices, groups, limit)
        return [indices[start:start + limit] for start in range(0, len(indices), limit)]

    def _fixed_shape_step(self, indices: list[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The step's examples in physical batches of exactly F rows (:mod:`~lightning_dp.performance.fixed_batch`):
        n ≤ F (also n = 0) runs the loader's batch, padded to F already; n > F runs ⌈n / F⌉ padded batches collated
        anew, the first ones banked. Every rank runs at least one batch, so an empty one needs no stand-in."""
        step = self.private_step
        assert step.fixed_batch_size is not None
        parts = padded_chunks(indices, step.fixed_batch_size)
        for head, padding in parts[:-1]:
            self._physical_step(len(head), *_with_batch(args, kwargs, self._padded(head, padding)), indices=head,
                                padding=padding)
        last, padding = parts[-1]
        if len(parts) > 1:
            args, kwargs = _with_batch(args, kwargs, self._padded(last, padding))
        step.begin(len(last), last, stand_in=not last, padding=padding)
        out = self._users_step(args, kwargs)
        loss_tensor(out, step.fixed_batch_size)  # a step without a loss is refused, as below
        return mean_loss(out, step.fixed_batch_size)

    def _padded(self, indices: list[int], padding: int) -> Any:
        """The examples ``indices`` and ``padding`` padding rows, collated and moved as the loop's batches are."""
        return self._as_loop_batch(self.private_step.padded_examples(indices, padding))

    def _physical_step(self, n: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                       indices: Optional[list[int]] = None, padding: int = 0) -> None:
        """Forward + backward one physical batch of n examples (the records ``indices``, then ``padding`` padding
        rows) and bank its clipped sums (no noise yet)."""
        self.private_step.begin(n, indices, padding=padding)
        loss = mean_loss(self._users_step(args, kwargs), n + padding)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        with output_hook_notice_quieted(self.private_step.engine_name):
            self.lightning_module.backward(loss)  # type: ignore[attr-defined]
        self.private_step.bank()

    def _physical_batches_in_lockstep(self, count: int) -> int:
        """How many physical batches this rank runs when its Poisson batch needs ``count``: its own count (the
        replicated strategy has no collective inside forward or backward). A sharded strategy, whose every
        forward and backward all-gathers, returns the largest count over the ranks."""
        return count

    def _stand_in_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward + backward of a stand-in example whose gradient is dropped (nothing banked): this rank joins
        the collectives of a physical batch its peers run and it has not."""
        step = self.private_step
        step.begin(1, stand_in=True)
        args, kwargs = _with_batch(args, kwargs, self._collated([0]))
        loss = mean_loss(self._users_step(args, kwargs), 1)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        with output_hook_notice_quieted(step.engine_name):
            self.lightning_module.backward(loss)  # type: ignore[attr-defined]
        step.discard()

    def _collated(self, indices: list[int]) -> Any:
        """The examples ``indices`` collated by the user's ``collate_fn`` and moved to the device."""
        return self._as_loop_batch(self.private_step.examples(indices))

    def _as_loop_batch(self, batch: Any) -> Any:
        """A collated batch as Lightning's loop hands it to ``training_step``: converted by the precision plugin
        (``precision="64-true"`` makes float inputs float64), through ``on_before_batch_transfer``, moved to the
        device and through ``on_after_batch_transfer``."""
        module = self.lightning_module  # type: ignore[attr-defined]
        batch = self.precision_plugin.convert_input(batch)  # type: ignore[attr-defined]
        batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
        return self.batch_to_device(batch, dataloader_idx=0)  # type: ignore[attr-defined]

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the optimizer on the private gradient: the closure is wrapped to privatise.

        The ceilings: a step whose release any ceiling of the private step refuses (``target_epsilon``'s, and
        every one added to ``PrivateStep.ceilings``, e.g. PrivacyBudget's: :mod:`~lightning_dp.accounting.ceiling`)
        is not taken; only the step is asked (``PrivateStep.refusal``). The closure
        still runs (Lightning's loop and the sampler's queue advance; ``training_step`` returns nothing),
        the optimizer does not step, and training stops with a warning. Every rank decides alike."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        refused = self.private_step.refusal()  # with this step's own σ and q, at its own index (not global_step)
        self._over_budget = refused is not None
        if refused is not None:
            closure()
            trainer.should_stop = True
            self.announce_budget_stop(f"{self.label}: training stops at step {trainer.global_step}: {refused}. "
                                      "Nothing was released for it.")
            return None
        private_closure = partial(self._private_closure, optimizer, closure)
        updates = self._updates
        if updates is not None:  # the user's code inside the step: judged after it (validators/judged_updates.py)
            private_closure = updates.closure(optimizer, private_closure)
        result = super().optimizer_step(optimizer, private_closure, model, **kwargs)  # type: ignore[misc]
        check_kept(optimizer, [config.scheduler for config in trainer.lr_scheduler_configs])  # nothing kept of the loss
        if updates is not None:  # (after: the judge's fingerprints would read a loss the optimizer kept)
            updates.judge()
        return result

    def announce_budget_stop(self, message: str) -> None:
        """Say ``message`` (the budget stopped training: ε spent, δ, the step, why) once per fit, on rank 0, as a
        warning (Lightning's own "max_epochs reached" follows it). The ceiling here and
        :class:`~lightning_dp.callbacks.PrivacyBudget` share it: a stop both see is said once."""
        if not self._stop_announced:
            self._stop_announced = True
            rank_zero_warn(message)

    def _private_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        self.private_step.expect_request(optimizer)
        # training_step, then backward, which releases (:meth:`backward`); the optimizer is handed the loss sealed for
        # good, another object than Lightning's outputs["loss"] (validators/sealed_loss.py)
        return handed(closure())

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward, with the release between the gradient computation and ``on_after_backward``:
        every hook, callback and logger that reads ``p.grad`` afterwards reads ĝ_t (the release boundary). The
        backward through the engine's hooks runs without torch's notice that Opacus' hooks on the first layer see
        output gradients only (:func:`~lightning_dp._warnings.output_hook_notice_quieted`:
        that message, that engine, this call)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        self.pre_backward(closure_loss)  # type: ignore[attr-defined]
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # type: ignore[attr-defined]
        with output_hook_notice_quieted(self.private_step.engine_name):
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)  # type: ignore[attr-defined]
        self._check_mechanism_kept(module.trainer)
        if self._replays.before_release_writes:  # written alike on all data (a counter): what this release compares
            frozen = frozen_parameters(module)  # a momentum copy unfrozen since (trainable now) is not accepted
            self.private_step.boundary.accept(sorted(n for n in self._replays.before_release_writes
                                                     if not parameter_entry(n, frozen)))
        self.private_step.release(optimizer=getattr(optimizer, "_optimizer", optimizer),
                                  empty=self._examples_this_step == 0)
        if self._decision_windows is not None:  # σ and C as released: what the next release is compared with
            self._decision_windows.notes.note(module.trainer)  # type: ignore[attr-defined]
        self._log_clip_norm(module.trainer)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # type: ignore[attr-defined]
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss

    def _check_mechanism_kept(self, trainer: "pl.Trainer") -> None:
        """Rule 3 for the mechanism and the loop: σ, C, the trainer's stop and length and the library objects'
        settings (:func:`~.validators.steered_settings.loop_controls`) as the step began (a C set from the batch's
        losses in ``training_step`` would clip, noise and be released by this very step; an ``EarlyStopping.patience``
        set from its loss would decide later releases). Refused before the release."""
        taken, self._mechanism_at_step = self._mechanism_at_step, None
        if taken is None:
            return
        changed = StateFingerprint.changed(taken, step_decisions(trainer))
        if changed:
            raise hyperparameters_error(changed, "within the step (in training_step, the forward or the backward)")

    def _log_clip_norm(self, trainer: "pl.Trainer") -> None:
        """``privacy/clip_norm``, the bound the next step clips at, into ``trainer.callback_metrics`` every step and to
        the loggers every ``log_every_n_steps`` (runs with a clipping policy; flat clipping's C never changes). A
        function of the noisy releases only."""
        if isinstance(self.private_step.clipping, FlatClipping):
            return
        metrics = getattr(trainer, "callback_metrics", None)
        if isinstance(metrics, dict):  # every step, for callbacks (e.g. a checkpoint or early stop on it)
            metrics["privacy/clip_norm"] = torch.tensor(self.max_grad_norm, dtype=torch.float64)
        if not trainer.loggers:
            return
        every = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        step = trainer.global_step
        if step % every == 0 and self.global_rank == 0:  # type: ignore[attr-defined]
            for logger in trainer.loggers:
                logger.log_metrics({"privacy/clip_norm": self.max_grad_norm}, step=step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        """Add the private step's state (ledger, σ, C, target, noise state) to the checkpoint, then write it; refused
        when the state it holds changed since the last update (the release boundary), or when it holds training
        records (:func:`~lightning_dp.record_checks.outside_records.records_in`: an ``on_save_checkpoint`` adding
        examples, data passed to ``save_hyperparameters``). Written while a decision window is open (an epoch's end:
        ``ModelCheckpoint`` saves in its own ``on_train_epoch_end``), what the window's hooks wrote so far is judged
        first, as the window judges it (:meth:`~lightning_dp.validators.decisions.DecisionWindows.before_checkpoint`):
        an epoch count kept alike on other data is written, a statistic of the training data refused."""
        windows = self._decision_windows
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if windows is not None and trainer is not None:
            windows.before_checkpoint(trainer, self.lightning_module)  # type: ignore[attr-defined]
        self._end.judge("after the last update, before a checkpoint was written (in a batch-end or epoch hook, or "
                        "a hook that ends the fit)", skip=tuple(self._replays.batch_end_writes))  # an EMA written
        self.private_step.on_every_rank(lambda: check_checkpoint_records(self.private_step, checkpoint),
                                        "found training records in the checkpoint")  # every rank refuses alike
        self.private_step.on_every_rank(
            lambda: check_checkpoint_hooks(self.private_step, self.lightning_module, checkpoint,  # type: ignore
                                           self._replays.replay_settings,
                                           self.moved_training_logs),
            "found a checkpoint entry computed from the training data")
        checkpoint[CHECKPOINT_KEY] = self.private_step.state_dict()
        module_ledgers.mark(self.lightning_module, self.private_step.ledger)  # reloaded, they continue its ledger
        trained = module_ledgers.trained_names(self.lightning_module)  # type: ignore[arg-type]
        checkpoint[CHECKPOINT_KEY]["trained_weights"] = trained  # the weights that carry it (loaded_checkpoints.py)
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def moved_training_logs(self) -> Any:
        """The training loop's logged values moved far, for the runs of the checkpoint hooks and of the hooks that end
        the fit on the exchanged data (the metrics' own states not: a held-out metric copied stays as it is)."""
        reads = self._logged_reads
        return reads.moved(states=False, training_only=True) if reads is not None else nullcontext()

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a checkpoint and restore the ledger, so spent budget is never forgotten."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            note = self.private_step.load_state_dict(state, keep_noise_multiplier=self._resume_changes(state))
            if note:
                rank_zero_info(f"{self.label}: {note}.")
        else:
            rank_zero_warn(
                f"Checkpoint {checkpoint_path} has no privacy ledger (not written by {self.label}): "
                "the budget spent before it is unknown and NOT counted."
            )
        return checkpoint

    def _resume_changes(self, state: dict[str, Any]) -> bool:
        """Compare this run's privacy arguments with the checkpoint's: an error (``resume_privacy="strict"``),
        or a logged switch to the new σ, C or target (``"new"``). Returns whether the new values apply.

        A new ``target_epsilon``/``target_delta`` is the explicit way to raise (or lower) a run's budget: the
        target stays a ceiling on the whole ledger, the checkpoint's releases included, so ε is exact and the
        guarantee of the finished run is the new target."""
        changes = self.private_step.changes_from(state, self._requested_sigma)
        if not changes:
            return False
        if self.resume_privacy == "strict":
            raise PrivacyConfigurationError(
                "Resuming with privacy arguments that differ from the checkpoint's:\n- " + "\n- ".join(changes)
                + f"\nPass the checkpoint's values to continue the same run, or {self.label}(..., "
                "resume_privacy='new') to apply the new ones from the resumed step on (a new target_epsilon is a "
                "new ceiling on the whole ledger, the checkpoint's releases included).")
        target = (" The target is a ceiling on the whole ledger: the checkpoint's releases count against the new "
                  "one." if any(c.startswith("target_") for c in changes) else "")
        rank_zero_warn(f"{self.label}: resumed with resume_privacy='new'; from this step on: " + "; ".join(changes)
                       + ". The ledger records each step's σ, so ε counts both parts exactly." + target)
        return True


class PrivacyStateLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, also bringing rank 0's privacy state back.

    With ``start_method="fork"``/``"spawn"`` training runs in child processes and
    Lightning only returns rank 0's weights and metrics; without this the main process's
    ``strategy.ledger`` would stay empty after ``fit`` (ε spent would read as zero).
    """

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        """Adopt the module's record here first (the children are new processes, or see this one's objects only as
        they were at the fork): the strategy's ledger carries it to them."""
        strategy = self._strategy
        assert isinstance(strategy, PrivateTraining)
        module = strategy.lightning_module  # type: ignore[attr-defined]
        if module is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            note = strategy.private_step.adopt(module)
            if note:
                rank_zero_info(f"{strategy.label}: {note}.")
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        strategy = self._strategy
        assert isinstance(strategy, PrivateTraining)
        state = strategy.private_step.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)  # bytes, like Lightning's metrics: no shared-memory tensors in the queue
        extra[CHECKPOINT_KEY] = buffer.getvalue()
        return extra

    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if CHECKPOINT_KEY in extra:
            assert isinstance(self._strategy, PrivateTraining)
            state = torch.load(io.BytesIO(extra[CHECKPOINT_KEY]), weights_only=False)
            self._strategy.private_step.load_state_dict(state)


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` (``torch.compile(module)``, which Lightning unwraps) or a part of it (``torch.compile(net)``,
    ``net.compile()``) runs compiled: its backward graphs then must not donate their buffers (torch's default), which
    a backward run twice on one graph — as the checks do — cannot take."""
    if getattr(model, "_compiler_ctx", None):
        return True
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _loop_objects(trainer: "pl.Trainer") -> list[tuple[str, Any]]:
    """The loop's own objects a step could stash data on (attributes added to them are kept state)."""
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    others = [("trainer.fit_loop", trainer.fit_loop), ("trainer.fit_loop.epoch_loop", trainer.fit_loop.epoch_loop),
              ("trainer.accelerator", trainer.accelerator), ("trainer.precision_plugin", trainer.precision_plugin),
              ("trainer.profiler", trainer.profiler), *[(f"trainer.loggers[{i}]", lg)
                                                       for i, lg in enumerate(trainer.loggers)]]
    return [("trainer", trainer), ("trainer.strategy", trainer.strategy), *others,
            *[(f"trainer.optimizers[{i}]", opt) for i, opt in enumerate(trainer.optimizers)],
            *[(f"self.optimizers()[{i}]", opt)  # the LightningOptimizer wrappers training_step is handed
              for i, opt in enumerate(getattr(trainer.strategy, "_lightning_optimizers", None) or [])],
            *([("trainer.train_dataloader", trainer.train_dataloader)] if loader is not None else [])]


def _batch_idx(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``batch_idx`` Lightning passes to ``training_step`` (0 when the step takes the batch only)."""
    value = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return int(value) if isinstance(value, int) else 0


def _with_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (batch, *args[1:]), kwargs
    return args, {**kwargs, "batch": batch}


_LIGHTNING_IMPLICIT_MAX_EPOCHS = 1000
"""Lightning's ``max_epochs`` when neither ``max_epochs`` nor ``max_steps`` is given (loops/utilities.py)."""


def destroy_process_group() -> None:
    """Destroy the process group while the interpreter is still whole (an ``atexit`` handler).

    Lightning does this for NCCL only. A gloo group still alive when Python finalizes aborts a few
    percent of 2-process CPU runs ("terminate called without an active exception", exit 134): a
    gloo worker thread dropping the last reference to a finished collective's tensors asks for the
    GIL, and a thread asking for it during finalization is ended by a forced unwind through a
    ``noexcept`` destructor. Destroying is local; a no-op when the group is already gone.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def planned_steps(trainer: "pl.Trainer", steps_per_epoch: int) -> int:
    """Optimizer steps the trainer will take: ``max_steps`` or ``max_epochs`` × steps per epoch."""
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        steps_per_epoch = min(steps_per_epoch, limit)
    elif isinstance(limit, float) and limit < 1.0:
        steps_per_epoch = max(1, int(steps_per_epoch * limit))
    by_epochs = trainer.max_epochs * steps_per_epoch if trainer.max_epochs not in (None, -1) else None
    by_steps = trainer.max_steps if trainer.max_steps not in (None, -1) else None
    candidates = [s for s in (by_epochs, by_steps) if s is not None]
    if by_steps is None and trainer.max_epochs == _LIGHTNING_IMPLICIT_MAX_EPOCHS:
        raise PrivacyConfigurationError(
            f"target_epsilon needs a planned length, and Trainer(max_epochs={_LIGHTNING_IMPLICIT_MAX_EPOCHS}) is the "
            "value Lightning fills in when neither max_epochs nor max_steps is set: σ would be calibrated for "
            f"{_LIGHTNING_IMPLICIT_MAX_EPOCHS} epochs. Set Trainer(max_epochs=...) or Trainer(max_steps=...) (for "
            f"exactly {_LIGHTNING_IMPLICIT_MAX_EPOCHS} epochs, give max_steps={_LIGHTNING_IMPLICIT_MAX_EPOCHS} × steps "
            f"per epoch = {_LIGHTNING_IMPLICIT_MAX_EPOCHS * steps_per_epoch}).")
    if not candidates:
        raise PrivacyConfigurationError(
            "target_epsilon needs a planned length: set Trainer(max_steps=...) or Trainer(max_epochs=...)."
        )
    return int(min(candidates))


def _injected(sampler: object) -> bool:
    """Whether ``sampler`` may be the ``DistributedSampler(dataloader.dataset)`` Lightning puts in place of a
    ``RandomSampler`` or ``SequentialSampler`` (``_get_distributed_sampler``): that one says nothing of the
    sampler it replaced (over the whole dataset? a prefix? with replacement?)."""
    return type(sampler) is DistributedSampler


def _loader_before_sampler_injection(trainer: "pl.Trainer", dataloader: DataLoader) -> DataLoader:
    """The user's training loader as given. Lightning injects its ``DistributedSampler`` (the private
    strategies are distributed strategies) before :meth:`PrivateTraining.process_dataloader`: in place of a
    ``RandomSampler`` or ``SequentialSampler`` it is a sampler over the whole dataset whatever the user's was,
    and for a loader built from a ``BatchSampler`` the rebuilt one has neither ``batch_size`` nor batch
    sampler. Ask the fit loop's source for the original (the loader passed to ``fit``, or
    ``train_dataloader()`` called again)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    original = source.dataloader() if source is not None and source.is_defined() else None
    if isinstance(original, DataLoader):
        return original
    return dataloader


def _is_train_loader(trainer: "pl.Trainer", dataloader: object) -> bool:
    # Lightning processes the train loader in fit_loop.setup_data with stage TRAINING;
    # validation loaders come through here with SANITY_CHECKING or VALIDATING.
    return trainer.state.stage == RunningStage.TRAINING


def check_noise_arguments(noise_multiplier: Optional[float], target_epsilon: Optional[float],
                          target_delta: Optional[float]) -> None:
    """Exactly one of σ or a target ε (with δ in (0, 1)), as the strategies take them; raises ``ValueError``."""
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("Give exactly one of noise_multiplier (σ) or target_epsilon (with target_delta).")
    check_target(target_epsilon, target_delta)


def check_trainer(trainer: "pl.Trainer", label: str = "DPStrategy", setup: bool = True) -> None:
    """Refuse Trainer settings that would break the guarantee, naming the fix (``label``: the strategy). At the fit's
    ``setup``, ``accumulate_grad_batches`` is taken into the private step (:mod:`lightning_dp._accumulation`); later it
    may not change."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise PrivacyConfigurationError(
            f"{label} supports automatic optimization only: remove `self.automatic_optimization = False` "
            "(the strategy must own backward, clipping and noise). Models that need several optimizers stepped by "
            "hand (a GAN's generator and discriminator) are not supported: train one optimizer over the parameters "
            "the private data trains."
        )
    adopt_gradient_clip(trainer, trainer.strategy, label)  # taken as C, or refused (lightning_dp/_gradient_clip.py)
    check_no_wall_clock_budget(trainer, label)
    if setup:
        adopt_accumulation(trainer, trainer.strategy, label)  # k loader batches per private step (_accumulation.py)
    else:
        keep_planned(trainer, trainer.strategy)  # a constant scheduler's value, set again at an epoch's start
    if trainer.accumulate_grad_batches != 1:
        raise accumulation_changed(trainer, label)
    precision = str(trainer.precision)
    if precision not in SUPPORTED_PRECISION:
        raise PrivacyConfigurationError(
            f"Trainer(precision={precision!r}) is not supported by {label}: fp16 loss scaling rescales "
            "per-example gradients before clipping, and 'true' half precision adds noise in half precision. "
            "Use precision='32-true' or 'bf16-mixed' (autocast; clipping is computed in float32)."
        )


def check_loop(trainer: "pl.Trainer", label: str = "DPStrategy") -> None:
    """The loop settings the mechanism rests on, every step: a callback can change them mid-run
    (``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at an epoch's start)."""
    if trainer.accumulate_grad_batches != 1 or trainer.gradient_clip_val:
        check_trainer(trainer, label, setup=False)
    check_no_wall_clock_budget(trainer, label)  # a duration a hook gave a Timer after setup


def check_no_wall_clock_budget(trainer: "pl.Trainer", label: str = "DPStrategy") -> None:
    """Refuse a wall-clock budget: ``Trainer(max_time=...)`` or a ``Timer`` callback with a duration (a ``Timer``
    without one only measures). How many steps fit in a budget depends on how long each step takes, and that on the
    data (a record slow to load or to process slows every step that samples it and every check that reads it): the
    number of releases would be an un-noised output of the private data (docs/release_boundary.md)."""
    timed = [cb for cb in trainer.callbacks if isinstance(cb, Timer) and getattr(cb, "_duration", None) is not None]
    if timed:
        raise PrivacyConfigurationError(
            f"{label} cannot train under a wall-clock budget (Trainer(max_time=...) or a Timer callback with "
            f"duration={timed[0]._duration}s): how many steps fit in it depends on how long each step takes, which "
            "depends on the private data (a record slow to load or to process slows every step that samples it), so "
            "the number of releases would be an un-noised output of the data. Fix the length before the fit: "
            "Trainer(max_steps=...) or max_epochs=... (a Timer without a duration, Timer(), only measures time).")


def check_no_tuner(trainer: "pl.Trainer", label: str = "DPStrategy") -> None:
    """Refuse Lightning's learning-rate and batch-size finders in a private fit, before any release.

    ``Tuner.lr_find`` and ``LearningRateFinder`` train on the private batches and choose the learning rate from
    their *un-noised* losses (``_LRCallback`` reads each step's loss): that choice is not a function of the
    noised releases, so no accounting of those steps would cover it. Both then restore a temporary checkpoint
    (the weights go back; the ledger keeps the longer record, :meth:`PrivateStep.load_state_dict`).
    ``BatchSizeFinder`` runs steps on the private data too and rewrites the loader's batch size, i.e. q (Lightning
    also refuses it, and ``Tuner.scale_batch_size``, for every DDP-family strategy). Tune on public data, with a
    plain Trainer on a separate copy of the module, then train privately with the values found."""
    tuners = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, (LearningRateFinder, BatchSizeFinder))]
    if tuners:
        raise PrivacyConfigurationError(
            f"{label} cannot run {', '.join(tuners)} (Tuner.lr_find / Tuner.scale_batch_size): it trains on the "
            "private data and picks its value from un-noised losses, which no privacy accounting covers, then restores "
            "a "
            "temporary checkpoint. Tune on public data (a plain pl.Trainer without DPStrategy, on a separate copy of "
            "the module), then train privately with the value found: hyper-parameters chosen on the private data "
            "spend privacy that no accountant here counts (README: Privacy caveats).")


def check_optimizers(optimizers: list[Optimizer], label: str = "DPStrategy",
                     module: Optional[nn.Module] = None) -> None:
    """Exactly one optimizer, not one that re-evaluates the closure, and not one that takes sparse gradients only
    (``module``: the model, whose sparse layers that refusal names)."""
    if len(optimizers) != 1:
        raise PrivacyConfigurationError(f"configure_optimizers returned {len(optimizers)} optimizers. "
                                        f"{_one_optimizer(label)}")
    if isinstance(optimizers[0], torch.optim.LBFGS):
        raise PrivacyConfigurationError(
            "LBFGS re-evaluates the closure: each evaluation would be a new release. Use an optimizer that takes one "
            "gradient per step, e.g. torch.optim.SGD or torch.optim.Adam.")
    sparse = sparse_optimizer_error(optimizers[0], module)
    if sparse is not None:
        raise sparse


def setup_optimizers(strategy: Any, trainer: "pl.Trainer", label: str = "DPStrategy") -> None:
    """``strategy.setup_optimizers(trainer)``, then :func:`check_optimizers`."""
    with one_optimizer_expected(label):
        strategy.setup_optimizers(trainer)
    check_optimizers(strategy.optimizers, label, strategy.lightning_module)


@contextmanager
def one_optimizer_expected(label: str = "DPStrategy") -> Iterator[None]:
    """Turn Lightning's several-optimizers error (raised while optimizers are set up) into ours."""
    try:
        yield
    except RuntimeError as err:
        if "multiple optimizers" in str(err):
            raise PrivacyConfigurationError(f"configure_optimizers returned several optimizers. "
                                            f"{_one_optimizer(label)}") from err
        raise


def _one_optimizer(label: str) -> str:
    return (f"{label} supports exactly one optimizer (one noise draw per step covers all parameters): "
            "put all parameter groups in one optimizer.")


REGISTERED_DEFAULTS: dict[str, float] = {"noise_multiplier": 1.0, "max_grad_norm": DEFAULT_MAX_GRAD_NORM}
"""What ``Trainer(strategy="dp")`` builds: ``DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)`` (σ = 1 and C = 1,
Opacus' example defaults; pass a ``DPStrategy`` instance for anything else). Registered when Lightning and
``lightning_dp`` are both imported, in either order. C is registered as the strategy's default, not as a given
value (:data:`REGISTERED_ARGUMENTS`): a Trainer's ``gradient_clip_val`` becomes C as with ``DPStrategy(...)``."""

REGISTERED_ARGUMENTS: dict[str, float] = {"noise_multiplier": REGISTERED_DEFAULTS["noise_multiplier"]}
"""The arguments the registry passes (C left to its default: :data:`REGISTERED_DEFAULTS`)."""
