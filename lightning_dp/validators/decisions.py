"""Decisions the loop's hooks make after the first step, verified when they are made (rule 3 of
docs/release_boundary.md).

The first step's replays (:mod:`.hook_replays`) judge what the hooks decide as they run at the first step and as
they would run at the plan's last step. A decision that waits for a threshold of the data — a learning rate cut once
the batch loss falls under 0.45, a stop once the training set's loss does, a rate set at validation end from the
training set's accuracy — is made later, by a hook that decided nothing at the first step. Such a decision steers
every later update (or the number of releases) by un-noised training data.

:class:`DecisionWindows`, a callback the strategy puts first in the trainer's callbacks for a private fit, watches the
windows in which the user's hooks run outside a step: a batch's end (``on_train_batch_end``), an epoch's end
(``on_train_epoch_end``) and the end of a validation run during training (``on_validation_epoch_end``,
``on_validation_end``). It notes the decisions as a window opens — every optimizer's hyper-parameters and defaults,
``trainer.should_stop``, ``max_epochs``, ``max_steps``, the library callbacks' and the trainer's settings
(:func:`~.steered_settings.library_settings`: an ``EarlyStopping.patience``, a ``Timer`` duration, a checkpoint or
validation schedule), the loop's counters and limits (:mod:`.loop_counters`: ``global_step``'s counter,
``max_batches``), the mechanism's σ and C — and compares them when it closes (at the next hook of the loop); the
batch and epoch progress, which the loop moves before the window closes, right after a batch's or an epoch's end
hooks ran (Lightning's logger connector told the batch or epoch ended: wrapped for the fit). Only
when they changed are the window's hooks of the module and of the callbacks that are not Lightning's or lightning_dp's
run again, from the decisions (and the user objects' attributes) as they were when it opened: twice as they ran, then on
other data — at a batch's end its loss (every float tensor of its outputs) moved far, then near zero (a decision taken
once it is above a threshold), and, separately, the batch with its values exchanged
(:func:`lightning_dp.record_checks.outside_records.exchanged_copy`), all of them or its floating-point ones only (a
loss is the same on both
exchanged for a model odd in its input); at an epoch's or a validation's end with the training data's copies in memory
exchanged (:mod:`lightning_dp.record_checks.outside_records`), all or the floating-point ones only — each from the same
random seeds. A decision
the other data sets apart, and the second plain run does not (a time, a random draw), came from the training data:
refused before the next release. Decisions the window's hooks do not make again (a scheduler's step, ``EarlyStopping``
on a held-out value, ``ReduceLROnPlateau``) are not theirs to judge: the replays leave them as they were.

What a window cannot see: at a batch's end, a decision whose hook keeps a flag it sets in place (a list, a tensor)
rather than an attribute it binds (its runs again start from the state as it is after it, with only the attributes
put back: a snapshot of the whole state every step would cost too much; an epoch's window takes one), and decisions
made in the step itself
(refused at the release: :meth:`~lightning_dp.privacy.boundary.ReleaseBoundary.check_hyperparameters`).

An exception that ends the fit while a window is open, a ``KeyboardInterrupt`` or ``SystemExit`` too
(:meth:`DecisionWindows.on_exception`), is run again there; raised inside the runs again it is that run's failure
(:class:`~lightning_dp.replays.runs_again.InterruptedRun`, by :func:`~.hook_replays.replaying`).
"""

from __future__ import annotations

import copy
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.hook_replays import (checkpoints_saved, moved_far, moved_near, raised_apart,
                                                  raised_error, replaying, runs_users_code)
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, moved_by_data
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import set_apart
from lightning_dp.records.library_objects import LIBRARY_PREFIXES, library_callback
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.loop_counters import counters_kept, loop_counters, progress
from lightning_dp.validators.loop_wraps import wrap_method
from lightning_dp.validators.mechanism_settings import mechanism_settings, put_mechanism_settings
from lightning_dp.validators.steered_settings import (decisions, hyperparameters_error, loop_controls,
                                                      put_loop_controls, schedulers)
from lightning_dp.validators.mechanism_notes import MechanismNotes
from lightning_dp.validators.optimizer_extra_state import put_state, saved_state
from lightning_dp.record_checks.outside_records import exchanged_copy
from lightning_dp.validators.schedule_state import scheduler_state
from lightning_dp.validators.snapshot import StateSnapshot

