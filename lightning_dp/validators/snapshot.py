"""Put the user's state back as it was: the probe's and the later checks' passes leave no trace.

The first step's probe and the interaction checks run the user's ``training_step`` on examples several
times. Whatever those passes write — a torchmetrics ``MeanMetric``'s running sums, a ``training_step_outputs``
list, a counter declared public, a callback's history — must be exactly as if they never ran: the training
that follows (and its logged epoch means) sees only the real steps. :class:`StateSnapshot` records the objects
held by the module's attributes, its buffers, every torchmetrics state, and the attributes of the given
callbacks, the module-level globals of the user's code (the modules the fingerprint reads:
:attr:`~lightning_dp.privacy.boundary.ReleaseBoundary.global_modules`) and the data in those modules' classes'
bodies, and :meth:`StateSnapshot.restore` puts back both the references (an attribute rebound to a new
object gets its old object back) and their contents (a list appended to is cut back, a tensor written in place
gets its old values; a ``__slots__`` object's slots and a user's function's own attributes, ``stat.v = x``, too),
to :data:`~lightning_dp.fingerprints.state_walker.MAX_DEPTH` levels; and the modules' modes
and which parameters train (a replayed epoch hook that unfreezes a layer leaves the real run's set, not its own).
A module reached through the user's state outside the model's registry (a teacher ``copy.deepcopy``-ed into a list)
has its tensors' contents put back; a library's object (a ``DataLoader`` held as a global) what was added to it since
the fingerprint first saw it (:data:`~lightning_dp.fingerprints.first_fields.FIRST_SEEN`), never the library's own
attributes. :meth:`StateSnapshot.restore_users` puts back the user's state alone (each pass of the probe and of the
batch check starts from it: a counter the loss reads is read alike by every pass).
"""

from __future__ import annotations

from collections import deque
from contextvars import ContextVar
import types
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.records.values import same_tensor_values
from lightning_dp.records.library_code import forged_or_own, library_named, library_rooted, library_type
from lightning_dp.fingerprints.context_values import is_context_variable
from lightning_dp.containers import held_items, put_back
from lightning_dp.fingerprints.dataset_tokens import put_back as put_datasets_back
from lightning_dp.fingerprints.first_fields import FIRST_SEEN
from lightning_dp.fingerprints.context_values import restore as context_restore
from lightning_dp.fingerprints.module_tree import engine_forward
from lightning_dp.fingerprints.state_walker import (MAX_DEPTH, callable_state, class_attributes, configuration_object,
                                                   library_callable, library_object as _library_object, method_cells,
                                                   slot_descriptors, slot_fields, users_method)
from lightning_dp.records.library_objects import framework_keys
from lightning_dp.validators.steered_settings import library_settings

Restore = Callable[[], None]


def _contents(value: Any, depth: int) -> Restore:
    """A function that puts ``value``'s current contents back into the same object. A parameter held in an attribute
    (``nn.LSTM``'s ``_flat_weights``, inherited by a user's subclass) is the model itself, not kept state: never copied
    back (that would move its version counter, which the release boundary reads as a write); a write to it is refused
    by the fingerprint instead."""
    if isinstance(value, nn.Parameter):
        return _nothing
    if is_context_variable(value):  # a global ContextVar: its value, set again
        return context_restore(value)
    if isinstance(value, Tensor) and value.is_inference():
        return _nothing  # a metric's state left by trainer.test(): no version counter, and no write outside inference
    if isinstance(value, Tensor):
        saved, version = value.detach().clone(), value._version
        return lambda: _copy_tensor(value, saved, version)
    if type(value).__module__ == "numpy" and hasattr(value, "copy") and hasattr(value, "shape"):
        if not getattr(getattr(value, "flags", None), "writeable", False):
            return _nothing  # a NumPy scalar or a read-only array: no pass can have written it in place
        saved_array = value.copy()

        def put_array() -> None:
            if value.shape == saved_array.shape:
                value[...] = saved_array
        return put_array
    if isinstance(value, nn.Module):  # one held outside the model's registry (a teacher in a list): its tensors
        return _module_tensors(value) if depth < MAX_DEPTH and id(value) not in _REGISTERED.get() else _nothing
    if depth >= MAX_DEPTH:
        return _nothing
    if isinstance(value, (list, deque, dict, set)):
        items = held_items(value)
        values = [v for _, v in items] if isinstance(value, dict) else [] if isinstance(value, set) else items
        inner = [_contents(v, depth + 1) for v in values]

        def put_items() -> None:
            put_back(value, items)
            for restore in inner:
                restore()
        return put_items
    if isinstance(value, tuple):
        inner = [_contents(v, depth + 1) for v in value]
        return lambda: [restore() for restore in inner] and None
    slots = slot_fields(value) if not isinstance(value, type) else []
    if slots:  # a user's object with __slots__ (a memo with no __dict__): its slots, and its attributes if any
        inner_slots = _slots(value, slots, depth + 1)
        if not hasattr(value, "__dict__"):
            return inner_slots
        inner_dict = _attributes(value, list(vars(value)), depth + 1)
        return lambda: (inner_dict(), inner_slots()) and None
    if hasattr(value, "__dict__") and not isinstance(value, type) and _plain(value):
        return _attributes(value, list(vars(value)), depth + 1)
    if _library_object(value):  # a library's object: what was added to it only (`loader.seen += 1` put back)
        return _added(value, depth, set())
    return _nothing


