"""A fetch's write judged by running the fetch again: the state it writes must not be a function of the records.

A dataset's transform that counts its calls, caches the interpolation grid for the image size every record shares,
or keeps the parameters of its last random draw (an albumentations-like ``self.params``) writes at every fetch, as a
running mean of the records does. What tells them apart is what the written state is a function of. When a fetch
wrote state that no other rule allows (:class:`~lightning_dp.records.stateless.FetchState`), the fetch is run three
more times, each from the state as it was before it (:class:`Kept`, noted before every fetch) and each with the
global generators as the fetch had them (:class:`~lightning_dp.replays.starting_state.Generators`, noted with it;
the loader's per-record seeds, :class:`~.fresh_randomness.FreshIndices`, by position; a library read seeded by index
reads the other records with the same records' seeds):

* on the same records (the *plain* rerun);
* on the same records **exchanged** in memory (the training data's tensors, arrays and lists flipped in place,
  :func:`~lightning_dp.record_checks.outside_records.exchange`, handed in by the strategy; not in a DataLoader worker,
  whose pages the flip would copy, nor over 64 MiB of records): a statistic of the values, a count of the records
  whose label is 1, a copy of the last record's values come out otherwise;
* on **other records**, as many (each index moved by half the dataset's length): what only a record's shape or
  index sets — a size cache over records of different sizes, the last index read — comes out otherwise too (the
  exchange keeps every shape).

The values written at the judged paths are frozen after each rerun (tensors and arrays copied, containers and the
user's objects walked, :func:`frozen`) and compared: the write is allowed when all three agree and, the fetch's
records known (the loader's batch in the process that fetched it, a library read), the plain rerun wrote what the
fetch wrote (a write a draw triggers is repeated, not missed); refused as before otherwise, and when any rerun cannot
be judged (a path under a container too large to keep or an object without a
``__dict__``, a module's global, a rerun that raises, a frozen value beyond :data:`MAX_FROZEN` items; a tensor or
array updated in place is not put back between the reruns, so they differ). An exchanged rerun that raises (records
held as file names no longer open) is left out: the other two still must agree. Everything reachable from the
dataset and the collate object is put back as the fetch left it afterwards (:func:`reached`), and the generators
are restored.

The kept-state fingerprint (:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_settings`) leaves to this
module an attribute holding a value such a fetch wrote (:func:`fetch_written`: one of those written by the loader's
last batch and the library's reads since, which the library's checks may put back); any other value there (a hook's
write) is its to judge.

Not seen: a write that all three reruns make alike yet depends on the data (a flag set by a NaN, which the
exchange keeps, present in both index sets); in a DataLoader worker without per-record seeds (a ``TensorDataset``
with a collate object of the user's), whose batch's indices are not known there, as many other records stand for
them and a write a draw triggers may not be repeated. A write a generator the dataset holds itself drives is not
repeated (its state is not put back): refused. Cost: three more fetches of the batch, only for a batch whose fetch
wrote state.
"""

from __future__ import annotations

import functools
import types
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import numpy as np
from torch import Tensor

from lightning_dp.records.library_code import library_named
from lightning_dp.containers import held_items, put_back
from lightning_dp.records.identity import IdentityMap, Same
from lightning_dp.records.values import same_array_values, same_tensor_values

KEPT_ITEMS = 4_096
"""Items of a list, dict or set kept before each fetch at most (a larger container is not kept: a write under it is
not judged)."""

MAX_FROZEN = 1 << 20
"""Elements and items frozen per judged path at most (beyond: not judged)."""

Exchange = Callable[[Any], Optional[AbstractContextManager]]
"""``exchange(dataset)``: a context inside which the dataset's records in memory hold other values, or ``None`` (no
exchanged rerun: in a DataLoader worker, or records too large to flip at every judged fetch)."""


class Unjudged(Exception):
    """A rerun or a value that cannot be judged: the write is refused as before."""


