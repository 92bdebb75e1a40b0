"""What steers later steps besides the released gradient, and the replays that judge it: the optimizers'
hyper-parameters, defaults and state (:func:`hyperparameters`, :func:`settings`), the trainer's length decisions and the
library objects' settings (:func:`loop_controls`, :func:`library_settings`), the learning-rate schedulers and which
parameters train (:func:`decisions`); :func:`replay_records` runs the hooks again and puts them back, and
:func:`hyperparameters_error` refuses a change from the data (rule 3 of docs/release_boundary.md). σ and C:
:mod:`.mechanism_settings`.
"""

from __future__ import annotations

import datetime
import enum
import operator
import weakref
from collections import defaultdict
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from lightning_dp.records.library_code import library_type
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.library_objects import library_callback
from lightning_dp.fingerprints.callback_state import code_objects, stored_attributes
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, changed_entries
from lightning_dp.fingerprints.state_walker import freeze
from lightning_dp.records.identity import Same
from lightning_dp.validators.loop_counters import counters_kept, loop_counters
from lightning_dp.validators.mechanism_settings import (mechanism_decisions, mechanism_settings, mechanism_state,
                                                        put_mechanism_settings)
from lightning_dp.validators.optimizer_extra_state import extra_state, put_state, rebound_state, saved_state
from lightning_dp.validators.schedule_state import put_schedules, schedule_controls, scheduler_state

_MISSING = object()


def hyperparameters(optimizer: Any) -> Fingerprint:
    """What sets the next update besides the released gradient, as fingerprint entries: each parameter group's
    hyper-parameters (every key but ``params``: learning rate, momentum, betas, weight decay, …;
    ``"optimizer param_groups[0].lr"``), its ``defaults`` (``"optimizer defaults.lr"``) and its state
    (``"optimizer state[0][1].exp_avg"``: group, parameter, key; a tensor by identity, shape and version counter, so an
    in-place write shows)."""
    return OptimizerState(optimizer).entries()


class OptimizerState:
    """:func:`hyperparameters` as taken now, its state entries held as rows that compare as a whole without naming
    them: ``rows`` is (labels: (group, parameter, key) of each entry; ids: a tensor's id, else ``None``; tokens: a
    tensor's version, else the value's token; shapes: a tensor's shape, else ``None``), equal exactly when the entries
    are. A release's check (:meth:`changed`) names its entries only when the rows differ. The rows hold their tensors,
    so no id is reused. An optimizer read again with the same layout (:class:`_StateLayout`) reuses its labels and ids
    and reads only the versions and shapes anew."""

    __slots__ = ("settings", "rows", "tensors", "extra")

    def __init__(self, optimizer: Any) -> None:
        self.settings = settings(optimizer)
        layout = _StateLayout.read(optimizer)
        if layout is not None:  # the same tensors under the same keys, and no other key: their versions and shapes
            self.extra, self.tensors = {}, layout.values
            self.rows = (layout.labels, layout.ids, [*map(_VERSION, layout.values)], [*map(_SHAPE, layout.values)])
            return
        self.extra = extra_state(optimizer)
        labels: list[tuple[int, int, Any]] = []
        ids: list[Any] = []
        tokens: list[Any] = []
        shapes: list[Any] = []
        self.tensors = []
        # by identity: what `state.get(p)` finds (a tensor hashes by its id), without a Python __hash__ call a parameter
        state = dict(zip(map(id, optimizer.state), optimizer.state.values()))
        for i, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                values = state.get(id(p))
                if values:
                    for key, value in values.items():
                        labels.append((i, j, key))
                        if isinstance(value, Tensor):
                            self.tensors.append(value)
                            ids.append(id(value)), tokens.append(value._version), shapes.append(value.shape)
                        else:
                            ids.append(None), tokens.append(freeze(value)), shapes.append(None)
        self.rows = (labels, ids, tokens, shapes)
        _StateLayout.keep(optimizer, state, self)

    def entries(self) -> Fingerprint:
        """The fingerprint entries (:func:`hyperparameters`)."""
        out = dict(self.settings)
        tensors = iter(self.tensors)
        for (i, j, key), tensor_id, token, shape in zip(*self.rows):  # a tensor's token: its version
            out[f"optimizer state[{i}][{j}].{key}"] = (token if tensor_id is None
                                                       else (Same(next(tensors)), token, tuple(shape)))
        out.update(self.extra)  # keys that are not its parameters: a loss kept for a loss-aware step size
        return out

    def changed(self, after: "OptimizerState") -> list[str]:
        """The entries that differ from ``after``'s (:func:`changed_entries` of their :meth:`entries`)."""
        if self.rows == after.rows and not changed_entries(self.settings, after.settings) \
                and not changed_entries(self.extra, after.extra):
            return []
        return changed_entries(self.entries(), after.entries())


