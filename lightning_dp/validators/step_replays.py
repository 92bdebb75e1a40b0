"""The replays of the user's hooks around Lightning's private step: the run-time checks that need the trainer.

Rule 3 of docs/release_boundary.md (kept state) is checked by comparing fingerprints before every release; this
module holds what a fingerprint alone cannot tell — whether a write, a hyper-parameter or a decision was *computed
from the data* — and tells it the one way that works on code nobody here wrote: the user's hooks run again from the
same state and the same random seeds, on the training data, on it again, and on other data (the batch exchanged,
its loss moved far, the training set's copies in memory exchanged; :mod:`lightning_dp.record_checks.outside_records`).
What the other data
sets apart and the second plain run does not is the data's (:func:`.fingerprint_entries.moved_by_data`); it is refused
before any release, on every rank alike. The checks, in the order a fit meets them:

- :meth:`StepReplays.verify` — the first step: the probe (:mod:`.probe`) on ``training_step``, and the batch hooks
  replayed as the module runs now and at the plan's last step (:meth:`StepReplays._replay_now_and_later`), with the
  epoch hooks (:meth:`StepReplays._replay_epoch_hooks`: a warm start, a rate from the training-set accuracy);
- :meth:`StepReplays.check_batch` — the batch check (:mod:`.batch_check`) on a step's examples, at the first step
  also as the module runs later in the plan and at the next steps whose loss differs
  (:meth:`StepReplays.check_later_in_the_plan`);
- :meth:`StepReplays.judge_before_release` — at a later checked step, what the hooks before the release were found
  to write alike on all data (a counter) is judged again on this step's examples.

Every replay runs inside :meth:`StepReplays.replay_settings`: the same seeds, the library's watches paused, σ and C
kept, no checkpoint file written. :class:`StepReplays` reads the strategy through the few members of
:class:`Strategy`; it imports no Lightning (the glue imports it; Lightning imports the glue).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Union

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.fetch import seeded
from lightning_dp.validators.diagnostic_reads import moved as diagnostics_moved
from lightning_dp.validators.diagnostic_reads import paused as diagnostics_paused
from lightning_dp.validators.hook_replays import (BatchEndWrites, batch_start, configured_settings, model_kept,
                                                  moved_near, overrides_epoch_hooks, progress_as, raised_apart,
                                                  raised_error, replay_batch_hooks,
                                                  replay_epoch_hooks, replaying, runs_users_code, users_hook,
                                                  weights_moved_by_data, weights_sketch)
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, moved_by_data
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import run_once, set_apart
from lightning_dp.replays.starting_state import StartingState
from lightning_dp.records.library_objects import library_callback
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.mechanism_settings import mechanism_settings, put_mechanism_settings
from lightning_dp.validators.steered_settings import (hyperparameters_error, library_settings, replay_decisions,
                                                      replay_records, state_written)
from lightning_dp.record_checks.outside_records import ExchangedRecords, exchanged_copy
from lightning_dp.validators.rng import decided_from_data_error, seeds_recorded
from lightning_dp.validators.pre_hook_state import PreHookState
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.value_copies import logged_names

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from lightning_dp.validators.logged_reads import LoggedReads
    from lightning_dp.validators.record_reads import RecordWatch

__all__ = ["BATCH_HOOKS", "EPOCH_BOUNDARY_HOOKS", "NEXT_STEPS", "VALIDATION_HOOKS", "StepReplays", "Strategy",
           "checkpoint_files_kept", "exchanged_around", "observers", "users_objects", "weights_fitted"]

BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_train_batch_end")
"""The hooks around a step that are handed the batch, its loss or its outputs."""

EPOCH_BOUNDARY_HOOKS = ("on_train_epoch_start", "on_train_epoch_end")
"""The hooks at an epoch's boundary: when the user's code has one, an epoch's first step is always checked."""

VALIDATION_HOOKS = ("validation_step", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                    "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end")
"""The hooks after which user code may have switched the step's behaviour on: an epoch's first step and the step after
a validation are then always checked (``verify="sampled"``)."""

NEXT_STEPS = 8
"""How many steps after the first :meth:`StepReplays._steps_that_differ` looks at."""


class Strategy(Protocol):
    """What the replays read of the private strategy (:class:`~lightning_dp._strategy_glue.PrivateTraining`)."""

    label: str
    private_step: Any  # privacy.private_step.PrivateStep (privacy is the floor above)
    max_physical_batch_size: Optional[int]
    _distributed: bool
    _logged_reads: Optional["LoggedReads"]
    _record_watch: Optional["RecordWatch"]

    @property
    def lightning_module(self) -> Any: ...
    @property
    def precision_plugin(self) -> Any: ...
    @property
    def optimizers(self) -> list[Any]: ...
    @property
    def steps_per_epoch(self) -> Optional[int]: ...
    def _as_loop_batch(self, batch: Any) -> Any: ...
    def _collated(self, indices: list[int]) -> Any: ...
    def _planned_steps(self) -> int: ...