class Kept:
    """The mutable state of a digest's objects (path → container or object), kept to be put back: each object's
    attributes (a shallow copy of its ``__dict__``) and each list's, dict's and set's items."""

    def __init__(self, objects: dict[str, Any]) -> None:
        self.saved: dict[str, Optional[tuple[Any, Any]]] = {}
        for path, obj in objects.items():
            self.saved[path] = _keep(obj)

    def covers(self, path: str) -> bool:
        """Whether an object above ``path`` was kept (not a module's global) and each one kept can be put back."""
        present = [self.saved[a] for a in _ancestors(path) if a in self.saved]
        return bool(present) and all(held is not None for held in present)

    def restore(self) -> None:
        """Every kept object's state put back in place."""
        for held in self.saved.values():
            if held is not None:
                _put_back(*held)


def _keep(obj: Any) -> Optional[tuple[Any, Any]]:
    """(``obj``, its state to put back), or ``None`` when it cannot be kept (a container over :data:`KEPT_ITEMS`)."""
    if isinstance(obj, (list, dict, set)) or type(obj).__name__ == "deque":
        return (obj, _state(obj)) if len(obj) <= KEPT_ITEMS else None
    return (obj, _state(obj))  # a tuple or an object without a __dict__: nothing in it is written in place


def _put_back(obj: Any, saved: Any) -> None:
    if saved is None:
        return
    if isinstance(obj, (list, dict, set)) or type(obj).__name__ == "deque":
        put_back(obj, saved)
    else:
        fields = vars(obj)
        fields.clear()
        fields.update(saved)


def _ancestors(path: str) -> list[str]:
    return [path[:i] for i, c in enumerate(path) if c in ".["] + [path]


def frozen(value: Any, budget: Optional[list[int]] = None, depth: int = 0) -> Any:
    """``value`` as it is now, to compare after other code ran: tensors and arrays copied, lists, tuples, dicts and the
    attributes of objects walked (an object without ``__dict__`` held by identity); :class:`Unjudged` beyond
    :data:`MAX_FROZEN` items or eight levels."""
    budget = [MAX_FROZEN] if budget is None else budget
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    budget[0] -= value.numel() if isinstance(value, Tensor) else value.size if isinstance(value, np.ndarray) else 1
    if budget[0] < 0 or depth > 8:
        raise Unjudged
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (np.ndarray, np.generic)):
        return np.array(value, copy=True)
    if isinstance(value, dict):
        return ("dict", [(frozen(k, budget, depth + 1), frozen(v, budget, depth + 1)) for k, v in value.items()])
    if isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, [frozen(v, budget, depth + 1) for v in items])
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(value, type):
        return ("object", type(value).__name__, frozen(fields, budget, depth + 1))
    return Same(value)