def class_state(classes: Iterable[type]) -> list[Restore]:
    """Functions that put back the data the user's ``classes`` keep (:func:`~.state_walker.class_attributes`: a
    class body's ``history = []``, a method's mutable defaults, closure cells and attributes) as they are now."""
    restores: list[Restore] = []
    for cls, key, value in class_attributes(classes):  # `history = []` in a class body
        if key.endswith(".__defaults__"):  # a method's mutable default arguments: their contents
            restores.extend(_contents(v, 0) for v in value)
            continue
        if key.endswith(".__closure__"):  # what a method's closure holds: rebound and its contents
            method = users_method(vars(cls)[key.removesuffix(".__closure__")])
            restores.extend(_cell_restore(cell) for cell in method_cells(method))
            continue
        if key.endswith(".__dict__"):  # a method's attributes (`forward.stats`): below, with those added later
            continue
        restores.append(_contents(value, 0))
        restores.append(partial(_rebind_class_attribute, cls, key, value))
    seen: set[type] = set()
    for cls in classes:  # every method's own attributes (`forward.stats`): their contents, those added since removed
        for base in cls.__mro__:
            if base not in seen and not library_type(base):
                seen.add(base)
                restores.extend(function_attributes(users_method(v)) for k, v in list(vars(base).items())
                                if isinstance(v, types.FunctionType) and not k.startswith("__"))
    return restores


def function_state(fn: Any) -> list[Restore]:
    """Functions that put back what a callable keeps between calls (:func:`~.state_walker.callable_state`: a
    closure's cells, rebound and with their contents — ``cache = {}`` of the function that made a ``LambdaLR``'s
    rate —, its default arguments' contents, a bound method's object's attributes) as they are now."""
    if isinstance(fn, partial):
        return [_contents(v, 0) for v in (*fn.args, *fn.keywords.values())] + function_state(fn.func)
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        return ([_attributes(owner, list(vars(owner)), 0)] if hasattr(owner, "__dict__") else []) \
            + function_state(fn.__func__)
    if isinstance(fn, types.FunctionType):
        return [_cell_restore(cell) for cell in method_cells(fn)] \
            + [_contents(v, 0) for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())] \
            + [function_attributes(fn)]
    return [_attributes(fn, list(vars(fn)), 0)] if hasattr(fn, "__dict__") and not isinstance(fn, type) else []


def function_attributes(fn: types.FunctionType) -> Restore:
    """A function that puts a user's function's own attributes back as they are now (``stat.v = x`` a memo set at
    its first call: removed again; ``rate.memo`` a dict filled: cut back); a library's function: nothing."""
    if library_callable(fn):
        return _nothing
    return _attributes(fn, list(vars(fn)), 0)


def object_state(owner: Any) -> Restore:
    """A function that puts ``owner``'s attributes back as they are now, with their contents (a tensor written in
    place gets its values back, a dict or list its items; an attribute added since goes): an optimizer's state and
    its own attributes around the runs again of its update (:mod:`.judged_updates`)."""
    return _attributes(owner, list(vars(owner)), 0)


