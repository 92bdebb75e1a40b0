"""σ, C, a stop or a learning rate set by the ``on_train_batch_start`` hooks at a later step (rule 3 of
docs/release_boundary.md).

Lightning runs the batch-start hooks (the callbacks', then the module's) between moving the batch to the device and
``training_step``; every baseline the step compares its release with is taken in ``training_step``, after them, and
the first step's replays of those hooks never meet a write gated on a later step (``if global_step == 3``). A C set
there from ``batch[0].abs().mean()`` would clip, noise and be released by that very step. :class:`BatchStartSettings`
notes the settings (:func:`~.steered_settings.step_decisions`, the optimizer's hyper-parameters) and the user's state
as each training batch arrives (the strategy's ``batch_to_device``); at the top of ``training_step``, when the settings
moved since, the batch-start hooks run again from that state and those settings, from the same seeds, on the step's
examples twice, on half of them and on them exchanged
(:func:`~lightning_dp.record_checks.outside_records.exchanged_copy`). What the other data
set apart, and the second plain run does not, was set from the batch: refused before the release, on every rank. A
warm-up or a C schedule by ``global_step`` sets the same values on any data and trains. The state and settings the
real hooks left are put back after judging.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, changed_entries, moved_by_data
from lightning_dp.records.fetch import seeded
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import run_once, set_apart
from lightning_dp.replays.starting_state import put_back_after
from lightning_dp.validators.hook_replays import batch_start, replaying
from lightning_dp.record_checks.outside_records import exchanged_copy
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.steered_settings import (hyperparameters_error, replay_records, settings,
                                                      settings_kept, step_decisions)
from lightning_dp.validators.step_replays import StepReplays, users_objects

__all__ = ["BatchStartSettings", "BATCH_START"]

BATCH_START = ("on_train_batch_start",)


class BatchStartSettings:
    """The settings and the user's state as a training batch arrives, judged at the top of the step when the
    batch-start hooks moved the settings (module docstring); one per strategy."""

    def __init__(self, replays: StepReplays) -> None:
        self.replays = replays
        self._arrived: Optional[tuple[Fingerprint, Callable[[], None], StateSnapshot]] = None

    def arrived(self, trainer: Any) -> None:
        """A training batch arrives (before the batch-start hooks): the settings and the user's state noted, when the
        user's code has a batch-start hook."""
        self._arrived = None
        if not self.replays.users_code_runs(BATCH_START):
            return
        module, boundary = trainer.lightning_module, self.replays.step.boundary
        self._arrived = (_settings(trainer), settings_kept(self.replays.strategy.optimizers[0], trainer),
                         StateSnapshot(module, users_objects(trainer), boundary.engine_keys, boundary.global_modules()))

    def judge(self, indices: list[int], batch_idx: int) -> None:
        """At the top of ``training_step``: when the batch-start hooks moved the settings since the batch arrived (on
        any rank), run them again from the state as it arrived on the step's examples, on them again, on half of them
        and on them exchanged; settings the other data set apart are refused before the release."""
        arrived, self._arrived = self._arrived, None
        replays, strategy = self.replays, self.replays.strategy
        if not replays.users_code_runs(BATCH_START):  # alike on every rank: no all-reduce then
            return
        trainer = strategy.lightning_module.trainer
        moved = arrived is not None and bool(changed_entries(arrived[0], _settings(trainer)))
        if not replays.step.any_rank(bool(moved and indices)):
            return
        judged = bool(moved and indices)
        assert arrived is not None
        indices = indices or [0]  # a rank with no examples runs the hooks on a stand-in: their collectives meet
        module, optimizer = strategy.lightning_module, strategy.optimizers[0]
        users = users_objects(trainer)
        boundary = replays.step.boundary
        _, put_arrived, as_arrived = arrived
        runs: list[bool] = []
        clock = ClockReads(owners=[module, *users])  # the first run's clock values, read by the others
        draws = DrawReads(owners=[module, *users])  # and its unseeded draws

        def replay(examples: Any) -> Callable[[], None]:  # from the user's state as the batch arrived (replay_records:
            return lambda: runs.append(bool(run_once(  # the settings); a run that fails is not compared
                lambda: batch_start(module, examples, batch_idx, raising=True), seeded(0), clock.next_run(),
                draws.next_run(), replaying(module, rates=False, schedules=False), start=as_arrived.restore,
                read=lambda: True)))

        with put_back_after(lambda: StateSnapshot(module, users, boundary.engine_keys, boundary.global_modules())
                            .restore, lambda: settings_kept(optimizer, trainer)):  # as the real hooks left them
            batch = strategy._collated(indices)
            half = strategy._collated(indices[: max(1, len(indices) // 2)])
            put_arrived()  # replay_records starts each run from, and puts back, the settings as the batch arrived
            with replays.watches_paused():
                _, seen = replay_records(optimizer, [replay(batch), replay(batch), replay(half),
                                                     replay(exchanged_copy(batch))], loop=trainer)
        apart: list[str] = []
        if judged and len(runs) == 4 and runs[0] and runs[1]:
            apart = sorted(set_apart(*seen[:2], [other for other, ok in zip(seen[2:], runs[2:]) if ok], moved_by_data))
        replays.refuse_on_every_rank(hyperparameters_error(apart, "in on_train_batch_start, from the batch")
                                     if apart else None, "found the batch-start hooks' settings steered by the data")


def _settings(trainer: Any) -> Fingerprint:
    """What the batch-start hooks may not set from the batch: σ, C, the policy, the trainer's controls
    (:func:`~.steered_settings.step_decisions`) and the optimizers' hyper-parameters and defaults."""
    out = step_decisions(trainer)
    for i, optimizer in enumerate(getattr(trainer, "optimizers", None) or ()):
        out.update({f"optimizer {i} {key.partition(' ')[2]}": value for key, value in settings(optimizer).items()})
    return out
