"""The Python numbers and strings the user's state holds, given other values while a judged hook runs again.

A hook handed no batch that writes ``add_text("s", f"{self.stat}")`` reads the data through a Python value as well as
through an array: ``self.stat = float(x_train.norm())`` in ``__init__`` or ``setup``, ``int(y.sum())``, the class
counts as a list of ints, a string built from records. The logger judge (:mod:`lightning_dp.validators.logger_judge`)
runs such a hook again with every array of the user's state given other values
(:mod:`lightning_dp.validators.held_values`); :func:`held_numbers` adds the Python values: each attribute of the
given holders (the model and its modules of the user's classes, the datamodule, the user's callbacks, the datasets)
holding a ``float``, an ``int`` (not a ``bool``), a ``str``, or a ``list``, ``tuple`` or ``dict`` of them (to
:data:`DEPTH` levels, :data:`MAX_ITEMS` items), is rebound for the run again to another value of its kind
(:func:`other`; a container: a new one, the original left untouched) and bound back after.

Left as they are — public by construction, their names say so (never by a value alone, which would make writing a
data-derived value depend on its matching a public one):

* an attribute named as a public setting and equal to it: a hyper-parameter saved by ``save_hyperparameters`` (the
  datamodule's too), a setting of the optimizer's parameter groups (``lr``, ``weight_decay``; ``learning_rate``
  for ``lr``); or holding the very object a saved hyper-parameter holds (``self.learning_rate = lr``: not an int,
  whose small values Python shares);
* an int equal to one of the trainer's counters (the step, the epoch, the batches done, each ±1): a step counter the
  user keeps (``self.my_steps += 1`` in ``training_step``: the release boundary's replays found it alike on other
  data, rule 3) is a function of the step, as the trainer's own ``global_step`` is;
* a name declared public (``public_state``: ``"stat"``, ``"encoder.stat"``, ``"MyCallback.stat"``,
  ``"datamodule.stat"``);
* what torch's ``nn.Module`` and Lightning's ``LightningModule`` and ``LightningDataModule`` keep themselves
  (:func:`~lightning_dp.records.library_objects.framework_keys`), objects of library classes (a ``TensorDataset``,
  torch's layers, torchmetrics) and the user's subclasses of a library's callback (a ``ModelCheckpoint``'s
  ``monitor``).

The trainer's and the strategy's own values (the counters, lightning_dp's σ, C and budget) and the optimizer are not
walked: Lightning's and lightning_dp's settings. Not reached: a value held by a plain helper object or deeper than
:data:`DEPTH`, a NumPy scalar, the globals of the user's modules (constants, mostly: a data-derived global number is
not given other values), closures.
"""

from __future__ import annotations

import enum
import math
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Sequence

from torch import nn

from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.records.library_objects import framework_keys, is_library
from lightning_dp.records.library_code import library_type

__all__ = ["DEPTH", "MAX_ITEMS", "HeldNumbers", "held_numbers", "other"]

DEPTH = 3
"""How deep containers of numbers and strings are read (a dict of lists of ints: 2)."""

MAX_ITEMS = 4096
"""Containers with more items are left (a dataset's list of records is the training data's exchange's)."""

_BASES = frozenset({"Callback", "LightningDataModule", "HyperparametersMixin", "DataHooks", "CheckpointHooks",
                    "Dataset", "IterableDataset", "Generic"})
_OWN_KEYS = frozenset({"_hparams", "_hparams_initial", "_hparams_name", "_log_hyperparams"})
_DATAMODULE_KEYS: list[frozenset[str]] = []


class HeldNumbers:
    """Attributes ``(path, owner, name, value)`` holding Python values, for :meth:`exchanged`."""

    def __init__(self, places: Sequence[tuple[str, Any, str, Any]]) -> None:
        self.places = list(places)

    @property
    def names(self) -> list[str]:
        """Where the values are, as ``public_state`` names them (``stat``, ``encoder.stat``, ``MyCallback.stat``,
        ``datamodule.stat``), never the values."""
        return [path for path, _, _, _ in self.places]

    @contextmanager
    def exchanged(self) -> Iterator[None]:
        """Each attribute bound to :func:`other` of its value inside, to its value again on exit."""
        bound: list[tuple[Any, str, Any]] = []
        try:
            for _, owner, name, value in self.places:
                vars(owner)[name] = other(value)
                bound.append((owner, name, value))
            yield
        finally:
            for owner, name, value in reversed(bound):
                vars(owner)[name] = value


def held_numbers(holders: Iterable[tuple[str, Any]], public: Sequence[str] = (),
                 settings: Iterable[Mapping[str, Any]] = (), counters: Iterable[int] = (),
                 skip: Iterable[int] = ()) -> HeldNumbers:
    """The attributes of ``holders`` ((label, object): ``"model"``, ``"datamodule"``, a callback's class name, a
    dataset) holding Python values that are not public (module docstring): ``public``: the declared names;
    ``settings``: the public settings by name (each holder's hyper-parameters, each parameter group); ``counters``:
    the trainer's; ``skip``: ids of values exchanged already (the training data's lists)."""
    named: dict[str, list[Any]] = {}
    for mapping in settings:
        for key, value in list(mapping.items()):
            named.setdefault(str(key), []).append(value)
            if key == "lr":
                named.setdefault("learning_rate", []).append(value)
    shared = {id(v) for values in named.values() for v in values if not isinstance(v, int)}
    counted = {c + d for c in counters for d in (-1, 0, 1)}
    skipped = set(skip)
    places: list[tuple[str, Any, str, Any]] = []
    for label, holder in holders:
        for prefix, owner in _owners(label, holder):
            try:
                items = list(vars(owner).items())
            except TypeError:
                continue
            own = _own_keys(owner)
            for name, value in items:
                path = f"{prefix}{name}"
                if name in own or id(value) in skipped or id(value) in shared or not _plain(value, DEPTH) \
                        or is_public(path, public) \
                        or any(_same(value, s) for s in named.get(name, ())) \
                        or (type(value) is int and value in counted):
                    continue
                places.append((path, owner, name, value))
    return HeldNumbers(places)


def _owners(label: str, holder: Any) -> list[tuple[str, Any]]:
    """(path prefix, object) whose attributes are read: a module's submodules of the user's classes by name; the
    model's without a label."""
    if is_library(holder) or not isinstance(holder, nn.Module) and _library_subclass(holder):
        return []
    base = "" if label == "model" else f"{label}."  # the model's names as public_state names them: "encoder.stat"
    if isinstance(holder, nn.Module):
        return [(f"{base}{name}." if name else base, m) for name, m in holder.named_modules() if not is_library(m)]
    return [(base, holder)]


def _library_subclass(holder: Any) -> bool:
    """A user's subclass of a library's class other than the bases every user class has (``Callback``,
    ``LightningDataModule``, torch's ``Dataset``): its attributes are mostly the library's settings."""
    return any(is_library_class(k) and k.__name__ not in _BASES for k in type(holder).__mro__[1:-1])


def is_library_class(cls: type) -> bool:
    """Whether ``cls`` is defined by a library (:func:`~lightning_dp.records.library_code.library_type`: named in one
    of its packages and written there, not a user's class claiming its ``__module__``)."""
    return library_type(cls)


def _own_keys(owner: Any) -> frozenset[str]:
    if isinstance(owner, nn.Module):
        return framework_keys() | _OWN_KEYS
    if not _DATAMODULE_KEYS:
        import pytorch_lightning as pl

        _DATAMODULE_KEYS.append(frozenset(vars(pl.LightningDataModule())) | _OWN_KEYS)
    return _DATAMODULE_KEYS[0]


def _plain(value: Any, depth: int) -> bool:
    """A number (not a bool, an enum), a string, or a list, tuple or dict holding at least one and nothing else
    than those, bools and ``None``."""
    if _scalar(value):
        return True
    if depth <= 0 or type(value) not in (list, tuple, dict) or not value or len(value) > MAX_ITEMS:
        return False
    items = list(value.values()) if type(value) is dict else list(value)
    if not all(v is None or isinstance(v, bool) or _plain(v, depth - 1) for v in items):
        return False
    return any(not (v is None or isinstance(v, bool)) for v in items)


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, (bool, enum.Enum))


def _same(value: Any, setting: Any) -> bool:
    """Equal and of one kind: numbers (an int saved, a float kept), strings, sequences (a tuple saved, a list
    kept), dicts."""
    try:
        return _kind(value) == _kind(setting) and _kind(value) is not None and bool(value == setting or (
            _kind(value) == "sequence" and list(value) == list(setting)))
    except Exception:  # noqa: BLE001  (not comparable: not the setting)
        return False


def _kind(value: Any) -> Any:
    if isinstance(value, (bool, enum.Enum)):
        return None
    if isinstance(value, (int, float)):
        return "number"
    return "sequence" if type(value) in (list, tuple) else (str if isinstance(value, str) else type(value))


def other(value: Any) -> Any:
    """Another value of ``value``'s kind: a float ``2v + 1`` (``1.0`` for a negative or not finite one), an int
    with its lowest bit flipped, a string reversed and extended; a container of them, a new one; anything else
    (``None``, a bool) as it is."""
    if isinstance(value, (bool, enum.Enum)) or value is None:
        return value
    if isinstance(value, float):
        return 2.0 * value + 1.0 if math.isfinite(value) and value >= 0 else 1.0
    if isinstance(value, int):
        return int(value) ^ 1
    if isinstance(value, str):
        return str(value)[::-1] + "\x00"
    if type(value) is dict:
        return {k: other(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(other(v) for v in value)
    return value

