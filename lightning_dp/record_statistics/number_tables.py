"""Numbers kept in Python containers one column at a time, read as the vectors they tabulate.

Tutorial code keeps per-column statistics in the shape it computed them: a dict keyed by column
(``{j: (float(x[:, j].mean()), float(x[:, j].std())) for j in range(d)}``) or by name (``{"age": 38.2, ...}``), a
list of per-column tuples (``[(mean_j, std_j), ...]``) or of dicts (``[{"mean": m, "std": s}, ...]``), a dict of
such dicts. None of them is a tensor, an array or a flat sequence of numbers, so the statistics check
(:mod:`.data_statistics`) would compare only their single entries. :func:`number_columns` reads each as the
vectors it holds — the values in order, and for entries of several numbers each position or key across the
entries — for the check to compare like any held vector (:mod:`.near_statistics` too).

Numbers are Python and NumPy reals (not booleans) and zero-dimensional tensors; a container of more than
:data:`MAX_ENTRIES` entries, or entries of more than :data:`MAX_FIELDS` numbers, is not read. Not seen: tables
nested deeper than one level of entries (a dict of dicts of tuples is read through its inner dicts only where the
walk reaches them as values, :func:`~.data_statistics.held_candidates`).
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
from torch import Tensor

MAX_ENTRIES = 1 << 16
"""The most entries (columns) a container may hold to be read."""

MAX_FIELDS = 8
"""The most numbers one entry (a column's tuple or dict) may hold to be read."""


def number_columns(value: Any) -> list[tuple[str, Tensor]]:
    """(suffix, vector) for each vector ``value`` tabulates (module docstring): ``[*]`` for a dict's values in
    order, ``[*][i]`` and ``[*]['key']`` for each field of its entries; float64 vectors of two entries or more."""
    if isinstance(value, dict):
        entries = list(value.values())
    elif isinstance(value, (list, tuple)):
        entries = list(value)
    else:
        return []
    if not 2 <= len(entries) <= MAX_ENTRIES:
        return []
    flat = [_number(e) for e in entries]
    if all(v is not None for v in flat):  # a dict of numbers (a flat list is a vector already)
        return [("[*]", torch.tensor(flat, dtype=torch.float64))] if isinstance(value, dict) else []
    fields = _fields(entries[0])
    if fields is None:
        return []
    columns: dict[Any, list[float]] = {key: [] for key in fields}
    for entry in entries:
        found = _fields(entry)
        if found is None or list(found) != list(fields):
            return []
        for key, number in found.items():
            columns[key].append(number)
    return [(f"[*][{key!r}]", torch.tensor(numbers_, dtype=torch.float64)) for key, numbers_ in columns.items()]


def _fields(entry: Any) -> Optional[dict[Any, float]]:
    """An entry's numbers by position (a tuple, a list, a 1-D array or tensor) or key (a dict), or ``None``."""
    if not (isinstance(entry, (dict, list, tuple)) or getattr(entry, "ndim", 0) == 1):
        return None
    if not 1 <= len(entry) <= MAX_FIELDS:  # before reading it: a long tensor is never unbound
        return None
    items = list(entry.items()) if isinstance(entry, dict) else list(enumerate(entry))
    out = {key: _number(v) for key, v in items}
    return out if all(v is not None for v in out.values()) else None  # type: ignore[return-value]


def _number(value: Any) -> Optional[float]:
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 and value.dim() == 0 and not value.dtype.is_complex else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        return float(value)
    return None
