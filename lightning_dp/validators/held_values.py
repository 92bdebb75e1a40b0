"""Everything the user's state holds besides the released state, given other values for a judged hook's run again.

A hook handed no batch (:mod:`.logger_judge`) can read the private data through any array computed from it and
held anywhere: the datamodule's standardised copy, the norms of the records on the model, the validation set that is
the training set in float64, a dataset's cache filled as records are fetched, a copy kept on the trainer. The
exchange of the training data's copies (:meth:`~.step_checks.StepChecks.exchanged_training_data`) finds copies of
the records only, not what was derived from them, so the run again exchanges :func:`other_values` too: every tensor
and NumPy array (:func:`~lightning_dp.record_checks.holders.held_arrays`) held by the model (its buffers and its
modules' attributes, never
its parameters), the datamodule, the user's callbacks, the trainer's and the strategy's public attributes that are
not Lightning's or lightning_dp's objects, the validation and test loaders' datasets, the training dataset (its
caches) and the globals of the user's modules, and the lists of floats their attributes hold (one level down) — in
place, restored after (:func:`~lightning_dp.record_checks.outside_records.exchange`: the tensors' version counters
stay). The Python numbers
and strings (and lists, tuples, dicts of them) of the model, the datamodule, the user's callbacks and the datasets
are given other values too (:func:`numbers_held`, :mod:`lightning_dp.fingerprints.held_numbers`: ``self.stat =
float(x.norm())``, class counts as a list of ints, a string of records), except what is public by its name: the
saved hyper-parameters, the optimizers' parameter-group settings, an int in step with the trainer's counters, the
names declared public; the trainer's and the strategy's own values are not walked for them. The released state
(parameters, their ``.grad``, the optimizers' state) and what the exchange of the training data covers already (a
view of it is not flipped twice) are left. A call the run again reproduces is then a function of the released
state, the step, the seeds, constants and the public settings.

:func:`user_generators` gives the states of the generators the user holds (``torch.Generator`` as
:func:`lightning_dp.records.user_generators.held` finds them, and torch's, NumPy's and Python's generators held by
the model's modules and the callbacks, directly or in a list, tuple or dict), so
that the run again draws a held generator's prior samples as the hook drew them.
"""

from __future__ import annotations

import random
import types
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_dp.fingerprints.held_numbers import HeldNumbers, held_numbers
from lightning_dp.records import user_generators as torch_generators
from lightning_dp.records.library_objects import is_library, library_callback
from lightning_dp.record_checks.holders import RowItems, held_arrays
from lightning_dp.record_checks.outside_records import ExchangedRecords, _Memory, exchangeable

__all__ = ["derived_from_released", "numbers_held", "other_values", "tensors_held", "user_generators"]

_DERIVED: dict[int, tuple["weakref.ref[Tensor]", int]] = {}
"""Tensors a judged hook wrote whose values its run again reproduced (:func:`derived_from_released`), by identity,
with their version counter then: left as they are while they hold those values."""

_NOT_USERS = frozenset({"callbacks", "datamodule", "lr_scheduler_configs"})
"""Public attributes of the trainer and the strategy that are Lightning's own (walked elsewhere or not at all)."""


def other_values(trainer: Any, dataset: Any, modules: Iterable[types.ModuleType], exchanged: Iterable[Any],
                 released: Iterable[Tensor]) -> ExchangedRecords:
    """The arrays the user's state holds (module docstring), for
    :meth:`~lightning_dp.record_checks.outside_records.ExchangedRecords.exchanged`;
    ``exchanged``: the training data's copies exchanged already; ``released``: the released tensors, left."""
    memory = _Memory()
    for value in exchanged:
        memory.add(value, whole_storage=isinstance(value, Tensor))
    skip = {id(t) for t in released}
    found: list[tuple[str, Any]] = []
    for path, value in held_arrays(_holders(trainer, dataset, modules)):
        if isinstance(value, RowItems):
            value = memory.outside(RowItems([a for a in value.arrays if id(a) not in skip]))
            if not value.arrays:
                continue
        elif id(value) in skip or _derived(value) or memory.overlaps(value):
            continue
        memory.add(value)
        found.append((path, value))
    return ExchangedRecords(found + _float_lists(_holders(trainer, dataset, modules), skip, memory),
                            fixed_integers=True)  # stored labels and predictions stay in range (indexed with)


def _float_lists(holders: list[tuple[str, Any]], skip: set[int], memory: _Memory) -> list[tuple[str, Any]]:
    """Lists of floats (``x.norm(dim=1).tolist()``) the holders' attributes, their modules' and their dicts' values
    hold, one level down; not the training data's own (exchanged already)."""
    owners: list[Any] = []
    for _, holder in holders:
        owners.extend(holder.modules() if isinstance(holder, nn.Module) else [holder])
    found: list[tuple[str, Any]] = []
    seen = set(skip)
    for owner in owners:
        try:
            values = list(vars(owner).values())
        except TypeError:
            continue
        values += [v for d in values if isinstance(d, dict) for v in list(d.values())]
        for value in values:
            if type(value) is list and value and isinstance(value[0], float) and id(value) not in seen \
                    and id(value) not in memory._items and exchangeable(value):
                seen.add(id(value))
                found.append((f"a list of {type(owner).__name__}", value))
    return found


