"""Caches a module fills on its first forward, put back empty before the first step's replays judge them.

Published models keep tables they build on first use from shapes alone: Lightning's demo ``Transformer`` its causal
mask and positional encoding (``None`` until the first forward), GPT-NeoX-style rotary embeddings their cos/sin
tables with the length cached (``seq_len_cached = 0``), masks by length in a dict, a buffer registered as ``None``, a
``functools.cached_property``. The first step's probe runs the forward and fills them; if the replays of the step's
hooks started from that filled state, none of them would write the cache, and the real step's first write would be
refused at the release as state kept from the batch. Put back empty before the replays
(:meth:`~lightning_dp.validators.step_checks.StepChecks.verify_on`), every replay fills them again and the replays
judge the write like any other before the release (rule 3 of docs/release_boundary.md): alike on all data, a cache
(accepted); set apart by other data, a statistic of the first batch (a normaliser frozen on first use: refused).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

__all__ = ["empty_slots"]


def empty_slots(module: nn.Module) -> list[Callable[[], None]]:
    """What puts back, before the first step's replays, each slot of ``module``'s submodules that is empty now and that
    a first forward may fill from shapes alone: a public attribute that is ``None``, ``0``, ``{}`` or ``[]`` (a causal
    mask, a sequence length cached, a dict of masks by length), a buffer registered as ``None``, a
    ``functools.cached_property`` not computed yet. The probe's passes fill them; put back, every replay fills them
    again and the replays judge the write (alike on all data: a cache; apart: a statistic of the first batch)."""
    puts: list[Callable[[], None]] = []
    for m in module.modules():
        for key, value in list(vars(m).items()):
            if key.startswith("_") or not (value is None or (type(value) is int and value == 0)
                                           or (type(value) in (dict, list) and not value)):
                continue
            puts.append(functools.partial(_put_empty, m, key, value))
        for key, value in m._buffers.items():
            if value is None:
                puts.append(functools.partial(m._buffers.__setitem__, key, None))
        for key in _cached_properties(type(m)):
            if key not in vars(m):
                puts.append(functools.partial(vars(m).pop, key, None))
    return puts


def _put_empty(m: nn.Module, key: str, value: Any) -> None:
    """``m.key`` as it was: ``None`` or 0 again, the same dict or list emptied (filled in place, or rebound)."""
    current = vars(m).get(key, value)
    if type(value) in (dict, list):
        value.clear()
        if current is not value:
            object.__setattr__(m, key, value)
    elif current is not value:
        object.__setattr__(m, key, value)


def _cached_properties(cls: type) -> list[str]:
    return [k for c in cls.__mro__ for k, v in vars(c).items() if isinstance(v, functools.cached_property)]
