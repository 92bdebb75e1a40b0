"""Where a tensor's or a NumPy array's bytes lie, and what owns them.

Several checks ask whether two values share memory — a view of a training tensor is exchanged with it
(:mod:`~lightning_dp.record_checks.outside_records`, :mod:`~lightning_dp.record_checks.copied_rows`), a torch call of a
validation hook is handed a training copy (:mod:`~lightning_dp.validators.validation_reads`), a dataset's memory is
the same data as an earlier fit's (:mod:`~lightning_dp.accounting.data_ledgers`) — and answer with byte ranges:
:func:`memory_span` gives (device, first byte, end) of the elements, or of the whole buffer they live in;
:func:`memory_owner` the object owning that buffer (a tensor's base, an array's root base).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from torch import Tensor

__all__ = ["memory_owner", "memory_span"]

_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or getattr(np, "byte_bounds")


def memory_span(value: Any, whole_storage: bool = False) -> Optional[tuple[str, int, int]]:
    """(device, first byte, end byte) of a tensor's or a NumPy array's elements (strides of either sign), or with
    ``whole_storage`` of the buffer they live in (a tensor's storage, an array's root base); never empty (an empty
    tensor: one element's bytes at its pointer).
    ``None`` for other values and tensors without storage (a sparse or a wrapper subclass)."""
    try:
        if isinstance(value, Tensor):
            if whole_storage:
                storage = value.untyped_storage()
                return str(value.device), storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1)
            offsets = [(n - 1) * st for n, st in zip(value.shape, value.stride()) if n]
            low, high = sum(o for o in offsets if o < 0), sum(o for o in offsets if o > 0) + 1
            size = value.element_size()
            return str(value.device), value.data_ptr() + low * size, value.data_ptr() + high * size
        if isinstance(value, np.ndarray):
            if whole_storage:
                root = memory_owner(value)
                start = root.__array_interface__["data"][0]
                return "cpu", start, start + max(root.nbytes, 1)
            low, high = _byte_bounds(value)
            return "cpu", int(low), int(max(high, low + 1))
    except (RuntimeError, NotImplementedError):
        return None
    return None


def memory_owner(value: Any) -> Any:
    """The object owning the memory of a tensor (its ``_base``, or itself) or a NumPy array (its root base array)."""
    if isinstance(value, Tensor):
        return value._base if value._base is not None else value
    owner = value
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner
