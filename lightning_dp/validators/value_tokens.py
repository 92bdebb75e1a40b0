"""Hashable tokens of plain Python values, for comparing state that lives outside the modules: an optimizer's state
kept under keys that are not its parameters (:mod:`.optimizer_extra_state`), a learning-rate scheduler's state and
its lambdas' closures (:mod:`.schedule_state`). Two tokens are equal when a write from the data could not have told
the values apart (a tensor by its contents when small, else by its identity and version counter)."""

from __future__ import annotations

import hashlib
import types
from collections.abc import Hashable
from typing import Any

import numpy as np
from torch import Tensor, nn

__all__ = ["freeze", "closure_token"]

_DEPTH = 4
_ITEMS = 256
_SMALL = 16


def freeze(value: Any, depth: int = 0) -> Hashable:
    """A hashable token of ``value``: numbers (floats by ``repr``, so a NaN equals itself), strings and flags as
    they are; tensors and arrays by their contents when small; containers item by item; a plain object by its
    attributes; to :data:`_DEPTH` levels (deeper values by their type)."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, Tensor):
        return _tensor_token(value)
    if isinstance(value, np.ndarray):
        return ("array", value.shape, hashlib.sha1(np.ascontiguousarray(value).tobytes()).digest())
    if depth >= _DEPTH:
        return ("deep", type(value).__qualname__)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), freeze(v, depth + 1)) for k, v in list(value.items())[:_ITEMS])))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(freeze(v, depth + 1) for v in list(value)[:_ITEMS]), len(value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(freeze(v, depth + 1)) for v in list(value)[:_ITEMS])), len(value))
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return closure_token(value, depth + 1)
    if isinstance(value, (type, types.ModuleType, nn.Module)) or not hasattr(value, "__dict__"):
        return ("object", type(value).__qualname__, id(value))
    return (type(value).__qualname__, freeze(vars(value), depth + 1))


def closure_token(fn: Any, depth: int = 0) -> Hashable:
    """What a function keeps between calls: its closure cells' contents and its default arguments (a bound method:
    its function's; a callable object: its attributes)."""
    target = getattr(fn, "__func__", fn)
    if not isinstance(target, types.FunctionType):
        return freeze(getattr(fn, "__dict__", None), depth)
    cells = []
    for cell in target.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            cells.append(None)
    return ("function", target.__qualname__, freeze(cells, depth), freeze(target.__defaults__, depth),
            freeze(target.__kwdefaults__, depth))


def _tensor_token(t: Tensor) -> Hashable:
    if t.numel() <= _SMALL and t.device.type == "cpu" and not t.is_sparse:
        return ("tensor", tuple(t.shape), str(t.dtype), tuple(repr(v) for v in t.detach().reshape(-1).tolist()))
    return ("tensor", tuple(t.shape), id(t), t._version)