def _added(value: Any, depth: int, seen: set[int]) -> Restore:
    """Restore what was added to a library's object since the fingerprint first saw it
    (:data:`~lightning_dp.fingerprints.first_fields.FIRST_SEEN`; an object it has not seen: nothing), and to the
    library objects its own attributes hold, to :data:`MAX_DEPTH` levels; the library's own attributes are left alone
    (as the fingerprint reads them: :func:`~lightning_dp.fingerprints.state_walker.added_attributes`)."""
    known = FIRST_SEEN.seen(value)
    if known is None or id(value) in seen:
        return _nothing
    seen.add(id(value))
    fields = list(vars(value).items())
    restores = [_attributes(value, [k for k, _ in fields if k not in known], depth + 1)]
    if depth + 1 < MAX_DEPTH:
        restores.extend(_added(v, depth + 1, seen) for k, v in fields
                        if k in known and _library_object(v))
    restores = [r for r in restores if r is not _nothing]
    return (lambda: [r() for r in restores] and None) if restores else _nothing


def _plain(value: Any) -> bool:
    """Whether ``value``'s attributes are restored: a plain object of the user's, or a library's configuration object
    (Hugging Face's ``model.config``: :func:`~.state_walker.configuration_object`), whose public fields the fingerprint
    reads as state — a ``config.problem_type`` a pass set on its first forward is ``None`` again after it."""
    return not library_rooted(type(value), ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "builtins",
                                            "logging", "threading", "transformers", "torchmetrics")) \
        or configuration_object(value)


def _attributes(owner: Any, keys: Sequence[str], depth: int, keep: frozenset[str] = frozenset()) -> Restore:
    """Restore ``owner.key`` for every key: the same object, with its contents; an attribute the passes added is
    removed: a public one (no leading underscore) on any object; on an object of the user's class (not a library's)
    an underscored one too (``self._handle = layer.register_forward_hook(...)`` made lazily at a hook's first call:
    left in place, the runs again would find it made and do nothing, and the real run's write would look like one
    the data decided), unless torch, Lightning or the engine keep it (``keep``; ``_dp_``, dunder names)."""
    held = {k: owner.__dict__[k] for k in keys if k in owner.__dict__}
    inner = [_contents(v, depth) for v in held.values()]
    before = set(owner.__dict__)
    users = not library_type(type(owner))

    def added(key: str) -> bool:
        if key in before:
            return False
        if not key.startswith("_"):
            return True
        return users and key not in keep and not key.startswith(("__", "_dp_"))

    def put() -> None:
        for key in [k for k in owner.__dict__ if added(k)]:
            del owner.__dict__[key]
        for key, value in held.items():
            if owner.__dict__.get(key, _ABSENT) is not value:
                owner.__dict__[key] = value
        for restore in inner:
            restore()
    return put


def _slots(owner: Any, fields: list[tuple[str, Any]], depth: int) -> Restore:
    """Restore the ``__slots__`` of a user's object (:func:`~.state_walker.slot_fields`): each set slot bound to its
    object again, with its contents; a slot set since (unset now) emptied again."""
    held = dict(fields)
    inner = [_contents(v, depth) for v in held.values()]
    descriptors = dict(slot_descriptors(type(owner)))

    def put() -> None:
        for key, descriptor in descriptors.items():
            try:
                now = descriptor.__get__(owner, type(owner))
            except AttributeError:
                now = _ABSENT
            if key not in held:
                if now is not _ABSENT:
                    descriptor.__delete__(owner)
            elif now is not held[key]:
                descriptor.__set__(owner, held[key])
        for restore in inner:
            restore()
    return put


def _globals(mod: types.ModuleType) -> Restore:
    """Restore a module's globals as the fingerprint reads them (:meth:`~lightning_dp.validators.kept_state.
    StateFingerprint.take`): every name bound to its object again, with its contents (a list appended to is cut
    back, a counter rebound gets its old value); a function's kept state (a default argument, a closure's list) its
    contents (functions themselves are not rebound). Modules and classes are left (a class's body:
    :func:`~lightning_dp.fingerprints.state_walker.class_attributes`); a public name (no leading underscore) the passes
    added is removed."""
    fields = vars(mod)
    held: dict[str, Any] = {}
    inner: list[Restore] = []
    for key, value in list(fields.items()):
        if key.startswith("__") or isinstance(value, (types.ModuleType, type)):
            continue
        if isinstance(value, _CALLABLES):  # `def f(x, _seen=[])` at module level: what it keeps, in place
            if isinstance(value, (types.FunctionType, partial)):
                inner.extend(_contents(v, 0) for v in callable_state(value) if isinstance(v, _KEPT))
            if isinstance(value, types.FunctionType):  # `stat.v = x`, a memo in its own attributes
                inner.append(function_attributes(value))
            continue
        held[key] = value
        if not _large(value):  # the training data kept in a script's global: rebound only (a write in place is the
            inner.append(_contents(value, 0))  # fingerprint's to refuse), never copied at every snapshot
    before = set(fields)

    def put() -> None:
        for key in [k for k, v in list(fields.items()) if k not in before and not k.startswith("_")
                    and not isinstance(v, (types.ModuleType, type, *_CALLABLES))]:
            del fields[key]
        for key, value in held.items():
            if fields.get(key, _ABSENT) is not value:
                fields[key] = value
        for restore in inner:
            restore()
    return put


