"""The learning-rate schedule's own state (rule 3 of docs/release_boundary.md: decisions).

Lightning steps each scheduler after the update, and the rate it computes steers the next update. What it computes
from is the scheduler's state — its attributes, the closures of a ``LambdaLR``'s lambdas — and Lightning's
configuration of it (``interval``, ``frequency``). A value of the batch written there within a step (a scheduler
"told the loss": ``self.lr_schedulers().observe(loss)`` in ``training_step``, ``on_before_backward`` or
``on_train_batch_start``; a ``StepLR.step_size``, a config's ``frequency``, a lambda's closure cell set from the loss)
sets the rate of every later update by an un-noised value of one step's batch (zoo16 s1, s2, s3: the weights of
neighbouring datasets part at steps that did not sample the changed record). The decision windows saw a scheduler's
``state_dict()`` written at a batch's end only; the step's own comparison and the first step's replays did not.

:func:`schedule_controls` gives each scheduler's state as a :class:`ScheduleNote` among the trainer's loop controls
(:func:`~.steered_settings.loop_controls`), so every check of those judges it: the step (from ``training_step`` to its
release), the first step's replays of the batch hooks, the decision windows, each putting it back after its runs of
the hooks (:func:`put_schedules`); a schedule set from the step count, alike on any data, trains.

A loop of one's own (``PrivateStep``) cannot be replayed: once it read the loss it back-propagated, a rate a
``torch.optim.lr_scheduler`` scheduler set is trusted only when the scheduler's step made it, and a LambdaLR subclass
told the loss (``scheduler.observe(loss.item())``, zoo16 pl1) would pass for one. :func:`told_state` reads what the
loop's code told a scheduler — its state but for what torch's methods of its class write as it steps
(:func:`stepped_fields`) — and the plain loop's check of decisions (:mod:`.plain_loop`) compares it from a release to
the next as it compares the rates.
"""

from __future__ import annotations

import types
from collections.abc import Hashable
from typing import Any

from lightning_dp.records.library_code import library_named
from lightning_dp.fingerprints.state_walker import closure_token, freeze

__all__ = ["scheduler_state", "ScheduleNote", "schedule_controls",
           "put_schedules", "told_states", "told_state", "stepped_fields"]

CONFIG_FIELDS = ("interval", "frequency", "monitor", "strict", "reduce_on_plateau", "name")
"""Lightning's ``LRSchedulerConfig`` fields that decide when the scheduler steps and on what."""


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """``scheduler.state_dict()``, or, where it raises, what torch's would hold, which its ``load_state_dict`` puts
    back: the attributes but the optimizer, and a lambda's ``__dict__`` (``None`` for one without). Torch's
    ``LambdaLR.state_dict()`` raises for a callable object without ``__dict__`` (``LambdaLR(opt, RATES.__getitem__)``:
    a public table of rates, zoo35 R45); the checks that note a schedule and put it back must not fail on it."""
    try:
        return scheduler.state_dict()
    except (AttributeError, TypeError):
        state = {k: v for k, v in vars(scheduler).items() if k not in ("optimizer", "lr_lambdas")}
        if isinstance(getattr(scheduler, "lr_lambdas", None), list):
            state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) or not hasattr(fn, "__dict__")
                                   else dict(fn.__dict__) for fn in scheduler.lr_lambdas]
        return state


