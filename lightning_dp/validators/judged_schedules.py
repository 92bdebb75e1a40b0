"""The learning-rate schedulers' steps, judged when they run code of the user's (docs/release_boundary.md, rule 3).

A scheduler sets the next updates' hyper-parameters after the release; a schedule is a function of the step count
and public constants, and the release boundary takes the rates it sets as they come. Code of the user's there — a
``LambdaLR`` or ``MultiplicativeLR`` whose function is the user's, a scheduler class of the user's (its ``step``,
``get_lr``), the module's ``lr_scheduler_step`` — could read the training data instead (zoo34 L46: the rate set to
0.2 + the label rate of ten training records chosen by the step: every later update scaled by un-noised labels).
When :func:`users_schedule_code` finds such code, each call of the loop's scheduler update
(``trainer.fit_loop.epoch_loop.update_lr_schedulers``, at a step's or an epoch's end) is judged:

1. the optimizers' groups, defaults and state, every scheduler's attributes, what its rate functions and its class
   of the user's keep (closure cells, default arguments: a memo of each step's rate) and the user's state (the
   module, callbacks, the user's modules' globals) are taken as the update starts;
2. after it, the update runs again from there on the training data's exchanged copies (the loggers muted, nothing
   logged), and, when that sets the decisions of :func:`~.steered_settings.decisions` (each optimizer's
   hyper-parameters, the schedulers' states, σ, C, the trainer's length) apart from the real update's, on the same
   data again (a difference it shows too is not the data's, unless :func:`~lightning_dp.fingerprints.
   fingerprint_entries.moved_by_data` says it is);
3. what the exchanged data set apart is refused, and the rates are put back as they were before the update; else
   the real update's state is put back as it left it. A run again that fails on the exchanged data is refused too.
   The kept state each run wrote (the release boundary's fingerprint before and after it) is compared with the
   decisions: a statistic stashed in a global beside a public rate is refused here. What the update wrote is
   accepted for the next release only where the starting state puts it back (a memo in a closure, slots, a
   function's attribute: the runs again started without it): a memo it cannot put back (a ``functools.lru_cache``'s
   contents) served the runs again what the real update read (zoo35 R13), so the next release's check refuses it,
   and a memo of public values there trains once declared public (``public_state=["module.rate"]``, zoo35 R44).

Cost: nothing for torch's schedulers with torch's functions; else, at every scheduler update, one or two more runs of
it, the training data's copies exchanged, and a fingerprint of the kept state after each run and before the update.
Not seen: a function the user's scheduler was built with that reads the data only as it is built (before the fit; the
data statistics' check judges what the fit's start holds), and a clock read by the schedule (a rate from the wall clock
is refused, not replayed).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, changed_entries, moved_by_data
from lightning_dp.fingerprints.state_walker import binds, library_callable, written_name
from lightning_dp.replays.runs_again import run_once
from lightning_dp.validators.hook_replays import replaying, replaying_now
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.loop_wraps import wrap_method
from lightning_dp.validators.snapshot import StateSnapshot, class_state, function_state, object_state
from lightning_dp.validators.step_replays import users_objects
from lightning_dp.validators.steered_settings import decisions, schedulers, settings_kept

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ScheduleJudge", "users_schedule_code"]

_SCHEDULE_METHODS = ("step", "get_lr", "_get_closed_form_lr")
"""The methods of a scheduler class that compute its rates (a class of the user's may override them)."""


def _nested(scheduler: Any) -> list[Any]:
    """``scheduler`` and those it steps (``SequentialLR``, ``ChainedScheduler``: ``_schedulers``), each once."""
    out, todo = {}, [scheduler]
    while todo:
        s = todo.pop()
        if id(s) not in out:
            out[id(s)] = s
            todo.extend(getattr(s, "_schedulers", None) or ())
    return list(out.values())


_ATOMS = (bool, int, float, str, type(None))


def _users_function(fn: Any) -> bool:
    """Whether a scheduler's rate function is the user's code: defined outside the libraries, or a library's function
    bound to arguments that are not plain numbers or strings (Hugging Face's warm-up schedules are a partial of theirs
    bound to step counts: not the user's)."""
    if isinstance(fn, functools.partial) and library_callable(fn.func):  # (a builtin method of an object of the
        # user's class, `Table().__getitem__`, is the user's: library_callable decides it by its object's class)
        return not all(isinstance(v, _ATOMS) for v in (*fn.args, *fn.keywords.values()))
    return not library_callable(fn) or binds(fn)


def users_schedule_code(trainer: "pl.Trainer") -> list[str]:
    """Where code of the user's runs when the loop steps the schedulers (module docstring); none: ``[]``."""
    found = []
    step = getattr(type(trainer.lightning_module), "lr_scheduler_step", None)
    if step is not None and not library_callable(step):
        found.append(f"{type(trainer.lightning_module).__qualname__}.lr_scheduler_step")
    for scheduler in (s for top in schedulers(trainer) for s in _nested(top)):
        cls = type(scheduler)
        found += [f"{cls.__qualname__}.{name}" for name in _SCHEDULE_METHODS
                  if (fn := getattr(cls, name, None)) is not None and not library_callable(fn)]
        found += [f"{cls.__qualname__}'s function {written_name(fn)}"
                  for fn in getattr(scheduler, "lr_lambdas", None) or () if _users_function(fn)]
    return found


def _kept(trainer: "pl.Trainer", step: Any) -> Callable[[], None]:
    """A function that puts back, as they are now, the optimizers' settings and state, the schedulers' attributes,
    what their rate functions and classes of the user's keep (a memo of each step's rate in a closure: zoo35 R10) and
    the user's state (a memo in a global of the user's module)."""
    puts = [settings_kept(o, trainer) for o in getattr(trainer, "optimizers", None) or ()]
    nested = [s for top in schedulers(trainer) for s in _nested(top)]
    puts += [object_state(s) for s in nested] + class_state([type(s) for s in nested])
    puts += [put for s in nested for fn in getattr(s, "lr_lambdas", None) or () for put in function_state(fn)]
    puts.append(StateSnapshot(trainer.lightning_module, users_objects(trainer), step.boundary.engine_keys,
                              step.boundary.global_modules()).restore)

    def put_back() -> None:
        for put in puts:
            put()
    return put_back


class ScheduleJudge:
    """The judge of one fit's scheduler updates (module docstring). ``step``: the strategy's private step (its
    exchanged training data, its collectives)."""

    def __init__(self, trainer: "pl.Trainer", step: Any) -> None:
        self.trainer, self.step = trainer, step
        self._undo: Optional[Callable[[], None]] = None
        self._wrapper: Any = None
        self._fingerprint: Optional[tuple[Any, StateFingerprint]] = None  # (module, its fingerprint): _taken

    def watch(self) -> None:
        """Wrap the loop's scheduler update for the fit."""
        self.unwatch()
        loop = self.trainer.fit_loop.epoch_loop
        self._undo = wrap_method(loop, "update_lr_schedulers", self._judged)
        self._wrapper = vars(loop)["update_lr_schedulers"]

    def unwatch(self) -> None:
        """The scheduler update as it was, unless another wrap taken before this one was undone since (it took this
        one's away with it)."""
        undo, self._undo = self._undo, None
        if undo is not None and vars(self.trainer.fit_loop.epoch_loop).get("update_lr_schedulers") is self._wrapper:
            undo()

    def _judged(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_lr_schedulers(*args: Any, **kwargs: Any) -> Any:
            where = users_schedule_code(self.trainer) if not replaying_now() else []
            if not where or self.step._source is None or not self.step.boundary.datasets():
                return original(*args, **kwargs)
            start = self._taken()
            before = _kept(self.trainer, self.step)
            out = original(*args, **kwargs)
            self.judge(lambda: original(*args, **kwargs), before, where, start)
            return out
        return update_lr_schedulers

    def _taken(self) -> Fingerprint:
        """The kept state's fingerprint now (the release boundary's view: the module, the callbacks, the user's
        modules' globals)."""
        module = self.trainer.lightning_module
        if self._fingerprint is None or self._fingerprint[0] is not module:
            self._fingerprint = (module, self.step.boundary.fingerprint(module))
        return self._fingerprint[1].take(self.step.boundary.callbacks(), full=True)

    def _outcome(self, start: Fingerprint) -> Fingerprint:
        """What an update decided: :func:`decisions`, and the kept state's entries it wrote since ``start`` (a
        rate function's ``functools.lru_cache`` in a global, a memo of the user's)."""
        now = self._taken()
        return {**decisions(self.trainer), **{f"kept {name}": now.get(name) for name in changed_entries(start, now)}}

    def judge(self, update: Callable[[], Any], before: Callable[[], None], where: list[str],
              start: Fingerprint) -> None:
        """Run ``update`` again from ``before`` on the exchanged data (and on the data when they differ); refuse what
        the data set apart (module docstring); else the kept state it wrote (``start``: as the update started) is
        what the next release compares with."""
        trainer, step = self.trainer, self.step
        first, after = self._outcome(start), _kept(trainer, step)

        def run(exchange: bool) -> Optional[Fingerprint]:
            copies = step.exchanged_training_data() if exchange else None
            return run_once(lambda: (update(), self._outcome(start))[1],
                            replaying(trainer.lightning_module), copies.exchanged() if copies else nullcontext(),
                            start=before)

        other = run(True)
        again = run(False) if step.any_rank(other is None or other != first) else first
        after()
        moved = ["(the update failed on other data)"] if other is None else \
            [] if again is None else moved_by_data(first, again, other)

        def refuse() -> None:
            if moved:
                before()  # the rates as they were before the update
                raise schedule_error(moved, ", ".join(where[:3]), trainer.global_step)
        step.on_every_rank(refuse, "refused a scheduler update")
        written = [name.removeprefix("kept ") for name in first if name.startswith("kept ")]
        if written:  # judged not the data's — if the runs again started from it as it was (below)
            step.boundary.accept(self._put_back(written, start, before, after))

    def _put_back(self, written: list[str], start: Fingerprint, before: Callable[[], None],
                  after: Callable[[], None]) -> list[str]:
        """The entries of ``written`` that the starting state puts back as they were at ``start``: the runs again
        began from them, so their judgment holds. One it does not (a ``functools.lru_cache``'s contents) served the
        runs again what the real update computed (zoo35 R13): not accepted; the next release's check refuses it unless
        declared public."""
        before()
        restored = self._taken()
        after()
        moved = set(changed_entries({n: start.get(n) for n in written}, {n: restored.get(n) for n in written}))
        return [n for n in written if n not in moved]


def schedule_error(moved: list[str], where: str, step: int) -> PrivacyConfigurationError:
    """The refusal of a scheduler update that code of the user's computed from the training data."""
    shown = ", ".join(moved[:6])
    return PrivacyConfigurationError(
        f"The learning-rate schedule read the training data at step {step}: the user's code in the schedulers' update "
        f"({where}), run again from the state it started from with the training data's values exchanged for others, "
        f"set other values: {shown}. A rate set from training records steers every later update by un-noised data, "
        "outside the guarantee; the rates were put back as they were before the update. Make the schedule a function "
        "of the step or epoch count and public constants (LambdaLR(lambda step: 0.95 ** step)), or of held-out data "
        "at validation.")