def observers(trainer: "pl.Trainer") -> list[Any]:
    """The callbacks and the LightningDataModule: what, besides the module, may keep state from the batch."""
    datamodule = getattr(trainer, "datamodule", None)
    return [*trainer.callbacks, *([datamodule] if datamodule is not None else [])]


def users_objects(trainer: "pl.Trainer") -> list[Any]:
    """The callbacks that are not Lightning's or lightning_dp's, and the datamodule: the user's objects a replay of
    their hooks compares and puts back."""
    return [cb for cb in observers(trainer) if not library_callback(cb)]


class StepReplays:
    """The user's hooks run again around the private step, to tell what they compute from the data (module
    docstring); one per strategy. ``batch_end_writes`` and ``before_release_writes`` are what the first step's
    replays found written alike on all data (an EMA, a counter): accepted at the releases, judged again later."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.batch_end_writes: set[str] = set()  # kept state the batch-end hooks write without the data (an EMA)
        self.before_release_writes: set[str] = set()  # what the step's hooks write alike on all data (a counter)
        self.batch_checked = False  # the batch check ran on this step (its batch-end window is judged)
        self._hooks_of_users: dict[tuple[str, ...], tuple[Any, bool]] = {}  # which hooks the user's code has
        self.pre_hooks: Optional[PreHookState] = None  # the state before the hooks that see no batch ran (connect)

    @property
    def step(self) -> Any:
        """The strategy's private step (its boundary, its exchanged training data, its collectives)."""
        return self.strategy.private_step

    def reset(self) -> None:
        """A fit ended: the next one finds its writes afresh."""
        self.batch_end_writes, self.before_release_writes = set(), set()

    def judged_this_step(self) -> bool:
        """Whether the batch check ran on this step (then its batch-end window judges what the hooks write)."""
        judged, self.batch_checked = self.batch_checked, False
        return judged

    @contextmanager
    def other_data(self, floating_only: bool) -> Iterator[None]:
        """The training data's copies in memory exchanged (given ``True``: its floating-point arrays only), and the
        values logged from it moved (far, or near zero with the floating-point arrays only: either side of a
        threshold), as are the non-private diagnostics (with the exchange): what the hooks that read no batch see of
        other data."""
        reads = self.strategy._logged_reads
        with self.step.exchanged_training_data().exchanged(floating_only, fixed_integers=True), \
                reads.moved(not floating_only) if reads is not None else nullcontext():
            yield

    @contextmanager
    def replay_settings(self) -> Iterator[None]:
        """What every replay of the user's hooks runs in: the same random seeds, the boundary's watches paused, σ and C
        kept."""
        with seeded(0), self.watches_paused(), self.privacy_settings_kept():
            yield

    def users_code_runs(self, hooks: tuple[str, ...]) -> bool:
        """Whether the module or a callback that is not Lightning's or lightning_dp's has one of ``hooks`` of its own
        (answered once per fit and set of hooks)."""
        module = self.strategy.lightning_module
        known = self._hooks_of_users.get(hooks)
        if known is None or known[0] is not module:
            known = self._hooks_of_users[hooks] = (module, runs_users_code(module, hooks))
        return known[1]

    def verify(self) -> None:
        """The first step's probe (:mod:`~lightning_dp.validators.probe`) on the user's ``training_step``."""
        module = self.strategy.lightning_module

        def loss_of(batch: Any) -> Any:
            with self.strategy.precision_plugin.train_step_context(), replaying(module):
                batch_start(module, batch, 0)
                return module.training_step(batch, 0)

        low = "16" in str(module.trainer.precision)
        try:
            with stop_decisions_kept(module.trainer):  # the probe's passes: no trace (the real step's are judged)
                self.step.verify(loss_of, low_precision=low, to_device=self.strategy._as_loop_batch,
                                 what="training_step", replay_hooks=self._replay_now_and_later)
            self.pre_hooks = None  # judged: the copies it holds go
        except PrivacyConfigurationError as err:
            if "DTensor" not in str(err):
                raise
            raise PrivacyConfigurationError(
                f"{err}\nUnder {self.strategy.label} FSDP2 gathers a sharded module's parameters only when that "
                "module's forward runs: call the sharded module (self(...)) from training_step, not a submodule or a "
                "method that skips its forward.") from err

    def _replay_now_and_later(self, batch: Any, other: Any, judge_writes: bool = False) -> None:
        """The batch hooks replayed on the probe's batch as the module runs now and as it would run later in the plan
        (:meth:`_later_in_the_plan`, at an epoch's last ``batch_idx``): a memory bank filled from a later epoch on is
        refused before any release. Each is replayed twice on the batch (each replay reads the first one's clock
        values, :mod:`~lightning_dp.replays.clock`: what those two still set apart, not a number, is not judged) and
        once on ``other`` examples, their loss moved far, then likewise on the batch with its loss moved near zero (a
        decision taken once the loss is above a threshold) and on the batch with its values exchanged
        (:func:`~lightning_dp.record_checks.outside_records.exchanged_copy`; a replay the exchanged values make fail is
        left out; the non-private diagnostics moved far up with the loss, down with the exchanged values:
        :mod:`.diagnostic_reads`), every replay from the same seeds: a hyper-parameter, ``trainer.should_stop``,
        ``max_epochs``/``max_steps``, a seed of a global generator or an epoch ended by ``on_train_batch_start``
        returning -1 that the other replay sets apart is set from the data
        (:func:`~.fingerprints.fingerprint_entries.moved_by_data`, :func:`~.validators.rng.seeds_recorded`)."""
        module, precision = self.strategy.lightning_module, self.strategy.precision_plugin
        per_epoch = max(1, self.strategy.steps_per_epoch or 1)
        trainer, optimizer = module.trainer, self.strategy.optimizers[0]
        decisions: list[list[Any]] = []
        boundary = self.step.boundary
        users = users_objects(trainer)
        # alike on every rank (one all-reduce): judging the writes replays the hooks another number of times
        judged = self.step.any_rank(
            bool(judge_writes or self.users_code_runs(BATCH_HOOKS) or self.step.probe_writes))
        writes = BatchEndWrites(boundary, module, users) if judged else None
        unjudged = None if writes is not None else \
            (boundary.fingerprint(module),
             StateSnapshot(module, users, boundary.engine_keys, boundary.global_modules()))
        start = None if unjudged is None else unjudged[0].take(users)
        outside = self.training_copies()  # exchanged with the batch: a statistic of the training set is the data's

        def replay(examples: Any, progress: Optional[tuple[int, int]],
                   moved: Union[bool, Callable[[Any], Any]] = False) -> Callable[[], None]:
            def run() -> None:  # each replay from the same seeds (and state) and clock values: a random draw, a time
                first = writes is not None and not writes.runs  # stamp is not the data's
                try:
                    with seeded(0), clock.next_run(), draws.next_run(), seeds_recorded() as calls, \
                            progress_as(trainer, *progress) if progress is not None else nullcontext(), \
                            diagnostics_moved(self.step, up=moved) if examples is not batch else nullcontext():
                        decisions.append(calls)  # σ and C: put back by replay_records, which compares them
                        batch_idx = 0 if progress is None else min(per_epoch - 1, progress[0])  # `if batch_idx >= k`
                        try:
                            with exchanged_around(outside if moved is False and examples is not batch else None,
                                                  writes.before_end if writes else lambda: None) as before_end:
                                ended = replay_batch_hooks(module, precision, examples, batch_idx, moved,
                                                           before_end=before_end, names=names,
                                                           hooks=writes is None)  # (put back with the rest)
                        except PrivacyConfigurationError:
                            raise
                        except Exception as err:  # noqa: BLE001  (judged by raised_apart: a stop by raising)
                            raised.append(err)
                            return
                        raised.append(None)
                        calls.append(("on_train_batch_start returned -1", ended))
                        taken.append(replay_decisions(optimizer, trainer))  # before the user's state is put back:
                        if writes is not None:                              # a policy their callback holds and set
                            writes.ran(first)
                finally:
                    if writes is not None:
                        writes.put_back()
            return run

        where = ("from the batch by the hooks around a step (on_train_batch_start/end, on_before_backward, "
                 "training_step), replayed on the probe's examples, on half of them and on them exchanged")
        for progress in (None, *self._later_in_the_plan()):
            # (examples, loss moved, whether a raise on them alone is judged: the loss moved, not values exchanged)
            variants = ((other, True, True), (batch, moved_near, True), (exchanged_copy(batch), False, False))
            for second, moved, judge_raise in variants:
                decisions.clear()
                clock = ClockReads(owners=[module, *users])  # the first replay's clock values, read by the others
                draws = DrawReads(owners=[module, *users])  # and its unseeded draws
                raised: list[Optional[Exception]] = []  # what each replay raised (None: it finished)
                names: list[frozenset] = []  # the (hook, name) pairs each replay logged (logged_names)
                taken: list[Fingerprint] = []  # the decisions as each replay left them (replay_decisions)
                if writes is not None:
                    writes.runs.clear()
                with self.watches_paused():  # the first two alike: what differs between them is not the data's
                    before, seen = replay_records(optimizer, [replay(batch, progress), replay(batch, progress),
                                                              replay(second, progress, moved)], loop=trainer)
                # the replays start again judging the writes on every rank when any rank's wrote (one all-reduce)
                again = unjudged is not None and bool(StateFingerprint.changed(start, unjudged[0].take(users)))
                if self.step.any_rank(again):
                    if unjudged is not None:
                        unjudged[1].restore()  # training_step wrote what the probe's passes left alike (global_step)
                    return self._replay_now_and_later(batch, other, judge_writes=True)

                def judge() -> None:  # refused on every rank alike: no rank goes on to replay hooks its peer left
                    apart = raised_apart(raised[0], raised[1], [(raised[2], judge_raise)]) if len(raised) == 3 \
                        else None
                    if apart is not None:  # a stop by raising, decided from the loss or the batch
                        raise raised_error(*apart, "in the hooks around a step (on_train_batch_start/end, "
                                           "on_before_backward, training_step), replayed on the probe's examples, "
                                           + ("on half of them with the loss moved far" if second is other else
                                              "with the loss moved near zero" if moved else "on them exchanged"))
                    if any(err is not None for err in raised):  # exchanged values a step cannot take: not compared
                        return
                    if hooks := logged_names.names_apart(names):
                        raise logged_names.names_error(hooks, "replayed on the probe's examples " + (
                            "and on half of them with the loss moved far" if second is other else
                            "with the loss moved near zero" if moved else "and on them exchanged"))
                    if writes is not None:
                        self.batch_end_writes |= writes.judged()
                        self.before_release_writes |= writes.before_release
                    steered = state_written(before, seen) + moved_by_data(*seen)
                    if len(taken) == 3:  # what a replay decided through an object the user's state holds
                        steered += [n for n in moved_by_data(*taken) if n not in steered]
                    if steered:
                        raise hyperparameters_error(steered, where)
                    if len(decisions) == 3 and decisions[0] == decisions[1] != decisions[2]:
                        raise decided_from_data_error([decisions[0], decisions[2]], "by the hooks around a step "
                                                      "(training_step, on_train_batch_start/end, on_before_backward)")
                self.step.on_every_rank(judge, "found the batch hooks' replays steered by the data")
                if raised and raised[0] is not None:  # raised on the data, alike on other data: as the loop would
                    self._judge_epoch_hooks(progress)  # (the hooks that see no batch judged all the same)
                    raise raised[0]
            self._judge_epoch_hooks(progress)
        if writes is not None and writes.rewritten:  # the weights the replays wrote and put back, as they are now
            boundary.accept([f"parameter {name}" for name in writes.rewritten])

    def judge_before_release(self, indices: list[int], batch_idx: int) -> None:
        """At a step the batch check runs after the first: what the hooks before the release were found to write
        alike on every data (a counter, a time stamp: accepted at every release) is judged again. The batch-start
        hooks, ``training_step`` and ``on_before_backward`` run from the state as it is now and the same seeds on this
        step's examples twice, on them exchanged and on half of them with the loss moved far
        (:func:`~.validators.hook_replays.replay_batch_hooks`, without the batch-end hooks); state the other data set
        apart, and the second plain run does not, turned to the data: refused before this step's release."""
        # alike on every rank (one all-reduce): a rank with no examples this step replays the hooks on a stand-in (the
        # first record), judging nothing, so that the collectives in its hooks meet its peers'
        names_due = logged_names.take_due()  # a set of logged names not seen before (LoggedReads.install)
        if not self.step.any_rank(bool((self.before_release_writes or names_due) and indices)):
            return
        judged = bool(self.before_release_writes and indices)
        indices = indices or [0]
        module = self.strategy.lightning_module
        trainer, boundary = module.trainer, self.step.boundary
        users = users_objects(trainer)
        fingerprint = boundary.fingerprint(module)
        back = StartingState(lambda: StateSnapshot(module, users, boundary.engine_keys, boundary.global_modules())
                             .restore, lambda: model_kept(module, weights=True))
        batch = self.strategy._collated(indices)
        runs: list[Optional[dict[str, Any]]] = []
        names: list[frozenset] = []  # the (hook, name) pairs each run logged (logged_names)
        clock = ClockReads(owners=[module, *users])  # the first run's clock values, read by the others
        draws = DrawReads(owners=[module, *users])  # and its unseeded draws

        def replay(examples: Any, moved: bool = False, outside: Optional[ExchangedRecords] = None
                   ) -> Callable[[], None]:  # a run that fails is not compared; read with the data back in place
            return lambda: runs.append(run_once(
                lambda: replay_batch_hooks(module, self.strategy.precision_plugin, examples, batch_idx, moved,
                                           end=False, names=names), seeded(0), clock.next_run(), draws.next_run(),
                self.privacy_settings_kept(),
                outside.exchanged(fixed_integers=True) if outside is not None else nullcontext(),
                read=lambda: fingerprint.take(users, full=True, every_callback=True), then=back.put_back))

        half = self.strategy._collated(indices[: max(1, len(indices) // 2)])
        outside = self.training_copies()
        with self.watches_paused():
            replay_records(self.strategy.optimizers[0], [replay(batch), replay(batch), replay(half, True),
                                                         replay(exchanged_copy(batch), outside=outside)], loop=trainer)
        moved = sorted(set_apart(runs[0], runs[1], runs[2:], moved_by_data)) if judged else []
        named = logged_names.names_apart([n for n, run in zip(names, runs) if run is not None]) \
            if len(names) == len(runs) and runs[0] is not None and runs[1] is not None and indices else []
        self.refuse_on_every_rank(logged_names.names_error(named, (
            f"before the release of step {trainer.global_step}, replayed on this step's examples, on them exchanged "
            "and on half of them with the loss moved far")) if named else boundary.written_error(moved, (
                f"before the release of step {trainer.global_step} (on_train_batch_start, training_step, "
                "on_before_backward), from the batch, its loss or the training set: written alike on the first step's "
                "examples, run again on this step's, on them exchanged (the training set's copies with them) and with "
                "the loss moved far, the hooks set it apart"))
            if moved else None, "found state or names the hooks before the release set from the batch")

    def _judge_epoch_hooks(self, progress: Optional[tuple[int, int]]) -> None:
        """:meth:`_replay_epoch_hooks`, failing closed: the replays catch what the user's hooks raise, so an
        exception that leaves them is the judge's own, and the hooks it was to judge are unjudged — refused (the
        caller of the first step's replays leaves out a run the loop's hooks cannot make, and would train)."""
        try:
            self._replay_epoch_hooks(progress)
        except PrivacyConfigurationError:
            raise
        except Exception as err:  # noqa: BLE001  (named in the refusal; its message may hold the data's values)
            refusal: Optional[PrivacyConfigurationError] = PrivacyConfigurationError(
                f"The replays of the hooks that see no batch (setup, configure_model, on_fit_start, on_train_start, "
                f"on_train_epoch_start/end) could not be judged: {type(err).__name__} was raised outside your hooks "
                "(in reading or putting back the state they keep). What those hooks compute from the training data "
                "cannot be told from a constant, so the fit is refused before any release. Keep the state these "
                "hooks write to plain values, tensors and containers of them (an object whose attributes raise when "
                "read or set cannot be compared or put back).")
            refusal.__cause__ = err
            self.refuse_on_every_rank(refusal, "found the epoch hooks' replays failing")
            return
        self.refuse_on_every_rank(None, "found the epoch hooks' replays failing")

    def _replay_epoch_hooks(self, progress: Optional[tuple[int, int]]) -> None:
        """The epoch hooks of the module and of the callbacks that are not Lightning's or lightning_dp's
        (``on_train_start``, ``on_train_epoch_start``/``end``; ``setup``, ``configure_model`` and ``on_fit_start``
        before them, the datamodule's ``setup`` first), replayed as the module runs at ``progress`` (``None``:
        now), each from the same state — the state before the real hooks ran (:attr:`pre_hooks`,
        :mod:`.pre_hook_state`), so that a write made on one side of a threshold only is made by one replay — and
        the same random seeds: on the training data, with its copies in memory
        exchanged for other values (:mod:`~lightning_dp.record_checks.outside_records`), and — only when those two
        differ — on the training data again. What the exchanged replay leaves apart from the first, and the second
        plain replay does not (each reads the first one's clock values: a time stamp is alike), is the data's, no
        noise covers it, and later steps can read it: a learning rate or a stop (a rate from the training set's
        accuracy), a seed, the state of the module, of any user callback
        (one that never sees the batch may still read the dataset: a teacher trained on it at epoch end for the step
        to distil from) and of the datamodule. Refused before any release (a report may be declared public)."""
        module = self.strategy.lightning_module
        trainer = module.trainer
        if not overrides_epoch_hooks(module) and not users_hook(getattr(type(module), "configure_optimizers", None)):
            return
        boundary = self.step.boundary
        exchanged = self.step.exchanged_training_data()
        users = users_objects(trainer)  # the datamodule too
        fingerprint = boundary.fingerprint(module)
        snapshot = StateSnapshot(module, users, boundary.engine_keys, boundary.global_modules(),
                                 settings=False)  # the library settings: compared and put back by replay_records
        optimizer = self.strategy.optimizers[0]
        seeds: list[list[Any]] = []
        kept: list[dict[str, Any]] = []
        sketches: list[dict[str, torch.Tensor]] = []
        writers: dict[str, set[str]] = {}  # the hooks that wrote the weights in a replay (named in the refusal)
        clock = ClockReads(owners=[module, *users])  # the first replay's clock values, read by the others
        draws = DrawReads(owners=[module, *users])  # and its unseeded draws

        datamodule = trainer.datamodule

        def replay(exchange: bool) -> Callable[[], None]:
            def run() -> None:
                model_back = model_kept(module, weights=True)  # a warm start (any of these hooks): compared, put back
                rates: dict[str, Any] = {}
                set_up: dict[str, Any] = {}  # the datamodule as its setup left it (" (its setup)": compared apart)
                bound = dict(vars(datamodule)) if datamodule is not None else {}  # its attributes as the real
                # setup left them (rebound only: their contents are the replays' snapshot's to put back)

                def datamodule_set_up() -> None:  # noted, then as the real setup left it: its datasets the training
                    set_up.update({f"{key} (its setup)": value  # data's (exchanged), for the hooks after it
                                   for key, value in fingerprint.take(users, full=True, every_callback=True).items()
                                   if key.startswith("datamodule ")})
                    fields = vars(datamodule)
                    for key in [k for k in fields if k not in bound]:
                        del fields[key]
                    fields.update(bound)
                try:
                    if self.pre_hooks is not None:  # from the state before the real hooks ran: a write they made on
                        self.pre_hooks.put_back()   # one side of a threshold only is made by one replay alone
                    with exchanged.exchanged(fixed_integers=True) if exchange else nullcontext(), seeded(0), \
                            clock.next_run(), \
                            draws.next_run(), seeds_recorded() as calls, \
                            progress_as(trainer, *progress) if progress is not None else nullcontext():
                        seeds.append(calls)
                        replay_epoch_hooks(module, writers, datamodule_set_up)
                        rates = configured_settings(module)  # a rate configure_optimizers takes from the data
                finally:
                    kept.append({**fingerprint.take(users, full=True, every_callback=True), **rates, **set_up,
                                 "model trainable": tuple(n for n, p in module.named_parameters() if p.requires_grad)})
                    sketches.append(weights_sketch(module))  # how far apart, for weights the plain replays round apart
                    snapshot.restore()
                    written = model_back()
                    if written:  # put back as they were: the next release compares with them as they are
                        boundary.accept([f"parameter {name}" for name in written])
            return run

        # the plain and the exchanged replay, a second plain one only if they differ; the engine put aside, as
        # before it is attached (a warm start's optimizer.step() moves the weights, as in the real setup)
        with self.watches_paused(), self.step.engine_aside():
            _, seen = replay_records(optimizer, [replay(False), replay(True)], loop=trainer)
            differ = len(kept) == 2 and (kept[0] != kept[1] or seen[0] != seen[1] or seeds[0] != seeds[1])
            if self.step.any_rank(differ):  # alike on every rank: the hooks' collectives stay paired
                seen += replay_records(optimizer, [replay(False)], loop=trainer)[1]
        if len(kept) != 3 or not differ:  # a second plain run this rank's replays did not need: nothing to judge
            self.refuse_on_every_rank(None, "found the epoch hooks' replays steered by the data")
            return
        plain, other, again = ({**k, **h} for k, h in zip(kept, seen))
        moved = [name for name in moved_by_data(plain, again, other) if not name.startswith("parameter ")] \
            + weights_moved_by_data(plain, again, other, sketches)  # the weights: rounding apart from the data
        moved = list(dict.fromkeys(name.removesuffix(" (its setup)") for name in moved))
        where = ("by the hooks that see no batch (setup, configure_model, on_fit_start, on_train_start, "
                 "on_train_epoch_start/end), replayed from the state before they ran on the training data and on it "
                 "exchanged")
        decided = [name for name in moved if name.startswith(("optimizer ", "trainer ", "privacy ", "configured "))
                   or name == "model trainable"]
        refusal: Optional[PrivacyConfigurationError] = None
        if decided:
            refusal = hyperparameters_error(decided, f"from the training data {where}")
        elif len(seeds) == 3 and seeds[0] == seeds[2] and seeds[0] != seeds[1]:
            refusal = decided_from_data_error([seeds[0], seeds[1]], where)
        elif moved:
            refusal = boundary.written_error(moved, f"{where}: computed from the training data, kept for later steps"
                                             + weights_fitted(moved, writers))
        self.refuse_on_every_rank(refusal, "found the epoch hooks' replays steered by the data")

    def training_copies(self) -> Optional[ExchangedRecords]:
        """The training data's copies in memory (the dataset's, and those the model, the callbacks and the user's
        globals hold), for the replays on the batch exchanged: a hook before the release reads the training set
        itself (``trainer.train_dataloader.dataset``), not only its batch (``None``: no loader yet)."""
        if self.step._source is None:
            return None
        return ExchangedRecords(self.step.exchanged_training_data().arrays)

    def refuse_on_every_rank(self, refusal: Optional[Exception], what: str) -> None:
        """Raise ``refusal`` (``None``: this rank's check passed) on every rank alike (one all-reduce when distributed,
        :meth:`~.validators.step_checks.StepChecks.on_every_rank`): a rank that refuses while its peer goes on to run
        the user's hooks again would leave that peer waiting in their collectives (a broadcast at batch end)."""
        def check() -> None:
            if refusal is not None:
                raise refusal
        self.step.on_every_rank(check, what)

    @contextmanager
    def privacy_settings_kept(self) -> Iterator[None]:
        """σ and C as they were after each replay: a user's hook that changes them (a noise schedule of its own, in
        ``on_train_start``) runs once per real call, not once per replay as well. The clipping policy object and its
        configuration are put back (:func:`~.mechanism_settings.put_mechanism_settings`), not an adaptive policy's own
        bound (C cannot be set under a policy; a bound moved by hand is the step's to refuse)."""
        trainer = self.strategy.lightning_module.trainer
        saved = mechanism_settings(trainer)
        try:
            with stop_decisions_kept(trainer):
                yield
        finally:
            put_mechanism_settings(trainer, saved)

    @contextmanager
    def watches_paused(self) -> Iterator[None]:
        """The logged-metric and record watches do not count the replays' reads (the real hooks' reads are counted
        when they run, in the hook they run in; what a replayed hook keeps or sets is the replays' to judge); and the
        replays write, link or remove no checkpoint file (:func:`checkpoint_files_kept`)."""
        with self.strategy._logged_reads.paused() if self.strategy._logged_reads is not None else nullcontext(), \
                self.strategy._record_watch.paused() if self.strategy._record_watch is not None else nullcontext(), \
                diagnostics_paused(), checkpoint_files_kept():
            yield

    def _later_in_the_plan(self) -> list[tuple[int, int]]:
        """(step, epoch) of the plan's last step: the first step's checks also run with the module made to believe it
        is there (:func:`progress_as`), so behaviour keyed on ``global_step`` or ``current_epoch`` crossing a
        threshold (in-batch negatives after a warm-up, a memory bank from epoch 2) shows before any release.
        Behaviour that comes and goes (every k-th step) is the later random checks' to meet."""
        trainer = self.strategy.lightning_module.trainer
        per_epoch = max(1, self.strategy.steps_per_epoch or 1)
        try:
            last = self.strategy._planned_steps() - 1
        except PrivacyConfigurationError:
            last = 100 * per_epoch  # no planned length (a budget stops the run): look well ahead
        if last <= trainer.global_step:
            return []
        return [(last, last // per_epoch)]  # one on every rank: each check ends with one all-reduce

    def check_later_in_the_plan(self, indices: list[int]) -> None:
        """The first step's batch check run again on its examples as the module runs at the plan's last step and at
        the next steps whose loss differs (:meth:`_later_in_the_plan`, :meth:`_steps_that_differ`): not charged to
        the sampled checks' budget."""
        trainer = self.strategy.lightning_module.trainer
        per_epoch, now = max(1, self.strategy.steps_per_epoch or 1), trainer.global_step
        points = [(step, epoch, min(per_epoch - 1, step)) for step, epoch in self._later_in_the_plan()]
        for step, epoch, batch_idx in points + self._steps_that_differ(indices):
            with progress_as(trainer, step, epoch):
                self.check_batch(indices, batch_idx,  # an epoch's last batch_idx: `if batch_idx >= k`
                                 as_of=f"as the model runs at step {step}, epoch {epoch}, batch_idx {batch_idx}",
                                 charge=False, step=now)

    def _steps_that_differ(self, indices: list[int]) -> list[tuple[int, int, int]]:
        """(step, epoch, batch_idx) of the next :data:`NEXT_STEPS` steps at which ``training_step`` (with the
        batch-start hooks) computes another loss on this step's examples than now, from the same seeds and state:
        behaviour that comes and goes (``if batch_idx % 5 == 2``, every k-th step for k up to 8) is checked as it
        will run there, on the first step. One forward each; the batch check runs only where the loss differs. Not
        with several processes (each rank would decide alone: the checks end with collectives)."""
        if self.strategy._distributed or not indices:
            return []
        module = self.strategy.lightning_module
        trainer, boundary = module.trainer, self.step.boundary
        per_epoch, now = max(1, self.strategy.steps_per_epoch or 1), trainer.global_step
        batch = self.strategy._as_loop_batch(self.strategy._collated(indices))
        snapshot = StateSnapshot(module, users_objects(trainer), boundary.engine_keys, boundary.global_modules())
        clock = ClockReads(owners=[module, *users_objects(trainer)])  # a loss with a time term: alike at every step
        draws = DrawReads(owners=[module, *users_objects(trainer)])  # or with an unseeded draw

        def loss_at(step: int) -> Optional[torch.Tensor]:  # (a step that cannot run there is the later checks' to meet)
            def run() -> Optional[torch.Tensor]:
                batch_start(module, batch, step % per_epoch)
                out = module.training_step(batch, step % per_epoch)
                out = out.get("loss") if isinstance(out, dict) else out
                return out.detach().to(torch.float64) if isinstance(out, torch.Tensor) else None
            return run_once(run, seeded(0), clock.next_run(), draws.next_run(),
                            progress_as(trainer, step, step // per_epoch), self.watches_paused(),
                            self.privacy_settings_kept(), self.strategy.precision_plugin.train_step_context(),
                            replaying(module),
                            then=snapshot.restore)

        here = loss_at(now)
        if here is None:
            return []
        later = [(step, loss_at(step)) for step in range(now + 1, now + 1 + NEXT_STEPS)]
        return [(step, step // per_epoch, step % per_epoch) for step, loss in later
                if loss is not None and (loss.shape != here.shape or not torch.equal(loss, here))]

    def check_batch(self, indices: list[int], batch_idx: int, as_of: str = "", charge: bool = True,
                    step: Optional[int] = None) -> None:
        """The batch check (:mod:`~lightning_dp.validators.batch_check`) on this step's examples, read again
        through the user's dataset and collate (torch seeded per example, as the probe) and the loop's conversions,
        passed to ``training_step`` with the step's own ``batch_idx`` (a step that mixes examples on some batch
        indices only is checked as it runs)."""
        module = self.strategy.lightning_module
        private = self.step

        def loss_of(examples: Any) -> Any:
            batch = self.strategy._as_loop_batch(examples)
            # σ and C put back after each pass: a schedule by step in on_train_batch_start, run as of a later step
            with self.strategy.precision_plugin.train_step_context(), replaying(module), self.privacy_settings_kept():
                batch_start(module, batch, batch_idx)
                return module.training_step(batch, batch_idx)

        private.check_batch(loss_of, indices, module.trainer.global_step if step is None else step,
                            max_examples=min(128, self.strategy.max_physical_batch_size or 128), as_of=as_of,
                            charge=charge, physical=self.strategy.max_physical_batch_size)


@contextmanager
def exchanged_around(outside: Optional[ExchangedRecords],
                     before_end: Callable[[], None]) -> Iterator[Callable[[], None]]:
    """The training data's copies exchanged (``outside``; ``None``: nothing) while a replay's hooks run, and put back in
    place while ``before_end`` (the ``before_end`` handed to :func:`~.hook_replays.replay_batch_hooks`, yielded
    wrapped) reads the state between the hooks before the release and the batch-end hooks: a record read by its
    contents is the data's, not a write."""
    if outside is None:
        yield before_end
        return
    with ExitStack() as stack:
        stack.enter_context(outside.exchanged(fixed_integers=True))

        def between() -> None:
            stack.close()
            before_end()
            stack.enter_context(outside.exchanged(fixed_integers=True))
        yield between


def weights_fitted(moved: list[str], writers: dict[str, set[str]]) -> str:
    """What the refusal of the hooks that see no batch adds when they moved the model's weights: the hooks that wrote
    them, and the fix (a non-private warm start, a linear probe or a closed-form head fitted to the training data)."""
    weights = {name.removeprefix("parameter ") for name in moved if name.startswith("parameter ")}
    if not weights:
        return ""
    hooks = sorted(hook for hook, wrote in writers.items() if wrote & weights)
    by = f" by {', '.join(hooks)}" if hooks else ""
    return (f" (the model's weights, fitted to the training data{by} without noise or accounting: a non-private "
            "warm start, a linear probe or a closed-form head; fit them on public data — "
            "lightning_dp.callbacks.PublicPretraining — or let the private fit train them)")


@contextmanager
def checkpoint_files_kept() -> Iterator[None]:
    """``ModelCheckpoint``'s file operations do nothing: a replayed hook of a user's subclass of it (its
    ``on_train_epoch_end``, run again from the state before) would save, link (``save_last="link"``: a ``last-v1``)
    or remove files the real run decides on. Patched on the class, not the instance, so that no snapshot of the
    callback's attributes taken meanwhile carries the patch out."""
    classes = [cls for name in ("pytorch_lightning.callbacks", "lightning.pytorch.callbacks")
               for cls in [getattr(sys.modules.get(name), "ModelCheckpoint", None)] if isinstance(cls, type)]
    saved = [(cls, key, vars(cls)[key]) for cls in classes for key in _CHECKPOINT_FILE_OPERATIONS if key in vars(cls)]
    for cls, key, _ in saved:
        setattr(cls, key, staticmethod(_no_file_operation))
    try:
        yield
    finally:
        for cls, key, value in saved:
            setattr(cls, key, value)


_CHECKPOINT_FILE_OPERATIONS = ("_save_checkpoint", "_link_checkpoint", "_remove_checkpoint")


def _no_file_operation(*args: Any, **kwargs: Any) -> None:
    return None


_STOPS = (("", "should_stop"), ("fit_loop", "max_epochs"), ("fit_loop", "min_epochs"),
          ("fit_loop.epoch_loop", "max_steps"), ("fit_loop.epoch_loop", "min_steps"))
"""The trainer's decisions on when training stops, as (owner path, attribute)."""


@contextmanager
def stop_decisions_kept(trainer: Any) -> Iterator[None]:
    """The trainer's stop decisions (``should_stop``, ``max_steps``, ``max_epochs``, their minima) and the library
    settings that schedule the fit (:func:`~.steered_settings.library_settings`: validation and logging intervals,
    ``limit_train_batches``, a library callback's patience) put back as they were when the block ends: what the
    checks' passes of the user's code set there (``self.trainer.should_stop = True`` in ``training_step`` on the
    probe's one-record batches) leaves no trace. The real step's own writes are judged where it runs (the decision
    windows, :mod:`.decisions`)."""
    owners = []
    for path, key in _STOPS:
        owner = trainer
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        if owner is not None and key in getattr(owner, "__dict__", {}):
            owners.append((owner, key, vars(owner)[key]))
    settings = list(library_settings(trainer).values())
    try:
        yield
    finally:
        for owner, key, value in [*owners, *settings]:
            if vars(owner).get(key, _ABSENT_SETTING) is not value:
                setattr(owner, key, value)


_ABSENT_SETTING = object()