_VERSION, _SHAPE, _PARAMS = attrgetter("_version"), attrgetter("shape"), itemgetter("params")


class _StateLayout:
    """Where an optimizer's state entries were when last read in full (:class:`OptimizerState`), kept when every value
    was a tensor and every key of the state a parameter of the groups (:func:`extra_state` empty): the groups'
    parameters (held, in order, with each group's length), the state dict each one found (held; ``_MISSING``: none),
    the state's keys and values in that order (values held), and the rows' labels and ids. A later read in which all
    of these are the same objects (C loops: ``operator.is_``), with the same keys and the state as long, finds the same
    labels and ids and no other key, so only the versions and shapes are read again (:meth:`read`); anything else is
    read in full. (No other key: each parameter finds what it found, a key or not, and the state is as long.)"""

    __slots__ = ("lengths", "params", "dicts", "holders", "keys", "values", "labels", "ids", "state_length")
    _kept: "weakref.WeakKeyDictionary[Any, _StateLayout]" = weakref.WeakKeyDictionary()

    @classmethod
    def keep(cls, optimizer: Any, state: dict[int, Any], read: OptimizerState) -> None:
        """Keep the layout of ``read`` (just read in full; ``state``: the state by parameter id) for ``optimizer``; one
        that cannot be kept drops the one kept before (its tensors no longer held)."""
        try:
            cls._kept.pop(optimizer, None)
        except TypeError:  # not weakly referable or not hashable: read in full every time
            return
        layout = cls()
        groups = [_PARAMS(group) for group in optimizer.param_groups]
        layout.lengths = list(map(len, groups))
        layout.params = list(chain.from_iterable(groups))
        layout.dicts = list(map(state.get, map(id, layout.params), repeat(_MISSING)))
        layout.holders = [d for d in layout.dicts if d is not _MISSING and d is not None]
        if not all(type(d) is dict for d in layout.holders):
            return
        layout.keys = list(chain.from_iterable(layout.holders))
        layout.values = list(chain.from_iterable(map(dict.values, layout.holders)))
        layout.labels, layout.ids = read.rows[0], read.rows[1]
        layout.state_length = len(state)
        if None in layout.ids or read.extra or len({id(p) for p in layout.params if id(p) in state}) != len(state):
            return  # a value not a tensor, or a key not a parameter: read in full every time
        try:
            cls._kept[optimizer] = layout
        except TypeError:  # not hashable: read in full every time
            pass

    @classmethod
    def read(cls, optimizer: Any) -> Optional["_StateLayout"]:
        """The layout kept for ``optimizer`` if its state is still laid out so (see the class), else ``None``."""
        try:
            layout = cls._kept.get(optimizer)
        except TypeError:
            return None
        state = getattr(optimizer, "state", None)
        if layout is None or type(state) not in (dict, defaultdict) or len(state) != layout.state_length:
            return None
        groups = list(map(_PARAMS, optimizer.param_groups))
        params = list(chain.from_iterable(groups))
        if list(map(len, groups)) != layout.lengths or not all(map(operator.is_, params, layout.params)):
            return None
        dicts = list(map(dict(zip(map(id, state), state.values())).get, map(id, params), repeat(_MISSING)))
        if not all(map(operator.is_, dicts, layout.dicts)):
            return None
        values = list(chain.from_iterable(map(dict.values, layout.holders)))  # (the same dicts: just checked)
        if len(values) != len(layout.values) or not all(map(operator.is_, values, layout.values)) \
                or list(chain.from_iterable(layout.holders)) != layout.keys:
            return None
        return layout


