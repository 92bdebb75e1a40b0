"""The end of a private fit: what the user's hooks write after the last update, judged before the module is returned.

Rule 3 of docs/release_boundary.md holds after the last release too: the module, its callbacks and the datamodule
handed back by ``fit`` (and every checkpoint written) may hold only what the boundary verified at the last update.
Lightning runs, after it: the ``on_train_end`` hooks, the strategy's teardown, then ``on_fit_end`` and ``teardown``
(the module's last of all). :class:`EndOfFit`

- takes the user's state as training ends (:meth:`EndOfFit.before_end_hooks`: the decision windows call it first of
  the ``on_train_end`` hooks; again after the strategy's teardown), so that what a refused hook wrote can be put back;
- refuses what ``on_train_end`` keeps, as a batch end's (:meth:`EndOfFit.judge`, from the glue's ``on_train_end``
  and before every checkpoint), unless :mod:`.judged_writes` judged it a function of the released state;
- wraps the module's ``teardown`` once (:meth:`EndOfFit.judge_after_users_teardown`) so that what ``on_fit_end`` and
  ``teardown`` wrote is judged when they have run: run again from the state before them on the training data, on
  its exchanged copy and on it again (:meth:`EndOfFit._judge_writes`): what the exchanged run sets apart — class means
  of the training features for an OOD score — is put back and refused; a counter, a flag, a report of the weights
  written alike are accepted.

It imports no Lightning (the glue imports it; Lightning imports the glue).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lightning_dp.records.library_code import library_named
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.hook_replays import replay_end_hooks, replaying, users_hook
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, moved_by_data
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import plain_exchanged_again, run_once, set_apart
from lightning_dp.replays.starting_state import put_back_after
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.step_replays import StepReplays, Strategy, users_objects

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["END_HOOKS", "EndOfFit", "averaging", "unwrap_teardown"]

END_HOOKS = ("on_train_end", "on_fit_end", "teardown")
"""The user's hooks that run after the last update while the training data is still reachable: what
``on_train_end`` keeps is refused (as a batch-end hook's), what ``on_fit_end`` and ``teardown`` keep is judged by
running them again on the exchanged data when the last of them has run; what is refused is put back
(:meth:`EndOfFit.judge`)."""

_WEIGHT_AVERAGING = ("StochasticWeightAveraging", "WeightAveraging", "EMAWeightAveraging")
"""Lightning's callbacks that copy an average of the released weights into the model when training ends."""


def averaging(trainer: "pl.Trainer") -> bool:
    """Whether one of Lightning's weight-averaging callbacks (or a subclass) swaps weights into the model."""
    return any(b.__name__ in _WEIGHT_AVERAGING and library_named(b, ("pytorch_lightning", "lightning."))
               for cb in trainer.callbacks for b in type(cb).__mro__)


def unwrap_teardown(module: nn.Module) -> None:
    """Remove the wrapper :meth:`EndOfFit.judge_after_users_teardown` put on the module (none: nothing)."""
    if getattr(module.__dict__.get("teardown"), "_ldp_end", False):
        del module.__dict__["teardown"]


class EndOfFit:
    """The end of one strategy's fits (module docstring): the state taken as training ends, and its judges."""

    def __init__(self, strategy: Strategy, replays: StepReplays) -> None:
        self.strategy = strategy
        self.replays = replays
        self._snapshot: Optional[tuple[StateSnapshot, Any, Any, list[Any]]] = None  # before the end's hooks

    @property
    def step(self) -> Any:
        """The strategy's private step (its boundary, its exchanged training data, its collectives)."""
        return self.strategy.private_step

    def forget(self) -> None:
        """The fit is over (or failed): the state taken as it ended is not needed."""
        self._snapshot = None


    def before_end_hooks(self) -> None:
        """Training ends (called first of the ``on_train_end`` hooks, by the decision windows; again after the
        strategy's teardown, before ``on_fit_end``): when the user's code
        has a hook that ends a fit (:data:`END_HOOKS`), the user's state as it is now, to put back what such a hook
        computes from the training data and the boundary refuses (:meth:`judge`)."""
        module = self.strategy.lightning_module
        trainer = module.trainer
        datamodule = getattr(trainer, "datamodule", None)
        if self.replays.users_code_runs(END_HOOKS) or (datamodule is not None and users_hook(
                getattr(type(datamodule), "teardown", None))):
            users = users_objects(trainer)  # the datamodule too
            boundary = self.step.boundary
            fingerprint = boundary.fingerprint(module)
            snapshot = StateSnapshot(module, users, boundary.engine_keys, boundary.global_modules())
            self._snapshot = (snapshot, fingerprint, fingerprint.take(users, full=True, every_callback=True), users)

    def _judge_writes(self, hooks: tuple[str, ...], where: str) -> None:
        """What the hooks that end the fit (``hooks``, run since :meth:`before_end_hooks`) wrote, judged as the epoch
        hooks' are: run again from the state before them, on the training data, on its exchanged copy (the training
        loop's logged values moved too: ``self.hparams["final"] = logged_metrics["train_loss"]``) and on it
        again. What the exchanged run sets apart (class means of the training features) is put back and refused;
        what all runs write alike (a counter, a flag, a report of the weights) is accepted. A run that fails accepts
        nothing (the boundary then refuses every write)."""
        if self._snapshot is None:
            return
        snapshot, fingerprint, before, users = self._snapshot
        module = self.strategy.lightning_module
        written = StateFingerprint.changed(before, fingerprint.take(users, full=True, every_callback=True))
        if not self.step.any_rank(bool(written)):  # alike on every rank: the hooks run again on each
            return
        boundary = self.step.boundary
        clock = ClockReads(owners=[module, *users])  # the first run's clock values, read by the others
        draws = DrawReads(owners=[module, *users])  # and its unseeded draws

        def run(exchange: bool) -> Optional[Fingerprint]:
            moved_logs = getattr(self.strategy, "moved_training_logs", nullcontext) if exchange else nullcontext
            return run_once(lambda: replay_end_hooks(module, hooks),
                            exchanged.exchanged(fixed_integers=True) if exchange else nullcontext(), moved_logs(),
                            self.replays.replay_settings(), clock.next_run(), draws.next_run(), replaying(module),
                            start=snapshot.restore,
                            read=lambda: fingerprint.take(users, full=True, every_callback=True))
        with put_back_after(lambda: StateSnapshot(module, users, boundary.engine_keys,
                                                  boundary.global_modules()).restore):
            exchanged = self.step.exchanged_training_data() if self.step._source is not None else None
            runs = plain_exchanged_again(run, lambda plain: exchanged is not None, self.step.any_rank)
        judged = len(runs) >= 2 and None not in runs
        moved = set_apart(runs[0], runs[2], runs[1:2], moved_by_data) if len(runs) == 3 else []
        if moved:
            snapshot.restore()
            self.forget()
        self.replays.refuse_on_every_rank(self.step.boundary.written_error(
            moved, f"{where}: computed from the training data (run again on its exchanged copy, the hooks set it "
            "apart). What was written was put back: the module, its callbacks and the datamodule hold the "
            "state verified at the last update") if moved else None, f"found state written {where} from the data")
        if judged and written:
            self.step.boundary.accept(written)

    def averaged(self) -> tuple[str, ...]:
        """What the end of a fit does not compare: the parameters, when weight averaging swapped its average in (a
        function of the releases)."""
        return ("parameter ",) if averaging(self.strategy.lightning_module.trainer) else ()

    def judge(self, where: str, skip: tuple[str, ...] = ()) -> None:
        """Refuse state changed since the last update (:meth:`PrivateStep.check_kept`); what the hooks that end the
        fit wrote is put back first (from the state :meth:`before_end_hooks` took), so the module returned does not
        hold the refused statistic; the error says what could not be put back (parameters)."""
        try:
            self.step.check_kept(where, skip=skip)
        except PrivacyConfigurationError as err:
            taken, self._snapshot = self._snapshot, None
            snapshot = taken[0] if taken is not None else None
            note = (" The module, its callbacks or the datamodule still hold what was written: do not save or use "
                    "them as they are.")
            if snapshot is not None:
                snapshot.restore()
                try:
                    self.step.boundary.check_kept(where, skip=skip)
                    note = (" What was written was put back: the module, its callbacks and the datamodule hold the "
                            "state verified at the last update.")
                except PrivacyConfigurationError as left:
                    note = (" What the module's buffers and attributes, the callbacks' state and the globals of your "
                            "code held was put back; "
                            f"not all of it ({str(left).partition(': ')[2].partition('. ')[0]}): do not save or "
                            "use the module as it is.")
            err.args = (f"{err.args[0] if err.args else ''}{note}", *err.args[1:])
            raise
        self.step.check_written_statistics(where, full=True)  # (:mod:`~.written_statistics`)

    def judge_after_users_teardown(self) -> None:
        """The fit ends without error (Lightning's teardown of the strategy runs before the user's ``on_fit_end`` and
        ``teardown`` hooks, the module's ``teardown`` last of all): the module's ``teardown`` is wrapped, once, so
        that what those hooks write after the last update is judged when they have run (:meth:`judge`)."""
        module = self.strategy.lightning_module
        hook = module.teardown

        def teardown(*args: Any, **kwargs: Any) -> None:
            unwrap_teardown(module)
            hook(*args, **kwargs)
            where = "after training ended (in on_fit_end or teardown: of the module, a callback or the datamodule)"
            try:
                self._judge_writes(END_HOOKS[1:], where)  # on_train_end's: refused outright, as a batch's end
                self.judge(where, self.averaged())
            finally:
                self.forget()
                self.step.forget_written_statistics()  # the fit's last check: the training tensors let go
        teardown._ldp_end = True  # type: ignore[attr-defined]
        module.__dict__["teardown"] = teardown  # an instance's attribute: Lightning calls getattr(module, "teardown")