def _large(value: Any) -> bool:
    """A tensor or NumPy array of more than :data:`LARGE` elements."""
    size = value.numel() if isinstance(value, Tensor) else getattr(value, "size", 0) \
        if type(value).__module__ == "numpy" else 0
    return isinstance(size, int) and size > LARGE


LARGE = 1 << 22
"""Globals above this many elements (16 MiB of float32) are not copied by a snapshot."""

_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, partial)
_KEPT = (list, dict, set, deque, Tensor)


def _cell_restore(cell: types.CellType) -> Restore:
    """A closure cell bound again to what it holds now (a ``nonlocal`` rebinding undone), with its contents."""
    value, inner = cell.cell_contents, _contents(cell.cell_contents, 0)

    def put() -> None:
        if cell.cell_contents is not value:
            cell.cell_contents = value
        inner()
    return put


def _rebind_class_attribute(cls: type, key: str, value: Any) -> None:
    if vars(cls).get(key, _ABSENT) is not value:
        setattr(cls, key, value)


def _copy_tensor(target: Tensor, saved: Tensor, version: int) -> None:
    """Put ``saved`` back into ``target`` unless it still holds it (its version counter did not move and its contents
    are equal: a write through ``.data`` moves no counter): a tensor the model merely refers to (the training tensor,
    kept for a report) is not written, so its version — which the release boundary compares — stays."""
    if target._version == version and target.shape == saved.shape and target.layout == torch.strided \
            and same_tensor_values(target, saved):
        return
    with torch.no_grad():
        if target.shape == saved.shape:
            target.copy_(saved)
        else:
            target.data = saved


def _nothing() -> None:
    pass


_ABSENT = object()


_REGISTERED: ContextVar[frozenset[int]] = ContextVar("_REGISTERED", default=frozenset())
"""While a :class:`StateSnapshot` records: the ids of the model's modules (put back as the model's, by their slots);
another module reached through the user's state (a teacher ``copy.deepcopy``-ed into a list) has its tensors'
contents put back (:func:`_module_tensors`)."""