def settings(optimizer: Any) -> Fingerprint:
    """Each parameter group's hyper-parameters and the optimizer's ``defaults`` (:func:`hyperparameters` without the
    state: cheap enough to note at every batch's end)."""
    out: Fingerprint = {f"optimizer defaults.{key}": freeze(value)
                        for key, value in (getattr(optimizer, "defaults", None) or {}).items()}
    for i, group in enumerate(optimizer.param_groups):
        prefix = f"optimizer param_groups[{i}]."
        out.update({f"{prefix}{key}": freeze(value) for key, value in group.items() if key != "params"})
    return out


def steered_hyperparameters(optimizer: Any, replays: Sequence[Callable[[], None]], loop: Any = None) -> list[str]:
    """Run each of ``replays`` (the loop's batch hooks on different examples) from the optimizer as it is now
    (:func:`replay_records`) and name what the data steers: a hyper-parameter or default the replays set to different
    values (a learning rate from the loss; a warm-up from the step count sets the same value whatever the batch, and
    is allowed), or a state entry any replay wrote (a moment written from the batch)."""
    before, seen = replay_records(optimizer, replays, loop)
    apart = {n for h in seen[1:] for n in changed_entries(seen[0], h)}
    return sorted(set(state_written(before, seen)) | apart)


def replay_records(optimizer: Any, replays: Sequence[Callable[[], None]],
                   loop: Any = None) -> tuple[Fingerprint, list[Fingerprint]]:
    """Run each of ``replays``, putting the optimizer's hyper-parameters and defaults back after each; returns the
    :func:`hyperparameters` before and after each replay. ``loop`` (the trainer): its ``should_stop``,
    ``max_epochs`` and ``max_steps`` are recorded (``"trainer should_stop"``) and put back the same way (training
    stopped, or lengthened, when the loss or a training accuracy crosses a threshold), and so are the mechanism's σ and
    C (:func:`mechanism_settings`)."""
    before, put_back = hyperparameters(optimizer), settings_kept(optimizer, loop)
    seen: list[Fingerprint] = []
    for replay in replays:
        try:
            replay()
        finally:
            seen.append(replay_decisions(optimizer, loop))
            put_back()
    return before, seen