__all__ = ["DecisionWindows", "WINDOW_HOOKS"]

WINDOW_HOOKS = {
    "batch": ("on_train_batch_end",),
    "batch start": ("on_train_batch_start",),  # judged only when the step ends in an exception (on_exception)
    "epoch": ("on_train_epoch_end", "on_train_epoch_start"),
    "epoch start": ("on_train_epoch_start",),
    "validation": ("on_validation_epoch_end", "on_validation_end"),
}
"""The user's hooks each kind of window runs again, in the loop's order (callbacks first, then the module)."""


@dataclass
class _Window:
    """A window as it opened: the decisions and their values, the user objects' attributes, the hooks' arguments; an
    epoch's also the kept state's fingerprint and a snapshot of the user's state to run its hooks again from."""

    kind: str
    decisions: Fingerprint
    groups: "_Groups"
    defaults: list[dict[str, Any]]
    controls: dict[str, Any]
    optimizers: list[Any]
    scheduler_states: list[dict[str, Any]]
    trainable: list[tuple[Any, bool]]
    attributes: list[tuple[Any, dict[str, Any]]]
    mechanism: dict[str, Any]
    args: tuple[Any, ...] = ()
    step: int = 0
    state: Optional[Fingerprint] = None
    before: Optional[StateSnapshot] = None
    optimizer_states: list[dict[Any, Any]] = field(default_factory=list)  # :func:`~.optimizer_extra_state.saved_state`
    counters: Callable[[], None] = lambda: None  # puts the loop's counters back (:func:`~.loop_counters.counters_kept`;
    # the progress too at a batch's end: an epoch's hooks run on both sides of the loop's moves, from them as they are)
    steady: Fingerprint = field(default_factory=dict)  # the counters the loop does not move here (``steady=True``)
    progress: Optional[Fingerprint] = None  # the batch and epoch progress as a batch's or an epoch's end opened it
    progress_written: bool = False  # the user's hooks moved that progress (seen as they ended)