class ScheduleNote:
    """One scheduler's state as noted: its configuration's fields, its ``state_dict()`` and its lambdas' closures,
    compared by a token of them (:func:`~lightning_dp.fingerprints.state_walker.freeze`); :meth:`put` sets the
    fields and the state back (a closure cell cannot be put back: a lambda's closure kept alike keeps its last run's
    value)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        scheduler = config.scheduler
        self.fields = {key: getattr(config, key) for key in CONFIG_FIELDS if hasattr(config, key)}
        try:
            self.state = _copied(scheduler_state(scheduler))
        except Exception:  # noqa: BLE001  (a scheduler without a state_dict: its attributes are its state)
            self.state = None
        lambdas = [fn for fn in getattr(scheduler, "lr_lambdas", None) or () if isinstance(fn, types.FunctionType)]
        self.token: Hashable = (freeze(self.fields), freeze(self.state if self.state is not None else vars(scheduler)),
                                tuple(closure_token(fn) for fn in lambdas))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScheduleNote) and other.config is self.config and other.token == self.token

    def __hash__(self) -> int:
        return hash(self.token)

    def put(self) -> None:
        """The configuration's fields and the scheduler's state as noted."""
        for key, value in self.fields.items():
            if getattr(self.config, key) != value:
                setattr(self.config, key, value)
        if self.state is not None:
            self.config.scheduler.load_state_dict(_copied(self.state))


def schedule_controls(trainer: Any) -> dict[str, ScheduleNote]:
    """Each scheduler Lightning steps for ``trainer`` as a loop control: ``"lr scheduler 0 StepLR"`` → its note."""
    configs = getattr(trainer, "lr_scheduler_configs", None) or ()
    return {f"lr scheduler {i} {type(c.scheduler).__name__}": ScheduleNote(c) for i, c in enumerate(configs)}


def put_schedules(trainer: Any, controls: dict[str, Any]) -> None:
    """The schedulers' states of ``controls`` (:func:`schedule_controls`) set back where they changed."""
    now = schedule_controls(trainer)
    for name, note in controls.items():
        if isinstance(note, ScheduleNote) and name in now and now[name] != note:
            note.put()


def _copied(value: Any, depth: int = 0) -> Any:
    """``value`` with its lists and dicts copied to three levels (a state dict's lambdas' attributes): what
    ``load_state_dict`` takes apart (it pops ``lr_lambdas``) and what a hook rebinds; other objects shared."""
    if depth >= 3:
        return value
    if isinstance(value, dict):
        return {k: _copied(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v, depth + 1) for v in value]
    return value


_TORCH_FLAGS = frozenset({"_get_lr_called_within_step", "_is_initial"})
"""Flags torch's schedulers set around their own step (by helpers outside the scheduler's class)."""


def told_states(schedulers: Any) -> dict[str, Hashable]:
    """What a loop's own code told each of ``schedulers`` (:func:`told_state`), as fingerprint entries
    (``"scheduler 0 LambdaLR told"``): compared, in a plain loop that read its loss, from a release to the next."""
    return {f"scheduler {i} {type(s).__name__} told": told_state(s) for i, s in enumerate(schedulers)}


def told_state(scheduler: Any) -> Hashable:
    """A token of ``scheduler``'s state but for what torch's own methods of its class write as it steps
    (:func:`stepped_fields`: ``last_epoch``, ``_last_lr``, a warm restart's ``T_cur``): what only other code — a
    ``observe(loss)`` of a subclass, a field set by hand — changes. A scheduler it holds (``SequentialLR``'s) is read
    the same way; a ``LambdaLR``'s lambdas by their closures."""
    owned = stepped_fields(type(scheduler)) | _TORCH_FLAGS
    fields = {k: _told(v) for k, v in vars(scheduler).items() if k not in owned and k != "optimizer"}
    lambdas = [fn for fn in getattr(scheduler, "lr_lambdas", None) or () if isinstance(fn, types.FunctionType)]
    return (freeze(fields), tuple(closure_token(fn) for fn in lambdas))


def _told(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_told(v) for v in value]
    if hasattr(value, "optimizer") and hasattr(value, "last_epoch"):  # a scheduler held by a scheduler
        return told_state(value)
    return value


_STEPPED: dict[type, frozenset[str]] = {}


def stepped_fields(cls: type) -> frozenset[str]:
    """The attribute names the methods torch defines for ``cls`` and its bases assign, ``__init__`` left out (what a
    scheduler's own step writes: ``last_epoch``, ``_step_count``, ``_last_lr``, a ``ReduceLROnPlateau``'s ``best``)."""
    known = _STEPPED.get(cls)
    if known is None:
        known = _STEPPED[cls] = frozenset(
            name for base in cls.__mro__ if library_named(base, "torch.")
            for key, value in vars(base).items() if key != "__init__" for name in _assigned(value))
    return known


def _assigned(value: Any) -> set[str]:
    import dis

    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    code = getattr(value, "__code__", None)
    if not isinstance(code, types.CodeType):
        return set()
    codes, names = [code], set()
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        names |= {ins.argval for ins in dis.get_instructions(c) if ins.opname == "STORE_ATTR"}
    return names