def settings_kept(optimizer: Any, loop: Any) -> Callable[[], None]:
    """What :func:`replay_records` puts back, recorded now: the optimizer's hyper-parameters, defaults and state, the
    trainer's :func:`loop_controls`, the loop's counters (:func:`~.loop_counters.counters_kept`) and the mechanism's σ
    and C; the function returned sets them back as they are
    now."""
    groups = [(group, group["params"], list(group["params"])) for group in optimizer.param_groups]
    saved = ([{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
             dict(getattr(optimizer, "defaults", None) or {}))
    controls, mechanism, state = loop_controls(loop), mechanism_settings(loop), saved_state(optimizer)
    counters = counters_kept(loop)

    def put_back() -> None:
        put_state(optimizer, state)
        counters()
        put_loop_controls(loop, controls)
        put_mechanism_settings(loop, mechanism)
        optimizer.param_groups[:] = [group for group, _, _ in groups]  # as they were: a group a replay added goes,
        for (group, params, held), values in zip(groups, saved[0]):  # and a key; the parameters each group held
            if isinstance(params, list):
                params[:] = held
            group.clear()
            group.update(values, params=params)
        if isinstance(getattr(optimizer, "defaults", None), dict):
            optimizer.defaults.clear()
            optimizer.defaults.update(saved[1])
    return put_back


def replay_decisions(optimizer: Any, loop: Any) -> Fingerprint:
    """What :func:`replay_records` compares after each replay: the optimizer's :func:`hyperparameters`, the trainer's
    :func:`loop_controls` (``"trainer should_stop"``), the loop's own counters and limits
    (:func:`~.loop_counters.loop_counters`: ``global_step``, ``max_batches``, the batch and epoch progress) and the
    mechanism's σ and C (:func:`mechanism_decisions`)."""
    return {**hyperparameters(optimizer), **{f"trainer {k}": v for k, v in loop_controls(loop).items()},
            **loop_counters(loop), **mechanism_decisions(loop)}


def step_decisions(trainer: Any) -> Fingerprint:
    """What a step may not change between its ``training_step`` and its release: σ, C and what else decides the
    release (:func:`mechanism_state`: the clipping policy's settings and state, the noise, the plan), the trainer's
    decisions and library settings (:func:`loop_controls`) and the loop's counters it does not move in a step
    (:func:`~.loop_counters.loop_counters`, ``steady``: ``global_step``, ``max_batches``), as fingerprint entries."""
    step = getattr(getattr(trainer, "strategy", None), "private_step", None)
    return {**mechanism_state(step), **{f"trainer {k}": v for k, v in loop_controls(trainer).items()},
            **loop_counters(trainer, steady=True)}


def state_written(before: Fingerprint, seen: Sequence[Fingerprint]) -> list[str]:
    """The optimizer state entries (moments) any replay wrote: a replay of the hooks may not touch them at all."""
    return sorted({n for h in seen for n in changed_entries(before, h) if n.startswith("optimizer state")})


def loop_controls(loop: Any) -> dict[str, Any]:
    """The trainer's decisions on how long training runs, and the library objects' settings that decide when it
    validates, checkpoints or stops (:func:`library_settings`; none without a trainer)."""
    if loop is None:
        return {}
    fit = getattr(loop, "fit_loop", None)
    return {"should_stop": bool(getattr(loop, "should_stop", False)), "max_epochs": getattr(fit, "max_epochs", None),
            "max_steps": getattr(getattr(fit, "epoch_loop", None), "max_steps", None),
            **{name: value for name, (_, _, value) in library_settings(loop).items()}, **schedule_controls(loop)}


TRAINER_SETTINGS = ("val_check_batch", "val_check_interval", "check_val_every_n_epoch", "limit_train_batches",
                    "limit_val_batches", "num_sanity_val_steps", "log_every_n_steps",
                    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
                    "reload_dataloaders_every_n_epochs", "fit_loop.min_epochs", "fit_loop.epoch_loop.min_steps")
"""The trainer's (and its loops') scheduling settings a user's hook may write: when it validates, how many batches an
epoch or a validation has, how often it logs, how long it must run at least. (``trainer.num_training_batches`` is a
property, ``fit_loop.max_batches``: among the loop's counters, :mod:`.loop_counters`.)"""


_SETTING_TYPES = (bool, int, float, str, type(None), datetime.timedelta, enum.Enum)


_SET_UP = ("__init__", "setup", "load_state_dict", "on_load_checkpoint", "on_fit_start", "on_train_start")
"""The methods of a library callback that set its configuration, before training starts (``ModelCheckpoint``'s
``__init_triggers`` too: a name holding ``__init``)."""


def library_settings(trainer: Any) -> dict[str, tuple[Any, str, Any]]:
    """The settings of the library objects that steer the fit — ``"EarlyStopping.patience"``,
    ``"Timer._duration"``, ``"ModelCheckpoint._every_n_train_steps"``, ``"val_check_batch"`` (:data:`TRAINER_SETTINGS`)
    — as name → (object, attribute, value). A library callback's (Lightning's, lightning_dp's) are its attributes
    holding a number, a string, a flag, ``None``, a duration or an enum that its own code writes only as it is set up
    (:data:`_SET_UP`); what it writes as it runs (``EarlyStopping.wait_count``, ``best_score``, ``ModelCheckpoint``'s
    best paths, ``Timer``'s start times) is its state, from held-out metrics and the clock, not a setting. Written by
    the user's code from the training data (a patience, a threshold, a duration, a checkpoint or validation schedule
    set from the batch loss), they decide later stops, releases and validations: judged as the optimizer's
    hyper-parameters are (:func:`replay_records`, :mod:`.decisions`)."""
    out: dict[str, tuple[Any, str, Any]] = {}
    for path in TRAINER_SETTINGS:
        *parents, key = path.split(".")
        obj = trainer
        for parent in parents:
            obj = getattr(obj, parent, None)
        value = vars(obj).get(key, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        if isinstance(value, _SETTING_TYPES):
            out[path] = (obj, key, value)
    callbacks = [cb for cb in getattr(trainer, "callbacks", None) or () if library_callback(cb)]
    labels = [type(cb).__name__ for cb in callbacks]
    for i, (cb, label) in enumerate(zip(callbacks, labels)):
        if labels.count(label) > 1:
            label = f"{label}[{labels[:i].count(label)}]"
        running = _running_state(type(cb))
        for key, value in vars(cb).items():
            if key not in running and isinstance(value, _SETTING_TYPES):
                out[f"{label}.{key}"] = (cb, key, value)
    return out


_RUNNING: "weakref.WeakKeyDictionary[type, frozenset[str]]" = weakref.WeakKeyDictionary()


def _running_state(cls: type) -> frozenset[str]:
    """The attributes a library callback's own methods write after it is set up (:data:`_SET_UP`): its state."""
    known = _RUNNING.get(cls)
    if known is None:
        known = _RUNNING[cls] = frozenset(
            name for b in cls.__mro__ if library_type(b)
            for key, value in vars(b).items() if key not in _SET_UP and "__init" not in key
            for code in code_objects(value) for name in stored_attributes(code))
    return known


def decisions(trainer: Any) -> Fingerprint:
    """What a hook outside the step may decide for later steps: each optimizer's hyper-parameters and defaults
    (:func:`settings`, ``"optimizer 0 param_groups[0].lr"``), which optimizers step (one swapped for
    another), the learning-rate schedulers' states (a scheduler told the loss, applying it at its next step), which
    of the model's parameters train (a backbone unfrozen), the trainer's length decisions (``"trainer should_stop"``)
    and the mechanism's σ and C (:func:`mechanism_decisions`)."""
    out: Fingerprint = {f"trainer {k}": v for k, v in loop_controls(trainer).items()}
    out.update(mechanism_decisions(trainer))
    optimizers = list(getattr(trainer, "optimizers", None) or ())
    out["trainer optimizers"] = tuple(type(o).__qualname__ for o in optimizers)
    for i, optimizer in enumerate(optimizers):
        noted = {**settings(optimizer), **rebound_state(optimizer)}  # a loss kept for the next step size too
        out.update({f"optimizer {i} {key.partition(' ')[2]}": v for key, v in noted.items()})
    for i, scheduler in enumerate(schedulers(trainer)):
        out.update({f"scheduler {i} {key}": freeze(value) for key, value in scheduler_state(scheduler).items()})
    module = getattr(trainer, "lightning_module", None)
    if module is not None:
        out["model trainable"] = tuple(name for name, p in module.named_parameters() if p.requires_grad)
    return out


def schedulers(trainer: Any) -> list[Any]:
    """The learning-rate schedulers Lightning steps for ``trainer``."""
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or ()]


def put_loop_controls(loop: Any, controls: dict[str, Any]) -> None:
    """The trainer's decisions of :func:`loop_controls` set back to ``controls``."""
    if loop is None:
        return
    loop.should_stop = controls["should_stop"]
    fit = getattr(loop, "fit_loop", None)
    if fit is not None and getattr(fit, "max_epochs", None) != controls["max_epochs"]:
        fit.max_epochs = controls["max_epochs"]
    epoch_loop = getattr(fit, "epoch_loop", None)
    if epoch_loop is not None and getattr(epoch_loop, "max_steps", None) != controls["max_steps"]:
        epoch_loop.max_steps = controls["max_steps"]
    for name, (obj, key, value) in library_settings(loop).items():  # as the replayed hooks found them
        if name in controls and (type(value) is not type(controls[name]) or value != controls[name]):
            setattr(obj, key, controls[name])
    put_schedules(loop, controls)


def hyperparameters_error(changed: Sequence[str], where: str) -> PrivacyConfigurationError:
    """The refusal of an optimizer hyper-parameter or state entry changed within a step (rule 3)."""
    return PrivacyConfigurationError(
        f"The optimizer's hyper-parameters or state, the mechanism's σ or C, how long the trainer runs or a library "
        f"callback's or the trainer's setting changed {where}: {', '.join(changed[:6])}. A learning rate, momentum or "
        "weight decay set from the batch or its loss, a moment written from it, a noise multiplier σ or clipping "
        "bound C set from it, a stop (should_stop, max_epochs, max_steps; an EarlyStopping patience or threshold, a "
        "Timer duration) or a validation or checkpoint schedule decided from it steers every later update (or how "
        "many are released) by un-noised training data, outside the "
        "guarantee. Nothing more was released. Set hyper-parameters from the step count (a learning-rate scheduler, "
        "which Lightning steps after the update) or from held-out data at validation; leave σ and C to the strategy "
        "(a target ε calibrates σ; AdaptiveClipping moves C privately), and the optimizer's state to its step.")