class DecisionWindows(pl.Callback):
    """Verify the decisions the user's hooks make outside a step when they make them (module docstring).

    Args:
        exchanged: a context in which the training data's copies in memory hold other values (given ``True``: only
            its floating-point arrays, :meth:`~lightning_dp.record_checks.outside_records.ExchangedRecords.exchanged`).
        settings: a context every run of the hooks is made in (the same random seeds, the boundary's watches paused,
            σ and C kept).
        boundary: the release boundary whose kept state an epoch's hooks may change (what they keep without the data
            is accepted: :meth:`~lightning_dp.privacy.boundary.ReleaseBoundary.accept`).
        logs_moved: a context in which the values logged from the training data read other (a batch's other runs;
            ``exchanged`` moves them too).
        batch_writes: the kept state the batch-end hooks were found to write without the data (the first step's
            replays: an EMA of the weights); a batch's window accepts their changes, and judges them by its runs
            again when ``judge_now()`` says (the steps the batch check samples).
        on_end: called when training ends, after the last window closed and before the user's ``on_train_end``
            hooks (the glue takes the state that ends the fit is judged against).
        any_rank: whether a flag holds on any rank (one all-reduce when distributed): whether a window is judged and
            whether its hooks run again are decided alike on every rank (a rank-0-only time stamp at batch end written
            beside a broadcast: the other rank runs the hooks again too, so their collectives stay paired).
        on_every_rank: ``on_every_rank(check, what)`` runs ``check`` and raises on every rank when any rank's raised
            (one all-reduce when distributed): a window refused on one rank is refused on all, none left waiting in a
            collective of the user's hooks.
        diagnostics_moved: a context in which the non-private diagnostics read other values, the other way from
            ``logs_moved`` (a batch's runs on its exchanged values; ``exchanged`` moves them both ways:
            :mod:`.diagnostic_reads`).
        reads: how many logged values the user's code read outside a step so far (``LoggedReads.count``): a
            decision judged in a window whose hooks read none is not one from a value read before it (:attr:`judged`).
    """

    def __init__(self, exchanged: Callable[[bool], AbstractContextManager],
                 settings: Callable[[], AbstractContextManager], boundary: Any,
                 logs_moved: Callable[[], AbstractContextManager] = nullcontext,
                 batch_writes: Callable[[], set[str]] = set, judge_now: Callable[[], bool] = lambda: False,
                 on_end: Callable[[], None] = lambda: None, any_rank: Optional[Callable[..., Any]] = None,
                 on_every_rank: Optional[Callable[[Callable[[], None], str], None]] = None,
                 diagnostics_moved: Callable[[], AbstractContextManager] = nullcontext,
                 reads: Callable[[], int] = lambda: 0) -> None:
        self._diagnostics_moved = diagnostics_moved
        self._reads, self._reads_at_open = reads, 0
        self._exchanged = exchanged
        self._on_every_rank = on_every_rank or (lambda check, what: check())
        self._any_rank = any_rank or (lambda *flags: flags[0] if len(flags) == 1 else flags)
        self._on_end = on_end
        self._logs_moved = logs_moved
        self._batch_writes = batch_writes
        self._judge_now = judge_now
        self._fingerprint: Optional[tuple[Any, Any]] = None
        self._settings = settings
        self._boundary = boundary
        self._window: Optional[_Window] = None
        self.raised: Optional[tuple[BaseException, bool]] = None  # what the last runs again raised apart
        self.refusal: Optional[Exception] = None  # an exception the fit ended with, found decided from the data
        self._kinds: Optional[frozenset[str]] = None
        self.notes = MechanismNotes()  # σ and C as the last release, a judged window or the library left them
        self._replayed: Optional[Fingerprint] = None  # the decisions the last runs again (on the data) left
        self._saving = False  # a checkpoint the user's hook saves is being written (:meth:`before_checkpoint`)
        self._unwrap: list[Callable[[], None]] = []  # the logger connector's methods wrapped for the fit
        self.judged: Fingerprint = {}  # decisions an epoch's or validation's window whose hooks read no logged value
        # judged (its runs again moved those values both ways): not from one read before it (LoggedReads.check_release)

    # ------------------------------------------------------------------ the loop's hooks
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._kinds = None

    def _watch(self, trainer: "pl.Trainer") -> None:
        """Wrap the logger connector's methods Lightning calls right after a batch's and an epoch's end hooks (before
        the loop counts the batch or the epoch): there the window compares the batch and epoch progress. Once a fit
        (the strategy adds this callback after the ``on_train_start`` hooks ran): undone as the fit ends."""
        if self._unwrap:
            return
        connector = getattr(trainer, "_logger_connector", None)
        for name in ("on_batch_end", "on_epoch_end"):
            if callable(getattr(connector, name, None)):
                self._unwrap.append(wrap_method(connector, name, self._after_hooks(trainer)))

    def _after_hooks(self, trainer: "pl.Trainer") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def ended(*args: Any, **kwargs: Any) -> Any:
                window = self._window
                if window is not None and window.progress is not None:  # the hooks of a batch's or epoch's end ran
                    window.progress_written = window.progress_written or progress(trainer) != window.progress
                    window.progress = None
                return original(*args, **kwargs)
            return ended
        return make

    def _unwatch(self) -> None:
        while self._unwrap:
            self._unwrap.pop()()

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.close(trainer, pl_module)
        self._check_mechanism(trainer, "before step {step}")
        self._open("batch start", trainer, pl_module, (batch, batch_idx))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.close(trainer, pl_module)
        self._open("batch", trainer, pl_module, (outputs, batch, batch_idx))

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._window is None:  # the first epoch's (later ones are in the window an epoch's end opened)
            self._open("epoch start", trainer, pl_module)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.close(trainer, pl_module)
        self._open("epoch", trainer, pl_module)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.close(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.close(trainer, pl_module)
        if not trainer.sanity_checking:
            self._open("validation", trainer, pl_module)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.close(trainer, pl_module)
        self._unwatch()
        self.notes.unwatch()
        self._check_mechanism(trainer, "at the end of training, after step {step}")
        self._on_end()  # first of the on_train_end hooks: the state before the user's (to put back if refused)

    # ------------------------------------------------------------------ windows
    def _users(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> list[Any]:
        """The callbacks that are not Lightning's or lightning_dp's, then the module: whose hooks are run again."""
        return [*(cb for cb in trainer.callbacks if not library_callback(cb)), module]

    def _state(self, trainer: "pl.Trainer", module: "pl.LightningModule", full: bool = True) -> Fingerprint:
        """The kept state as the release boundary fingerprints it (every user callback's too); ``full``: contents
        read anew (else tensors by their version counters: cheap enough for every batch)."""
        users = [cb for cb in self._users(trainer, module) if cb is not module]
        datamodule = getattr(trainer, "datamodule", None)
        if self._fingerprint is None or self._fingerprint[0] is not module:
            self._fingerprint = (module, self._boundary.fingerprint(module))
        return self._fingerprint[1].take([*users, *([datamodule] if datamodule is not None else [])], full=full,
                                         every_callback=True)

    def _snapshot(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> StateSnapshot:
        """The user's state as it is now, to run a window's hooks again from (an epoch's: once an epoch)."""
        return StateSnapshot(module, [o for o in self._users(trainer, module) if o is not module],
                             self._boundary.engine_keys, self._boundary.global_modules())

    def before_checkpoint(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> None:
        """A checkpoint is about to be written while a window is open (``ModelCheckpoint`` saves in its own
        ``on_train_epoch_end``, ``on_train_batch_end`` or ``on_validation_end``, after the user's hooks of that window
        ran): what they wrote so far is judged now, as the window's close judges it — refused before the checkpoint
        is written; kept alike on other data (an epoch count), accepted as what the checkpoint's check and the next
        release compare with — and a window of the same kind opens for the hooks that run after the checkpoint."""
        window = self._window
        if window is None:
            return
        self._saving = _users_save()  # the user's hook saves: whether it does is a decision its runs again judge
        try:
            self.close(trainer, module)
        finally:
            self._saving = False
        self._check_mechanism(trainer, "before a checkpoint after step {step}")
        self._open(window.kind, trainer, module, window.args, judge=window.before is not None)

    def _open(self, kind: str, trainer: "pl.Trainer", module: "pl.LightningModule", args: tuple[Any, ...] = (),
              judge: Optional[bool] = None) -> None:
        self._reads_at_open = self._reads()
        if self._kinds is None:  # which windows have hooks of the user's (none: nothing is noted, nothing costs)
            self._kinds = frozenset(k for k, hooks in WINDOW_HOOKS.items() if runs_users_code(module, hooks))
        if kind not in self._kinds:
            return
        # what the batch-end hooks may write (an EMA), on any rank: the hooks run again alike on every rank
        writes = kind == "batch" and self._any_rank(bool(self._batch_writes()))
        if judge is None:
            judge = kind.startswith("epoch") or (writes and self._judge_now())
        watched = judge or writes
        self._watch(trainer)
        optimizers = list(getattr(trainer, "optimizers", None) or ())
        self._window = _Window(
            kind, decisions(trainer),
            *_settings_of(trainer), loop_controls(trainer), optimizers,
            [copy.deepcopy(scheduler_state(scheduler)) for scheduler in schedulers(trainer)],
            [(p, p.requires_grad) for p in module.parameters()],
            [(o, _public_attributes(o)) for o in self._users(trainer, module)], mechanism_settings(trainer), args,
            trainer.global_step,
            self._state(trainer, module, full=judge) if watched else None,
            self._snapshot(trainer, module) if judge else None, [saved_state(o) for o in optimizers],
            counters_kept(trainer, with_progress=kind == "batch"), loop_counters(trainer, steady=True),
            progress(trainer) if kind in ("batch", "epoch") else None)

    def close(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> None:
        """End the open window: if its hooks changed a decision (or, an epoch's, the kept state), verify it; raises
        :class:`~lightning_dp.errors.PrivacyConfigurationError` when the training data set it."""
        window, self._window = self._window, None
        if window is None or window.kind == "batch start":  # the step judges what they decide (its release's checks)
            return
        judged = window.before is not None
        if window.progress is not None:  # closed before the loop moved the progress (a checkpoint saved in the hooks)
            window.progress_written = window.progress_written or progress(trainer) != window.progress
        decided_now = decisions(trainer) != window.decisions or self._saving or window.progress_written \
            or loop_counters(trainer, steady=True) != window.steady  # (global_step, max_batches: T21, T20)
        written = [] if window.state is None else \
            StateFingerprint.changed(window.state, self._state(trainer, module, full=judged))
        # alike on every rank (one all-reduce): whether anything is judged, and whether the hooks run again
        anything, decided_now = self._any_rank(bool(written) or decided_now, decided_now)
        if not anything:
            return
        if window.kind == "batch" and not judged:  # what the batch-end hooks may write: accepted (judged elsewhere)
            allowed = self._batch_writes()
            written = [name for name in written if name in allowed]
        self.raised, self._replayed = None, None
        steered = self._steered(window, trainer, module) if judged or decided_now else []
        where = _WHERE[window.kind].format(step=window.step)
        raised = self.raised
        decided = sorted((n for n in steered if n.startswith(_DECISIONS)),
                         key=lambda n: [n.startswith(p) for p in _DECISIONS].index(True))  # the stop, then the rest

        def refuse() -> None:
            if raised is not None:  # the runs on other data raised where the run on the data did not
                raise raised_error(*raised, where.replace("the hooks set it apart", "the hooks ran apart"))
            if decided:
                raise hyperparameters_error(decided, where)
            if steered:
                raise self._boundary.written_error(steered, f"{where}: computed from the training data, kept for "
                                                            "later steps")
        self._on_every_rank(refuse, f"found decisions or state set from the data {where}")
        self.notes.accounted(window.mechanism, self._replayed, trainer)  # what its hooks set again alike: judged
        if decided_now and self._replayed is not None and window.kind != "batch" \
                and self._reads() == self._reads_at_open:
            self.judged.update({k: v for k, v in decisions(trainer).items() if window.decisions.get(k, _ABSENT) != v})
        if written:  # what the hooks kept without the data: the next release compares with it
            self._boundary.accept(written)

    def _steered(self, window: _Window, trainer: "pl.Trainer", module: "pl.LightningModule") -> list[str]:
        """Run the window's hooks again (twice as they ran, then on other data), each from the decisions and the
        user objects' attributes as the window opened (an epoch's: the whole user state, from its snapshot); the
        decisions (and, an epoch's, the kept state) the other data set apart. The run's state is put back as it is
        now afterwards."""
        users = [o for o, _ in window.attributes if o is not module]
        after = StateSnapshot(module, users, self._boundary.engine_keys, self._boundary.global_modules())
        now = _settings_of(trainer), loop_controls(trainer), mechanism_settings(trainer), counters_kept(trainer)
        kept = (list(trainer.strategy.optimizers), [copy.deepcopy(s.state_dict()) for s in schedulers(trainer)],
                [(p, p.requires_grad) for p in module.parameters()],
                [saved_state(o) for o in trainer.strategy.optimizers])
        runs: list[Optional[Fingerprint]] = []
        errors: list[Optional[Exception]] = []  # what each run raised (None: it finished)
        clock = ClockReads(owners=[module, *users])  # the first run's clock values, read by the others
        draws = DrawReads(owners=[module, *users])  # and its unseeded draws
        try:
            for variant in _variants(window, self._exchanged, self._logs_moved, self._diagnostics_moved):
                after.restore()
                if window.before is not None:  # an epoch's: everything as the window opened (a layer's dropout rate)
                    window.before.restore()
                _put_back(window, trainer)
                try:
                    with self._settings(), clock.next_run(), draws.next_run(), replaying(module, rates=False), \
                            torch.no_grad():
                        saved = len(checkpoints_saved())
                        _run_hooks(window, trainer, module, variant)
                        state = self._state(trainer, module) if window.before is not None else {}
                        runs.append({**state, **decisions(trainer), **loop_counters(trainer),  # inside: leaving a
                                     # replay puts schedulers back
                                     "trainer checkpoints saved": checkpoints_saved()[saved:]})
                    errors.append(None)
                except PrivacyConfigurationError:
                    raise
                except Exception as err:  # noqa: BLE001  (other values a hook cannot take: that run is not compared)
                    runs.append(None)
                    errors.append(err)
        finally:
            after.restore()
            _put_decisions(trainer, *kept)
            _put_settings(trainer, *now[0])
            put_loop_controls(trainer, now[1])
            put_mechanism_settings(trainer, now[2])
            now[3]()
        # a stop by raising: the loss moved (a batch's runs 3 and 4) is judged both ways, exchanged values only when
        # the runs on the data raised (a hook may rightly reject values the exchange made)
        judged = [window.kind == "batch" and i < 2 for i in range(len(errors) - 2)]
        self.raised = raised_apart(errors[0], errors[1], list(zip(errors[2:], judged)))
        self._replayed = runs[0]
        return sorted(set_apart(runs[0], runs[1], runs[2:], moved_by_data))

    def _check_mechanism(self, trainer: "pl.Trainer", where: str) -> None:
        """σ, C and the clipping policy's settings as noted (:mod:`.mechanism_notes`): a change since the last release
        that no window judged (a scheduler's lambda) is refused, on every rank, before the next release."""
        where = where.format(step=trainer.global_step)
        self._on_every_rank(lambda: self.notes.check(trainer, where), f"found σ or C changed unjudged {where}")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """An exception left the fit while a window was open (a user's hook raised it at a batch's, an epoch's or a
        validation's end): the window's hooks run again as its close would run them; raised on the data and not on
        other data (the loss moved far or near zero, the training data exchanged), it is a decision made from the
        data — a stop the user's script catches (zoo13 exc1) — and :attr:`refusal` holds its refusal, which the
        strategy raises in place of the exception (:meth:`~lightning_dp._strategy_glue.PrivateTraining.on_exception`).
        """
        window, self._window, self.refusal = self._window, None, None
        self._unwatch()
        self.notes.unwatch()
        if window is None or isinstance(exception, PrivacyConfigurationError):  # (a KeyboardInterrupt too: raised
            return  # by the user's hook from the batch, it is a stop by raising; the user's own Ctrl-C is not apart)
        self.raised = None
        try:
            self._steered(window, trainer, pl_module)
        except Exception:  # noqa: BLE001  (the checks failed on a fit already failing: the user's exception stands)
            return
        if self.raised is not None and self.raised[1]:
            self.refusal = raised_error(self.raised[0], True, _WHERE[window.kind].format(step=window.step).replace(
                "the hooks set it apart", "the hooks ran apart"))


_DECISIONS = ("trainer ", "privacy ", "model trainable", "scheduler ", "optimizer ")


def _users_save() -> bool:
    """Whether the checkpoint being written was asked for by the user's code (``trainer.save_checkpoint`` in a hook
    of the user's), not by a library's (``ModelCheckpoint``)."""
    frame: Any = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "save_checkpoint"
                                     and frame.f_globals.get("__name__", "").endswith("trainer.trainer")):
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    return caller is not None and not caller.f_globals.get("__name__", "").startswith(LIBRARY_PREFIXES)


_WHERE = {
    "batch": "at the end of step {step} (on_train_batch_end), from the batch or its loss: run again when it was made, "
             "on the batch with its values exchanged or its loss moved far or near zero, the hooks set it apart",
    "batch start": "at the start of step {step} (on_train_batch_start), from the batch: run again on the batch with "
                   "its values exchanged, the hooks set it apart",
    "epoch start": "at the start of an epoch (on_train_epoch_start, after step {step}), from the training data: run "
                   "again when it was made, with the training data's values exchanged, the hooks set it apart",
    "epoch": "at the end of an epoch (on_train_epoch_end, after step {step}), from the training data: run again when "
             "it was made, with the training data's values exchanged, the hooks set it apart",
    "validation": "at the end of a validation during training (on_validation_epoch_end/on_validation_end, after step "
                  "{step}), from the training data: run again when it was made, with the training data's values "
                  "exchanged, the hooks set it apart",
}


def _public_attributes(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes a user names (not ``_``-prefixed: Lightning's and torch's own are)."""
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


_Groups = list[list[tuple[dict[str, Any], dict[str, Any]]]]
"""Per optimizer: (parameter group, its hyper-parameters) of every group."""


def _settings_of(trainer: "pl.Trainer") -> tuple[_Groups, list[dict[str, Any]]]:
    """Every optimizer's parameter groups with their hyper-parameters, and its defaults."""
    optimizers = list(getattr(trainer, "optimizers", None) or ())
    return ([[(g, {k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups] for opt in optimizers],
            [dict(getattr(opt, "defaults", None) or {}) for opt in optimizers])


def _put_settings(trainer: "pl.Trainer", groups: _Groups, defaults: list[dict[str, Any]]) -> None:
    """Every optimizer's parameter groups (a group added since goes), their hyper-parameters and the defaults as
    given (a key set since goes)."""
    for optimizer, kept, saved in zip(getattr(trainer, "optimizers", None) or (), groups, defaults):
        optimizer.param_groups[:] = [group for group, _ in kept]
        for group, values in kept:
            params = group["params"]
            group.clear()
            group.update(values, params=params)
        if isinstance(getattr(optimizer, "defaults", None), dict):
            optimizer.defaults.clear()
            optimizer.defaults.update(saved)


def _put_decisions(trainer: "pl.Trainer", optimizers: list[Any], states: list[dict[str, Any]],
                   trainable: list[tuple[Any, bool]], optimizer_states: list[dict[Any, Any]]) -> None:
    """Which optimizers step, the schedulers' states, which parameters train and the optimizers' rebound state
    entries (a loss kept for a loss-aware step size), as given."""
    if list(trainer.strategy.optimizers) != optimizers:
        trainer.strategy.optimizers = optimizers
    for optimizer, saved in zip(optimizers, optimizer_states):
        put_state(optimizer, saved)
    for scheduler, state in zip(schedulers(trainer), states):
        scheduler.load_state_dict(copy.deepcopy(state))
    for p, flag in trainable:
        if p.requires_grad != flag:
            p.requires_grad_(flag)


def _put_back(window: _Window, trainer: "pl.Trainer") -> None:
    """The decisions and the user objects' attributes as the window opened."""
    _put_decisions(trainer, window.optimizers, window.scheduler_states, window.trainable, window.optimizer_states)
    _put_settings(trainer, window.groups, window.defaults)
    put_loop_controls(trainer, window.controls)
    window.counters()
    put_mechanism_settings(trainer, window.mechanism)
    for obj, attributes in window.attributes:
        for key in [k for k in _public_attributes(obj) if k not in attributes]:
            delattr(obj, key)
        for key, value in attributes.items():
            if vars(obj).get(key, _ABSENT) is not value:
                setattr(obj, key, value)


_ABSENT = object()


def _variants(window: _Window, exchanged: Callable[[bool], AbstractContextManager],
              logs_moved: Callable[[], AbstractContextManager],
              diagnostics_moved: Callable[[], AbstractContextManager] = nullcontext,
              ) -> list[tuple[AbstractContextManager, tuple[Any, ...]]]:
    """(context, hook arguments) of each run: the window's own twice, then the other data (a batch's exchanged
    values with the non-private diagnostics moved too: ``logs_moved`` moves them the other way)."""
    if window.kind == "batch start":
        batch, batch_idx = window.args
        return [(nullcontext(), window.args), (nullcontext(), window.args),
                (diagnostics_moved(), (exchanged_copy(batch), batch_idx)),
                (diagnostics_moved(), (exchanged_copy(batch, floating_only=True), batch_idx))]
    if window.kind != "batch":
        return [(nullcontext(), ()), (nullcontext(), ()), (exchanged(False), ()), (exchanged(True), ())]
    outputs, batch, batch_idx = window.args
    return [(nullcontext(), window.args), (nullcontext(), window.args),
            (logs_moved(), (moved_far(outputs), batch, batch_idx)),
            (diagnostics_moved(), (moved_near(outputs), batch, batch_idx)),
            (diagnostics_moved(), (outputs, exchanged_copy(batch), batch_idx)),
            (diagnostics_moved(), (outputs, exchanged_copy(batch, floating_only=True), batch_idx))]


def _run_hooks(window: _Window, trainer: "pl.Trainer", module: "pl.LightningModule",
               variant: tuple[AbstractContextManager, tuple[Any, ...]]) -> None:
    """The window's hooks, of every user callback, then of the module, with the variant's data."""
    context, args = variant
    callbacks = [cb for cb in trainer.callbacks if not library_callback(cb)]
    with context:
        for name in WINDOW_HOOKS[window.kind]:
            for cb in callbacks:
                getattr(cb, name)(trainer, module, *args)
            getattr(module, name)(*args)
