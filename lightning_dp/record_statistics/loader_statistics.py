"""Where the training loader and its datasets keep transforms, as holders for the statistics check (rule 11,
:mod:`.data_statistics`): a collate object normalising each batch with the training data's mean and standard
deviation (``Collate(mean=x.mean(0), std=x.std(0))``), a ``functools.partial(collate, mean=..., std=...)``, a
sampler or ``worker_init_fn`` holding a statistic, and a ``Normalize``-like transform on a dataset with fitted
statistics, also inside a ``Compose``-like list of transforms. Each such statistic is applied to every batch: it
depends on every training record and no noise covers it.

The objects are walked from the loader's ``collate_fn``, ``sampler``, ``batch_sampler`` and ``worker_init_fn`` and
from the datasets' attributes and their classes' (``class DS(Dataset): mean = x.mean(0)``), three levels deep into
partials (their arguments and keywords), the user's functions (the variables their closures hold, their defaults: a
collate or a transform made by ``make(mean, std)``), bound methods (their object), objects of the user's or a
library's classes (modules included: a transform may be one; with the attributes of the user's classes) and lists,
tuples and dicts of at most 16 of them; datasets, tensors and torch's own objects are not walked into (the datasets
are the statistics check's own). Each object reached is a holder whose numbers
:func:`~.data_statistics.data_statistics_held` compares, with the same exemptions: a public constant (ImageNet's
0.485, 0.229) is no statistic of this data, and a single round number (``scale = 255.0``) is never matched (the records
a global holds are compared when the items read them: :mod:`.read_records`). Not seen: a statistic deeper than the
walk.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from types import FunctionType, MethodType, SimpleNamespace
from typing import Any, Iterator, Sequence

from torch import Tensor
from torch.utils.data import Dataset
from lightning_dp.records.library_code import installed_class, library_rooted, users_code


_LOADER_PARTS = ("collate_fn", "sampler", "batch_sampler", "worker_init_fn")
_LIBRARIES = ("torch", "pytorch_lightning", "lightning", "builtins", "typing", "abc", "functools")
_MAX_OWNERS = 256
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} |
                   {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))})


def transform_holders(loader: Any, datasets: Sequence[Any]) -> list[tuple[str, Any]]:
    """(label, object) for each object the ``loader``'s parts and the ``datasets``' attributes hold, walked as the
    module docstring says."""
    seen = {id(d) for d in datasets}
    out: list[tuple[str, Any]] = []
    roots = [(f"loader.{name}", getattr(loader, name, None)) for name in _LOADER_PARTS] + \
        [(f"dataset {type(d).__name__}.{k}", v) for d in datasets for k, v in _items(d)] + \
        [(f"dataset {type(d).__name__}", _class_values(d)) for d in datasets]
    for label, value in roots:
        for held in _walk(label, value, 0, seen):
            if len(out) >= _MAX_OWNERS:
                return out
            out.append(held)
    return out


def _walk(label: str, value: Any, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if value is None or depth > 3 or id(value) in seen or isinstance(value, (Tensor, Dataset, type, str, bytes)) \
            or (isinstance(value, SimpleNamespace) and not vars(value)):
        return
    seen.add(id(value))
    if isinstance(value, functools.partial):  # its arguments as attributes: partial(collate, mean=..., std=...)
        arguments = {**{f"args[{i}]": a for i, a in enumerate(value.args)}, **value.keywords}
        yield label, SimpleNamespace(**arguments)
        yield from _walk(f"{label}.func", value.func, depth + 1, seen)
        for key, item in arguments.items():
            yield from _walk(f"{label}.{key}", item, depth + 1, seen)
    elif isinstance(value, FunctionType):  # a closure's variables and the defaults: make_collate(mean, std)
        if not _users(value.__module__) and not users_code(value):
            return
        cells = zip(value.__code__.co_freevars, value.__closure__ or ())
        held = {**{name: _contents(cell) for name, cell in cells},
                **{f"defaults[{i}]": d for i, d in enumerate(value.__defaults__ or ())}, **(value.__kwdefaults__ or {})}
        yield label, SimpleNamespace(**held)
        for key, item in held.items():
            yield from _walk(f"{label}.{key}", item, depth + 1, seen)
    elif isinstance(value, MethodType):  # a bound method: its object (collate_fn=stats.apply)
        yield from _walk(label, value.__self__, depth, seen)
    elif isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        if len(value) <= 16:
            for key, item in items:
                yield from _walk(f"{label}[{key!r}]", item, depth + 1, seen)
    elif hasattr(value, "__dict__") and not library_rooted(type(value), _LIBRARIES):
        yield label, value
        for key, item in _items(value):
            yield from _walk(f"{label}.{key}", item, depth + 1, seen)
        if not isinstance(value, SimpleNamespace):
            yield from _walk(label, _class_values(value), depth + 1, seen)


def _library(module: object) -> bool:
    return str(module or "").split(".")[0] in _LIBRARIES


def _users(module: object) -> bool:
    """Whether ``module`` is the user's code, not the standard library's or an installed package's (whose defaults
    are their own constants)."""
    where = str(getattr(sys.modules.get(str(module)), "__file__", None) or "")
    return not _library(module) and not (where and where.startswith(_INSTALLED))


def _class_values(owner: Any) -> SimpleNamespace:
    """The attributes ``owner``'s own classes (the user's code: not an installed package's) define: values, and the
    functions (their closures and defaults may hold one: a class made inside ``make(x)``), special methods included
    (``__getitem__``, as ``getitem()``) where they have a closure or defaults."""
    values: dict[str, Any] = {}
    for cls in reversed(type(owner).__mro__):
        if not _users(cls.__module__) and installed_class(cls):
            continue
        for key, value in vars(cls).items():
            value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(value, (property, type)):
                continue
            if key.startswith("__"):
                if isinstance(value, FunctionType) and \
                        (value.__closure__ or value.__defaults__ or value.__kwdefaults__):
                    values[f"{key.strip('_')}()"] = value
            else:
                values[key] = value
    return SimpleNamespace(**values)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _items(owner: Any) -> list[tuple[str, Any]]:
    try:
        return [(k, v) for k, v in vars(owner).items() if isinstance(k, str) and not k.startswith("__")]
    except TypeError:
        return []
