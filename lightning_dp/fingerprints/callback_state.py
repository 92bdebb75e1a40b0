"""Callbacks as the kept-state fingerprint reads them: which are trusted (:func:`trusted_callback`: a library's, or one
handed no batch, :data:`DATA_HOOKS`), what of a callback is state (:func:`callback_state_items`: its attributes and its
``state_dict()``), and which attributes of a user's subclass of a Lightning callback are Lightning's own
(:func:`lightning_owned`, read from the classes' code: :func:`stored_attributes`, :func:`_names`).
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Iterator

from lightning_dp.records.library_objects import TRUSTED_CALLBACK_PREFIXES
from lightning_dp.fingerprints.state_walker import library_function, library_named, library_type, lightning_fields

_MISSING = object()


DATA_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward")
"""The callback hooks that are handed the private batch, its outputs or its loss. The others see only what is public
or guarded: ``on_after_backward`` and ``on_before_optimizer_step`` run after the release (``p.grad`` = ĝ_t), epoch
hooks see the module (whose state is fingerprinted) and the logged metrics (reported, not released: README caveats),
validation hooks see held-out data."""


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` is a LightningDataModule (of either Lightning package)."""
    return any(b.__name__ == "LightningDataModule" for b in type(obj).__mro__)


def trusted_callback(callback: Any) -> bool:
    """A callback whose state cannot hold private data: one of Lightning's or lightning_dp's own, or one that
    overrides none of the hooks handed the batch (:data:`DATA_HOOKS`). The trainer's LightningDataModule is never
    trusted unless a library defines it: the step reaches it (``self.trainer.datamodule.memory.append(x)``). Which
    classes are Lightning's or lightning_dp's is decided by where they were written and the code they run
    (:func:`~lightning_dp.records.library_code.library_named`), not by their ``__module__``."""
    cls = type(callback)
    if library_named(cls, TRUSTED_CALLBACK_PREFIXES):
        return True
    if is_datamodule(callback):
        return library_type(cls)  # the step reaches it: self.trainer.datamodule
    bases = [b for b in cls.__mro__[1:] if library_named(b, TRUSTED_CALLBACK_PREFIXES)]
    base = bases[0] if bases else object
    return all(getattr(cls, hook, None) is getattr(base, hook, None) for hook in DATA_HOOKS)


def callback_state_items(cb: Any) -> Iterator[tuple[str, Any]]:
    """What of callback ``cb`` is state, as (name, value) pairs: its attributes less those Lightning's own code writes
    (:func:`lightning_owned`) and library functions, then its ``state_dict()`` (less Lightning's entries) if any."""
    owned = lightning_owned(type(cb))  # a subclass of Lightning's callback: what Lightning's own code writes is its
    fields = lightning_fields(cb)
    for key, value in fields.items():
        if key not in owned and not library_function(value):
            yield key, value
    try:
        state = cb.state_dict()
    except Exception:  # noqa: BLE001  (a user's state_dict that fails here fails in checkpoints too)
        state = None
    if state and owned and isinstance(state, dict):  # Lightning's entries (ModelCheckpoint's best_model_path) are its
        state = {k: v for k, v in state.items() if not (k in owned and v is fields.get(k, _MISSING))}
    if state:
        yield "state_dict()", state


_OWNED: "weakref.WeakKeyDictionary[type, frozenset[str]]" = weakref.WeakKeyDictionary()


def lightning_owned(cls: type) -> frozenset[str]:
    """The attributes of ``cls`` — the user's subclass of one of Lightning's (or lightning_dp's) callbacks — that are
    Lightning's state: those its own methods write (``ModelCheckpoint``'s ``best_model_path``, ``best_k_models``,
    ``kth_value``, ``current_score``; ``EarlyStopping``'s ``wait_count``, ``best_score``), from the values it monitors
    (judged by rule 10) and the loop's counters, and that the user's code never names (then it may write them: they are
    judged). Empty — everything judged — for a class that is not such a subclass, and where the user's code calls one
    of the base's own methods that are not hooks (``self._save_topk_checkpoint(trainer, {...})``: it hands Lightning's
    code values of its own) or overrides one that returns a value Lightning's code then keeps
    (``_monitor_candidates``, ``format_checkpoint_name``)."""
    try:
        known = _OWNED.get(cls)
    except TypeError:
        return frozenset()
    if known is None:
        known = _OWNED[cls] = _lightning_owned(cls)
    return known


def _lightning_owned(cls: type) -> frozenset[str]:
    library = [b for b in cls.__mro__ if library_named(b, TRUSTED_CALLBACK_PREFIXES)]
    users = [b for b in cls.__mro__ if not library_type(b) and b.__module__ not in ("abc", "builtins")]
    if not library or not users or cls in library:
        return frozenset()
    hooks = {k for b in library if b.__name__ == "Callback" for k in vars(b)}
    helpers = {k for b in library for k, v in vars(b).items() if code_objects(v) and k not in hooks
               and not (k.startswith("__") and k.endswith("__"))}
    named: set[str] = set()
    for b in users:
        for key, value in vars(b).items():
            codes = code_objects(value)
            for code in codes:
                names = _names(code)
                if (names - {key}) & helpers:  # a helper of Lightning's called (its own, through super(): Lightning's)
                    return frozenset()
                named |= names
            if key in helpers and any(_returns_value(code) for code in codes):
                return frozenset()
    stored = {name for b in library for v in vars(b).values() for code in code_objects(v)
              for name in stored_attributes(code)}
    return frozenset(stored - named)


def code_objects(value: Any) -> list[types.CodeType]:
    """The code objects of a class's member: a function's, a static or class method's, a property's accessors."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [c for f in (value.fget, value.fset, value.fdel) for c in code_objects(f)]
    code = getattr(value, "__code__", None)
    return [code] if isinstance(code, types.CodeType) else []


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _names(code: types.CodeType) -> set[str]:
    """Every attribute and global name ``code`` (and the functions it defines) reads or writes."""
    return {name for c in _nested(code) for name in c.co_names}


def stored_attributes(code: types.CodeType) -> set[str]:
    """The attribute names ``code`` (and the functions it defines) assigns (``self.best_model_path = ...``)."""
    import dis

    return {ins.argval for c in _nested(code) for ins in dis.get_instructions(c)
            if ins.opname in ("STORE_ATTR", "DELETE_ATTR")}


def _returns_value(code: types.CodeType) -> bool:
    """Whether ``code`` may return something other than None."""
    import dis

    instructions = list(dis.get_instructions(code))
    for before, ins in zip([None, *instructions], instructions):
        if ins.opname == "RETURN_CONST" and ins.argval is not None:
            return True
        if ins.opname == "RETURN_VALUE" and not (before is not None and before.opname == "LOAD_CONST"
                                                 and before.argval is None):
            return True
    return False