def numbers_held(trainer: Any, dataset: Any, public: Iterable[str], skip: Iterable[Any] = ()) -> HeldNumbers:
    """The Python numbers and strings of the model, the datamodule, the user's callbacks and the datasets
    (:func:`~lightning_dp.fingerprints.held_numbers.held_numbers`) that are not public: the names declared
    (``public``), the saved hyper-parameters, the optimizers' parameter-group settings, the trainer's counters;
    ``skip``: what the exchange of the training data and :func:`other_values` cover already."""
    holders = [h for h in _holders(trainer, dataset, ()) if h[0] not in ("trainer", "strategy")]
    settings = [vars(h).get("_hparams") if hasattr(h, "__dict__") else None for _, h in holders]  # saved ones
    settings += [g for o in getattr(trainer, "optimizers", None) or () for g in getattr(o, "param_groups", ())]
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    done = getattr(getattr(getattr(loop, "batch_progress", None), "total", None), "completed", None)
    counters = [c for c in (getattr(trainer, "global_step", None), getattr(trainer, "current_epoch", None), done)
                if type(c) is int]
    return held_numbers(holders, tuple(public), [m for m in settings if isinstance(m, dict)], counters,
                        {id(v) for v in skip})


def tensors_held(trainer: Any, dataset: Any, modules: Iterable[types.ModuleType]) -> dict[str, Tensor]:
    """(path, tensor) of the tensors :func:`other_values` walks, now."""
    arrays = held_arrays(_holders(trainer, dataset, modules))
    return {path: value for path, value in arrays if isinstance(value, Tensor)}


def derived_from_released(tensors: Iterable[Tensor]) -> None:
    """``tensors`` (written by a judged hook, reproduced by its run again on other values) are functions of the
    released state: later runs again leave them while their version counter stays (the previous epoch's weights kept
    by ``on_train_epoch_start`` for the epoch's weight change)."""
    for dead in [key for key, (ref, _) in _DERIVED.items() if ref() is None]:
        del _DERIVED[dead]
    for t in tensors:
        _DERIVED[id(t)] = (weakref.ref(t), t._version)


def _derived(value: Any) -> bool:
    entry = _DERIVED.get(id(value))
    return entry is not None and entry[0]() is value and value._version == entry[1]


def _holders(trainer: Any, dataset: Any, modules: Iterable[types.ModuleType]) -> list[tuple[str, Any]]:
    holders: list[tuple[str, Any]] = [("model", trainer.lightning_module)]
    if getattr(trainer, "datamodule", None) is not None:
        holders.append(("datamodule", trainer.datamodule))
    holders.extend((type(cb).__name__, cb) for cb in trainer.callbacks if not library_callback(cb))
    for label, owner in (("trainer", trainer), ("strategy", trainer.strategy)):
        added = {k: v for k, v in vars(owner).items() if not k.startswith("_") and k not in _NOT_USERS
                 and (isinstance(v, (Tensor, np.ndarray)) or not is_library(v))}
        holders.append((label, types.SimpleNamespace(**added)))
    for label in ("val_dataloaders", "test_dataloaders"):
        try:
            loaders = getattr(trainer, label)
        except Exception:  # noqa: BLE001  (not set up in this fit)
            continue
        holders.extend((label, d) for d in _datasets(loaders))
    if dataset is not None:
        holders.append(("the training dataset", dataset))
    holders.extend((m.__name__, m) for m in modules)
    return holders


def _datasets(loaders: Any) -> list[Any]:
    if isinstance(loaders, DataLoader):
        return [loaders.dataset]
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [d for loader in loaders for d in _datasets(loader)]
    return []


_RANDOM = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def user_generators(roots: Iterable[Any]) -> Callable[[], None]:
    """The states now of the generators the user holds (module docstring) under ``roots`` (the model, the callbacks);
    returns the function that sets them again."""
    torch_states = torch_generators.states()
    held: list[tuple[Any, Any]] = []
    for root in roots:
        owners = list(root.modules()) if hasattr(root, "modules") and callable(root.modules) else [root]
        for owner in owners:
            values = list(vars(owner).values()) if hasattr(owner, "__dict__") else []
            for value in values + [v for c in values if isinstance(c, (list, tuple)) for v in c] + \
                    [v for c in values if isinstance(c, dict) for v in c.values()]:
                if isinstance(value, _RANDOM):
                    held.append((value, _state(value)))

    def put_back() -> None:
        torch_generators.restore(torch_states)
        for generator, state in held:
            _set_state(generator, state)
    return put_back


def _state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    return generator.getstate()


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)
