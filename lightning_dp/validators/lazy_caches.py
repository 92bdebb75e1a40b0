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

A plain ``PrivateStep`` loop has no hooks to replay: :func:`filled_alike` judges such a write there alike, running the
loss function given to ``verify()`` again from the slots put back, on the probe's examples twice, on half of them and
on them exchanged; filled alike, the slots are filled so before the first release (the release compares them as the
step leaves them); set apart, refused.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.fingerprints.fingerprint_entries import moved_by_data
from lightning_dp.fingerprints.state_walker import configuration_object
from lightning_dp.records.fetch import seeded
from lightning_dp.records.library_objects import is_library as _is_library
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads

__all__ = ["Slot", "empty_slots", "filled_alike", "held_objects"]

OBJECT_DEPTH = 2
"""How deep :func:`held_objects` follows objects held by an object's fields (a composite configuration's
``text_config``)."""


def empty_slots(module: nn.Module) -> list["Slot"]:
    """What puts back, before the first step's replays, each slot of ``module``'s submodules that is empty now and that
    a first forward may fill from shapes alone: a public attribute that is ``None``, ``0``, ``{}`` or ``[]`` (a causal
    mask, a sequence length cached, a dict of masks by length), a buffer registered as ``None``, a
    ``functools.cached_property`` not computed yet; and a public field that is ``None`` of an object a submodule holds
    (:func:`held_objects`: Hugging Face's ``config.problem_type``). The probe's passes fill them; put back, every
    replay fills them again and the replays judge the write (alike on all data: a cache; apart: a statistic of the
    first batch). Each is called to put its slot back; :meth:`Slot.taken` keeps what fills it now."""
    slots: list[Slot] = []
    for obj in held_objects(module):
        slots += [Slot(vars(obj), key, None) for key, value in list(vars(obj).items())
                  if value is None and not key.startswith("_")]
    for m in module.modules():
        for key, value in list(vars(m).items()):
            if key.startswith("_") or not (value is None or (type(value) is int and value == 0)
                                           or (type(value) in (dict, list) and not value)):
                continue
            slots.append(Slot(vars(m), key, value))
        slots += [Slot(m._buffers, key, None) for key, value in m._buffers.items() if value is None]
        slots += [Slot(vars(m), key, _UNSET) for key in _cached_properties(type(m)) if key not in vars(m)]
    return slots


_UNSET = object()
"""A ``functools.cached_property`` not computed: no entry in the instance's ``__dict__``."""


class Slot:
    """One empty slot (:func:`empty_slots`): the dict holding it (an object's ``__dict__``, a module's ``_buffers``),
    its key and its empty value (the same empty dict or list, filled in place or rebound; :data:`_UNSET`: no entry)."""

    def __init__(self, holder: dict, key: str, empty: Any) -> None:
        self.holder, self.key, self.empty = holder, key, empty

    def __call__(self) -> None:
        """Put the slot back as it was."""
        if self.empty is _UNSET:
            self.holder.pop(self.key, None)
            return
        if type(self.empty) in (dict, list):
            self.empty.clear()
        if self.holder.get(self.key, self.empty) is not self.empty:
            self.holder[self.key] = self.empty

    def taken(self) -> Callable[[], None]:
        """What fills the slot again as it is now (a plain loop keeps a cache every data fills alike)."""
        value = self.holder.get(self.key, _UNSET)
        contents = copy.copy(value) if value is self.empty and type(value) in (dict, list) else None

        def fill() -> None:
            self()
            if contents is not None:
                self.empty.update(contents) if type(contents) is dict else self.empty.extend(contents)
            elif value is not _UNSET:
                self.holder[self.key] = value
        return fill


def filled_alike(slots: Sequence[Slot], fingerprint: Any, before: Any, written: Sequence[str],
                 runs: Sequence[Callable[[], Any]],
                 refuse: Callable[[list[str]], Exception]) -> list[Callable[[], None]]:
    """A plain loop's judgement of what the first step's probe wrote to kept state (no hooks to replay there:
    :meth:`~.step_checks.StepChecks.verify_on`), as the Lightning path's replays judge it. A write in ``written`` that
    putting the ``slots`` back does not undo (a counter, a running statistic) is refused (``refuse``). The loss then
    runs again from the slots put back, each time from the same seed (``runs``: on the probe's examples twice, then on
    other data: half of them, them exchanged; a run other data makes fail, exchanged ids out of a vocabulary, is not
    compared): a written entry another data sets apart and the second run on the same data does not
    (:func:`~.fingerprints.fingerprint_entries.moved_by_data`) is the data's, refused. Returns what fills the slots as
    the first run left them (alike on all data): the caller fills them once the probe's traces are put back, as the
    first step will fill them, so that its release finds them as they are."""
    written = list(written)
    for slot in slots:
        slot()
    kept = [name for name in fingerprint.changed(before, fingerprint.take(full=True)) if name in written]
    if kept:
        raise refuse(kept)
    taken: list[Any] = []
    fills: list[Callable[[], None]] = []
    clock, draws = ClockReads(), DrawReads()  # the first run's clock values and draws, read by the others
    for i, run in enumerate(runs):
        for slot in slots:
            slot()
        try:
            with seeded(0), clock.next_run(), draws.next_run():
                run()
        except Exception as err:  # noqa: BLE001  (other values the step cannot take: that run is not compared)
            if i < 2:  # the examples the probe ran on: not judged, refused as written
                raise refuse(written) from err
            continue
        taken.append(fingerprint.take(full=True))
        fills = fills or [slot.taken() for slot in slots]
    for slot in slots:
        slot()
    apart = {name for other in taken[2:] for name in moved_by_data(taken[0], taken[1], other)}
    if len(taken) < 3 or apart & set(written):
        raise refuse([name for name in written if name in apart] or written)
    return fills


def held_objects(module: nn.Module) -> list[Any]:
    """The objects whose public fields the fingerprint reads (:class:`~.state_walker.Walker`) held by a public
    attribute of ``module`` or a submodule, each once: a library's configuration object (Hugging Face's
    ``model.config``, a dataclass: :func:`~.state_walker.configuration_object`) or a plain object of the user's (not a
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
    return configuration_object(value) if _is_library(value) else True


_NOT_PLAIN = (type, nn.Module, Tensor, Dataset, types.ModuleType, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, functools.partial)


def _cached_properties(cls: type) -> list[str]:
    return [k for c in cls.__mro__ for k, v in vars(c).items() if isinstance(v, functools.cached_property)]
