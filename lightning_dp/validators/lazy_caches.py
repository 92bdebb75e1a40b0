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

So are the fields a first forward sets on an object the model holds (:func:`held_objects`): Hugging Face's
``*ForSequenceClassification`` and ``ViTForImageClassification`` set ``config.problem_type`` (``None`` until then) on
their first forward with ``labels=``, from ``num_labels`` and the labels' dtype — alike on every batch. A field that is
``None`` before the first step, of a library's configuration object (a ``PretrainedConfig``, a dataclass) or of a
plain object of the user's, is put back to ``None`` before the replays like a module's own lazy cache: set alike by
every replay, it trains; set apart by the replays on other data (a ``problem_type`` chosen from the labels' values, a
threshold from the loss), it is refused before any release.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Iterator

from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.fingerprints.state_walker import _configuration_object
from lightning_dp.records.library_objects import is_library as _is_library

__all__ = ["empty_slots", "held_objects"]

OBJECT_DEPTH = 2
"""How deep :func:`held_objects` follows objects held by an object's fields (a composite configuration's
``text_config``)."""


def empty_slots(module: nn.Module) -> list[Callable[[], None]]:
    """What puts back, before the first step's replays, each slot of ``module``'s submodules that is empty now and that
    a first forward may fill from shapes alone: a public attribute that is ``None``, ``0``, ``{}`` or ``[]`` (a causal
    mask, a sequence length cached, a dict of masks by length), a buffer registered as ``None``, a
    ``functools.cached_property`` not computed yet; and a public field that is ``None`` of an object a submodule holds
    (:func:`held_objects`: Hugging Face's ``config.problem_type``). The probe's passes fill them; put back, every
    replay fills them again and the replays judge the write (alike on all data: a cache; apart: a statistic of the
    first batch)."""
    puts: list[Callable[[], None]] = []
    for obj in held_objects(module):
        for key, value in list(vars(obj).items()):
            if value is None and not key.startswith("_"):
                puts.append(functools.partial(vars(obj).__setitem__, key, None))
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


def held_objects(module: nn.Module) -> list[Any]:
    """The objects whose public fields the fingerprint reads (:class:`~.state_walker._Walker`) held by a public
    attribute of ``module`` or a submodule, each once: a library's configuration object (Hugging Face's
    ``model.config``, a dataclass: :func:`~.state_walker._configuration_object`) or a plain object of the user's (not a
    module, tensor, dataset, class or function), and those held by their fields in turn (to :data:`OBJECT_DEPTH`). A
    library's other objects are compared by identity only: a field set on them is not seen, and needs no putting
    back."""
    seen: set[int] = set()
    found: list[Any] = []

    def visit(values: Iterator[tuple[str, Any]], depth: int) -> None:
        for key, value in values:
            if key.startswith("_") or id(value) in seen or not _fielded(value):
                continue
            seen.add(id(value))
            found.append(value)
            if depth < OBJECT_DEPTH:
                visit(iter(list(vars(value).items())), depth + 1)

    for m in module.modules():
        visit(iter(list(vars(m).items())), 1)
    return found


def _fielded(value: Any) -> bool:
    """Whether the fingerprint reads ``value``'s fields: a configuration object, or a plain object of the user's."""
    if not hasattr(value, "__dict__") or isinstance(value, _NOT_PLAIN):
        return False
    return _configuration_object(value) if _is_library(value) else True


_NOT_PLAIN = (type, nn.Module, Tensor, Dataset, types.ModuleType, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, functools.partial)


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