def alike(a: Any, b: Any) -> bool:
    """Whether two :func:`frozen` values are the same (NaNs in the same places equal)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and same_tensor_values(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape \
            and a.dtype == b.dtype and same_array_values(a, b)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and bool(a == b)


WRITTEN: IdentityMap[dict[str, list[Any]]] = IdentityMap()
"""An object → its attributes fetches wrote that the reruns judged alike on any records: name → the values written
(:func:`frozen`) by the loader's last batch and the library's reads since (:data:`RECENT` at most)."""

RECENT = 64
"""Values kept per attribute (the library's reads between two of the loader's batches: the checks' own)."""


def note_written(owner: Any, name: str, value: Any, batch: bool) -> None:
    """``owner.name`` was written by a fetch as ``value``, alike on any records; ``batch``: by the loader's batch
    (the values of earlier fetches dropped), else by a library read."""
    try:
        kept = frozen(value)
        held = WRITTEN.get(owner)
        if held is None:
            held = WRITTEN[owner] = {}
    except (Unjudged, TypeError):
        return
    values = held[name] = [] if batch else held.get(name, [])[-RECENT + 1:]
    values.append(kept)


def fetch_written(owner: Any, name: str, value: Any) -> bool:
    """Whether ``owner.name`` holds a value a watched fetch wrote there since the loader's last batch (the checks'
    reads put back after them included), a write the reruns judged alike on any records (module docstring): the
    fetch's, not a hook's (the kept-state fingerprint leaves it to this module)."""
    held = WRITTEN.get(owner)
    if held is None or name not in held:
        return False
    try:
        now = frozen(value)
    except Unjudged:
        return False
    return any(alike(kept, now) for kept in held[name])


def other_indices(indices: list[int], n: int) -> list[int]:
    """As many indices as ``indices``, each moved by half of ``n`` (other records, when ``n`` > 1)."""
    shift = max(1, n // 2)
    return [(int(i) + shift) % n for i in indices]


def judge(paths: list[str], pre: Kept, plain: Callable[[], Any], other: Callable[[], Any],
          values: Callable[[list[str]], list[Any]], exchange: Optional[Exchange], dataset: Any,
          start: Callable[[], None], real: Optional[list[Any]]) -> list[str]:
    """The ``paths`` whose values differ between the reruns (module docstring): each starts from ``pre`` and
    ``start()`` (the generators as the fetch had them); ``plain()`` fetches the same records again (then with them
    exchanged), ``other()`` as many other records, seeded alike; ``values(paths)`` freezes the values at ``paths``
    now; ``real``: the values the fetch itself wrote, which the plain rerun must write (``None``: its records
    unknown). All ``paths`` when one cannot be judged. The caller puts back the state the fetch left and the
    generators."""
    if not all(pre.covers(p) for p in paths):
        return paths
    runs: list[list[Any]] = []
    for read, exchanged in [(plain, False), (plain, True), (other, False)]:
        try:
            context = nullcontext() if not exchanged else exchange(dataset) if exchange is not None else None
            if context is None:
                continue
            pre.restore()
            start()
            with context:
                read()
                runs.append(values(paths))
        except Unjudged:
            return paths
        except Exception:  # noqa: BLE001 — a rerun that fails is not allowed on trust; an exchanged one is left out
            if not exchanged:
                return paths
    if real is not None and not all(alike(a, b) for a, b in zip(real, runs[0])):
        return paths  # the plain rerun did not write what the fetch wrote (a draw the reruns did not repeat)
    first = runs[0]
    return [p for k, p in enumerate(paths) if not all(alike(first[k], run[k]) for run in runs[1:])]


MAX_REACHED = 100_000
"""Objects and containers :func:`reached` keeps at most (beyond: the write is not judged)."""

_LEAVES = (type(None), bool, int, float, complex, str, bytes, Tensor, np.ndarray, np.generic, type,
           types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def reached(roots: list[Any]) -> Optional[Kept]:
    """Every list, dict, set and object reachable from ``roots`` kept, whatever its size or depth (what the reruns
    write anywhere is put back, a cache the exchanged rerun filled included), or ``None`` beyond
    :data:`MAX_REACHED`."""
    found: dict[str, Any] = {}
    stack = list(roots)
    while stack:
        value = stack.pop()
        key = str(id(value))
        if isinstance(value, types.FunctionType) and key not in found:  # a transform's closure: what its cells hold
            found[key] = value
            stack.extend(c.cell_contents for c in value.__closure__ or () if _filled(c))
            continue
        if isinstance(value, types.MethodType):  # a bound method's object
            stack.append(value.__self__)
            continue
        if isinstance(value, functools.partial):
            stack.extend((value.func, *value.args, *value.keywords.values()))
        if key in found or isinstance(value, _LEAVES) or library_named(type(value), ("random", "numpy.random")):
            continue
        found[key] = value
        if len(found) > MAX_REACHED:
            return None
        if isinstance(value, (dict, list, tuple, set, frozenset)) or type(value).__name__ == "deque":
            items = value.values() if isinstance(value, dict) else value
            if len(value) <= KEPT_ITEMS or not isinstance(next(iter(items)), _LEAVES):
                stack.extend(items)  # a long list of leaves (file names, labels): its copy is enough
        else:
            fields = getattr(value, "__dict__", None)
            if isinstance(fields, dict):
                stack.extend(fields.values())
    kept = Kept({})
    kept.saved = {key: (obj, _state(obj)) for key, obj in found.items()}
    return kept


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _state(obj: Any) -> Any:
    if isinstance(obj, (list, dict, set)) or type(obj).__name__ == "deque":
        return held_items(obj)
    fields = getattr(obj, "__dict__", None)
    return dict(fields) if isinstance(fields, dict) else None