class StateSnapshot:
    """What the user's passes may write, recorded now; :meth:`restore` puts it back.

    Args:
        module: the model (its buffers, its modules' own attributes, torchmetrics states).
        callbacks: objects whose attributes are restored too (the untrusted callbacks).
        skip_keys: attribute names never touched (the engine's own).
        modules: the Python modules of the user's code whose globals the fingerprint reads (the boundary's
            ``global_modules()``): their globals and the data in their classes' bodies are restored too — an epoch
            counter (``global EPOCHS; EPOCHS += 1``) a replay of the epoch hooks moved is moved back.
        settings: the library callbacks' and the trainer's settings (:func:`~.steered_settings.library_settings`) are
            restored too (not where :func:`~.steered_settings.replay_records` compares, then puts them back, after the
            restore).
    """

    def __init__(self, module: nn.Module, callbacks: Sequence[Any] = (), skip_keys: Iterable[str] = (),
                 modules: Iterable[types.ModuleType] = (), settings: bool = True) -> None:
        token = _REGISTERED.set(frozenset(map(id, module.modules())))
        try:
            self._users, self._loop = self._recorded(module, callbacks, skip_keys, modules, settings)
        finally:
            _REGISTERED.reset(token)

    @staticmethod
    def _recorded(module: nn.Module, callbacks: Sequence[Any], skip_keys: Iterable[str],
                  modules: Iterable[types.ModuleType], settings: bool) -> tuple[list[Restore], list[Restore]]:
        skip = framework_keys() | frozenset(skip_keys)
        restores: list[Restore] = []
        layers: list[Restore] = []  # torch's layers' references: restore() only (the engine sets its own there)
        for m in module.modules():
            buffers = [(name, b) for name, b in m._buffers.items() if b is not None]
            restores.extend(_contents(b, 0) for _, b in buffers)
            restores.append(_rebind_buffers(m, buffers))
            keys = [k for k, v in vars(m).items() if (k not in skip or k == "forward" and not engine_forward(v))
                    and not k.startswith("_dp_")]  # (a forward the user set on the layer is put back too; an
            # engine's is the engine's: put back after the engine detached, a later fit would run it)
            if library_named(type(m), "torch."):
                # torch's own layers: their references only (an attribute cached on an nn.Linear goes away again);
                # their contents are configuration, or Parameters held in lists (an RNN's _flat_weights)
                layers.append(_attributes(m, keys, MAX_DEPTH))
                continue
            restores.append(_attributes(m, keys, 0, skip))
        for cb in callbacks:  # (a module it holds outside the model, a teacher it trains: its tensors, _contents)
            restores.append(_attributes(cb, list(vars(cb)), 0, skip))
        users = [m for m in module.modules() if not library_named(type(m), "torch.")] + list(callbacks)
        classes = [type(obj) for obj in users]
        for mod in modules:
            restores.append(_globals(mod))
            classes.extend(v for k, v in list(vars(mod).items())  # `class HP: temperature = 1.0` of the user's code
                           if isinstance(v, type) and not k.startswith("__") and forged_or_own(v, mod))
        restores.extend(class_state(classes))
        users_state, restores = restores, layers  # (restore_users: up to here)
        modes = [(m, m.training) for m in module.modules()]  # a pass that calls .train() leaves the modes as found,
        restores.append(lambda: [setattr(m, "training", mode) for m, mode in modes] and None)
        restores.append(partial(_put_trainable, [(p, p.requires_grad) for p in module.parameters()]))  # and the flags
        trainer = getattr(module, "_trainer", None)  # the library callbacks' and the trainer's settings, as found
        for dataset, collate in _training_datasets(trainer):  # the training data's (set_epoch's), rebound only
            restores.append(put_datasets_back(dataset, collate))
        if trainer is not None and settings:
            restores.append(partial(_put_settings, library_settings(trainer)))
        return users_state, restores

    def restore(self) -> None:
        """Put every recorded reference and content back."""
        self.restore_users()
        for restore in self._loop:
            restore()

    def restore_users(self) -> None:
        """Put back the user's state only — buffers, the attributes of the user's modules and callbacks, globals,
        class bodies — not the loop's part (the modules' modes, which parameters train, the references torch's own
        layers hold, which the engine re-attached between passes sets, the training data's and the library
        settings): what every pass of the probe and the batch check starts from
        (:class:`~.probe.ExampleIndependenceProbe`'s ``start_state``), whose passes set the modes themselves."""
        for restore in self._users:
            restore()


def _put_settings(settings: dict[str, tuple[Any, str, Any]]) -> None:
    """:func:`~lightning_dp.validators.steered_settings.library_settings` as recorded (an ``EarlyStopping.patience`` a
    pass of the user's ``training_step`` set)."""
    for obj, key, value in settings.values():
        now = vars(obj).get(key, _ABSENT)
        if now is not value and (type(now) is not type(value) or now != value):
            setattr(obj, key, value)


def _training_datasets(trainer: Any) -> list[tuple[Any, Any]]:
    """(dataset, collate function) the release boundary fingerprints (``PrivateStep.poisson_loader``'s), in a fit."""
    private = getattr(getattr(trainer, "strategy", None), "private_step", None)
    collate = getattr(getattr(private, "training_loader", None), "collate_fn", None)
    boundary = getattr(private, "boundary", None)
    return [(d, collate) for d in boundary.datasets()] if boundary is not None else []


def _put_trainable(flags: list[tuple[nn.Parameter, bool]]) -> None:
    """Which parameters train, as recorded: a replayed hook that unfreezes a layer leaves the real run's set."""
    for p, flag in flags:
        if p.requires_grad != flag:
            p.requires_grad_(flag)


def _module_tensors(m: nn.Module) -> Restore:
    """A module a callback holds outside the model (a teacher it trains): its parameters' and buffers' contents,
    written back where a pass changed them."""
    saved = [(t, t.detach().clone(), t._version) for t in (*m.parameters(), *m.buffers())]
    return lambda: [_copy_tensor(t, copy, version) for t, copy, version in saved] and None


def _rebind_buffers(m: nn.Module, buffers: list[tuple[str, Tensor]]) -> Restore:
    def put() -> None:
        for name, b in buffers:
            if m._buffers.get(name) is not b:
                m._buffers[name] = b
    return put
