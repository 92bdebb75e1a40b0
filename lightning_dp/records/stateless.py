"""A fetch is stateless: reading records must not leave state that shapes later records.

A dataset's ``__getitem__`` or a collate object that collects the first K records or batches it is handed, then
freezes a mean and deviation and normalises every later record with it ("estimate the normaliser on the first N
samples"), a running mean updated on every read, or the same done only inside a DataLoader worker
(``get_worker_info() is not None``): the checks before training read a pristine state and see fixed records, but
every later release depends on the Poisson-drawn records that set the statistic, un-noised — one record's influence
is not bounded by the clipping norm.

The strategy owns the rebuilt training loader's fetch path in every process (:class:`WatchedCollate`, installed as
its collate, :class:`NotedBatches` and its ``worker_init_fn``): it notes a shallow digest (:func:`digest`) of the
Python state of the dataset (its attributes, those of the objects it holds, to :data:`MAX_DEPTH` levels), of the
user's collate object, and in a worker of the module-level globals of their classes' modules, and compares it after
the fetch. Only fetches are judged, not the user's code between them (a callback's ``set_epoch``, an augmentation
strength set from the epoch number: public values, which other checks judge): in the main process without workers
the digest is noted right before each batch is fetched (:class:`NotedBatches`, as the loader draws its indices) and
compared after its collate; the library's own reads in the main process (the checks before training, the probe,
physical batches: :class:`~lightning_dp.records.fetch.watched`) are compared around themselves — a warm-up they
complete is refused; a worker notes after the user's ``worker_init_fn`` and compares after each of its batches.
Tensors are compared by identity and shape (in a worker also by version counter: an in-place update there is
invisible to the main process), NumPy arrays by identity, shape and a few elements,
containers by identity, length and their first and last :data:`SAMPLED` items, numbers and strings by value. Random
number generators (``random.Random``, NumPy's and torch's generators) are not walked: their state is not the
dataset's. A change is refused (``PrivacyConfigurationError``) before the batch is handed to the loop; in a worker
the error rides with the batch to the main process, which raises it in its place.

Allowed writes (module docstring of the rule in docs/release_boundary.md, rule 8):

* an **index-keyed cache**: a dict whose new keys are indices of the dataset (``0 <= key < len``), its old entries
  untouched (a sample compared), and whose values are each that record's own: at the comparisons numbered by powers
  of two, each key added since the last such check is read again (its entry removed, the record read with the
  generators seeded, the entry compared with the one it replaces, then put back): a value computed from other
  records does not come back the same;
* a **handle that holds no data**: an attribute set to an object of a library's class (an open file, an ``h5py``
  file, an LMDB environment, a ``zipfile.ZipFile``, a database connection) whose own attributes, walked three levels,
  hold no tensor, array, float, complex number, bytes or object of the user's classes (integers and strings — offsets,
  names, modes — are allowed inside it, not at the top: an attribute set to a number is refused);
* what the user's ``worker_init_fn`` writes (the worker's digest is noted after it runs);
* **state every fetch writes alike whatever the records** (a count of calls, a cache keyed by a size all records
  share, the parameters of the last random draw): any other write is judged by fetching again from the state as it
  was before the fetch (:class:`~lightning_dp.records.fetch_reruns.Kept`, noted with the digest), on the same
  records, on them exchanged in memory (``exchange``, handed in by the strategy) and on other records, the values
  written compared (:mod:`~lightning_dp.records.fetch_reruns`); a write the three make alike is allowed, and the
  kept-state fingerprint leaves the values it wrote to this module
  (:func:`~lightning_dp.records.fetch_reruns.fetch_written`).

Cost: one walk of the digest per batch (a few dozen entries for an ordinary dataset) and a shallow copy of the
objects it reaches; no tensor is hashed; three more fetches of a batch whose fetch wrote state.
"""

from __future__ import annotations

import array
import functools
import os
import random
import sys
import types
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import get_worker_info

from lightning_dp.containers import held_items, put_back
from lightning_dp.records.values import same_array_values, same_tensor_values
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records import fresh_randomness
from lightning_dp.records.fetch import WATCHED, seeded
from lightning_dp.records.fetch_reruns import (Exchange, Kept, Unjudged, frozen, judge, note_written, other_indices,
                                               reached)
from lightning_dp.records.fresh_randomness import FreshIndices
from lightning_dp.records.identity import Same
from lightning_dp.records.library_code import defining_modules, installed_class, library_callable
from lightning_dp.replays.starting_state import Generators

MAX_DEPTH = 4
"""Attribute or item levels walked below the dataset and the collate object."""

MAX_NODES = 4_000
"""Entries per digest at most (beyond: not compared)."""

SAMPLED = 4
"""Items compared at each end of a list, tuple or dict."""

VERIFIED = 256
"""Cache entries read again per verification at most (the rest wait for the next)."""

_RNGS = (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator, torch.Generator)
_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)
_DATA = (Tensor, np.ndarray, np.generic, float, complex, bytearray, memoryview, array.array)

Digest = dict[str, Any]


def _users(cls: type) -> bool:
    """Whether ``cls`` is the user's: not the standard library's, nor an installed package's (``site-packages``) —
    by its name, and by where it was written (:func:`~lightning_dp.records.library_code.installed_class`: a user's
    class claiming ``__module__ = "lightning_dp.x"`` is the user's)."""
    return _users_module(cls.__module__) or not installed_class(cls)


def _users_module(name: Optional[str]) -> bool:
    name = name or ""
    top = name.split(".")[0]
    if top == "lightning_dp" or top in sys.stdlib_module_names or top.startswith("_"):
        return False
    path = getattr(sys.modules.get(name), "__file__", None) or ""
    return not ("site-packages" in path or "dist-packages" in path)


class _Walk:
    def __init__(self, versions: bool) -> None:
        self.versions = versions
        self.entries: Digest = {}
        self.objects: dict[str, Any] = {}  # path → the container or object held there (what a change is judged on)
        self._seen: set[int] = set()

    def visit(self, value: Any, path: str, depth: int) -> None:
        if len(self.entries) >= MAX_NODES:
            return
        entries = self.entries
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            entries[path] = value if not isinstance(value, (str, bytes)) or len(value) <= 256 else \
                (type(value).__name__, len(value), hash(value))
            return
        if isinstance(value, Tensor):
            entries[path] = ("tensor", Same(value), tuple(value.shape), value._version if self.versions else 0)
            return
        if isinstance(value, np.ndarray):
            flat = value.reshape(-1) if value.dtype.hasobject is False else None
            sample = () if flat is None or flat.size == 0 else (flat[:SAMPLED].tobytes(), flat[-SAMPLED:].tobytes())
            entries[path] = ("array", Same(value), value.shape, sample)
            return
        if isinstance(value, _RNGS):
            entries[path] = ("generator", type(value).__name__)
            return
        if isinstance(value, _OPAQUE):
            entries[path] = ("object", Same(value))
            return
        if id(value) in self._seen:
            entries[path] = ("seen", Same(value))
            return
        self._seen.add(id(value))
        self.objects[path] = value
        if isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
            entries[path] = (type(value).__name__, Same(value), len(value))
            if depth < MAX_DEPTH:
                n = len(value)
                for i in [*range(min(n, SAMPLED)), *range(max(SAMPLED, n - SAMPLED), n)]:
                    self.visit(value[i], f"{path}[{i}]", depth + 1)
            return
        if isinstance(value, dict):
            entries[path] = ("dict", Same(value), len(value))
            if depth < MAX_DEPTH and value:
                keys = list(value) if len(value) <= 2 * SAMPLED else [*list(value)[:SAMPLED]]
                for k in keys:
                    self.visit(value[k], f"{path}[{k!r}]", depth + 1)
            return
        if isinstance(value, (set, frozenset)):
            entries[path] = (type(value).__name__, Same(value), len(value))
            return
        entries[path] = ("object", type(value).__name__, Same(value))
        if depth < MAX_DEPTH:
            try:
                names = vars(value)
            except TypeError:
                return
            for k, v in list(names.items()):
                self.visit(v, f"{path}.{k}", depth + 1)


def digest(roots: dict[str, Any], versions: bool, globals_of: tuple[Any, ...] = ()) -> tuple[Digest, dict[str, Any]]:
    """The digest of ``roots`` (name → object) and of the module-level globals of the user's modules defining the
    classes of ``globals_of``: entries (path → token) and the containers and objects held at each path."""
    walk = _Walk(versions)
    for name, root in roots.items():
        walk.visit(root, name, 0)
    for module in _modules(globals_of):
        for k, v in list(vars(module).items()):
            if not k.startswith("__") and not isinstance(v, _OPAQUE):
                walk.visit(v, f"{module.__name__}.{k}", 1)
    return walk.entries, walk.objects


def _modules(objects: tuple[Any, ...]) -> list[types.ModuleType]:
    names = {name for o in objects for base in type(o).__mro__ if _users(base)
             for name in defining_modules(base) if _users_module(name)}
    return [m for m in (sys.modules.get(n) for n in sorted(names)) if m is not None]


def holds_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` may carry numbers computed from records (module docstring: a handle that holds no data)."""
    top = depth == 0
    if value is None or isinstance(value, _RNGS + (types.ModuleType, types.BuiltinFunctionType)):
        return False
    if isinstance(value, _DATA):
        return True
    if isinstance(value, (bool, int, str, bytes)):
        return top
    if top and isinstance(value, (list, tuple, dict, set, frozenset, types.SimpleNamespace, types.FunctionType,
                                  types.MethodType, functools.partial)):
        return True  # a container (or a function's closure) set by a read: data
    if _users(type(value)) or depth > 4:
        return True
    if isinstance(value, dict):
        return any(holds_data(v, depth + 1) for v in list(value.values())[:64])
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_data(v, depth + 1) for v in list(value)[:64])
    try:
        names = vars(value)
    except TypeError:
        return False  # an object of a library's compiled class (a file, a lock, an LMDB environment): no Python state
    return any(holds_data(v, depth + 1) for v in list(names.values())[:64])


def _handle(value: Any) -> bool:
    """An object of a library's class (not a container) that holds no data: changes inside it are allowed."""
    return not isinstance(value, (list, tuple, dict, set, frozenset)) and not _users(type(value)) \
        and not holds_data(value)


class FetchState:
    """The digest of one process's fetch path (module docstring), noted, then compared after each batch."""

    def __init__(self, dataset: Any, collate_fn: Any, exchange: Optional[Exchange] = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn if _stateful(collate_fn) else None
        library = (getattr(collate_fn, "__module__", None) or "").startswith("torch.") \
            and library_callable(collate_fn)  # default_collate: stateless (a user's claiming its module: judged)
        self.reads_collate = None if library else collate_fn  # the user's collate, run by the reruns judging a write
        self.exchange = exchange  # the dataset's records exchanged in memory (fetch_reruns), when the strategy has it
        self._kept: Optional[Kept] = None  # the state before this fetch, to run it again from (fetch_reruns)
        self._generators: Optional[Callable[[], None]] = None  # what puts the global generators back as before it
        self._indices: Optional[list] = None  # the records it reads, when known
        self._read: Optional[Callable[..., Any]] = None  # a library read's read(indices, seeds) (None: the fetcher)
        self._pid: Optional[int] = None
        self._entries: Digest = {}
        self._objects: dict[str, Any] = {}
        self._compared = 0
        self._unverified: list[tuple[dict, Any]] = []
        self.filled: dict[int, tuple[dict, dict[Any, Any]]] = {}
        """Per index-keyed cache (by id, the cache held: a new dict never takes its id), the entries fetches added: key
        → the value stored (:func:`fetch_filled`)."""
        self.home = os.getpid()  # the process that built the loader: its library reads are watched (fetch.watched)
        self.depth = 0  # inside a watched read or the loader's collate: nested reads are part of it
        WATCHED[id(dataset)] = self

    def _take(self) -> tuple[Digest, dict[str, Any]]:
        roots = {"dataset": self.dataset}
        if self.collate_fn is not None:
            roots["collate_fn"] = self.collate_fn
        worker = get_worker_info() is not None
        return digest(roots, versions=worker, globals_of=tuple(roots.values()) if worker else ())

    def note(self, indices: Optional[list] = None, read: Optional[Callable[..., Any]] = None) -> None:
        """The state now is this process's baseline, before a fetch of ``indices`` (when known) by ``read`` (a
        library read, ``read(indices, seeds)``: ``indices`` read with the generators seeded as for ``seeds``; else
        the loader's fetcher)."""
        self._pid = os.getpid()
        self._entries, self._objects = self._take()
        self._kept = Kept(self._objects)
        self._generators = Generators(cuda="none")
        self._indices, self._read = indices, read
        fresh_randomness.LATEST[0] = None  # the loader's next batch of indices, once iterated

    def noted(self) -> "FetchState":
        """:meth:`note`, returning ``self``."""
        self.note()
        return self

    def check(self, count: Optional[int] = None) -> None:
        """After a batch (of ``count`` records, when known): refuse a write to the fetch path's state other than those
        allowed; note the state now."""
        if self._pid != os.getpid():  # a process whose baseline was not noted (a worker started without our init)
            self.note()
            return
        entries, objects = self._take()
        changed = sorted({k for k in entries.keys() | self._entries.keys()
                          if entries.get(k, _ABSENT) != self._entries.get(k, _ABSENT)})
        written = self._refused(changed, entries, objects)
        if written:
            differ = self._judged(written, entries, objects, count)
            for path in set(written) - set(differ):
                _note_written(path, objects, batch=self._read is None)
            written = differ
        refused = list(dict.fromkeys(_label(p) for p in written))
        self._entries, self._objects, self._kept = entries, objects, None  # the reruns put back what they changed
        if get_worker_info() is not None:  # a worker's next fetch starts from here
            self._kept, self._generators, self._indices, self._read = Kept(objects), Generators(cuda="none"), None, None
        fresh_randomness.LATEST[0] = None
        self._compared += 1
        if not refused and self._compared & (self._compared - 1) == 0:
            refused = self._verify_caches()
        if refused:
            raise PrivacyConfigurationError(
                f"Reading records writes state that shapes later records: {', '.join(refused[:6])} changed while "
                "the training loader fetched and collated a batch (or the library read records), and fetching the "
                "same records again from the state as it was, them exchanged for other values, or other records did "
                "not write it alike (or could not be run again). A fetch must be stateless: state that is a function "
                "of the records read (a running mean, a statistic of the first records or batches, per worker or "
                "not, a copy of the last record, a count of the records of a label) makes every later record depend "
                "on the Poisson-drawn records that set it, un-noised — one record's influence is no longer bounded "
                "by max_grad_norm. Nothing was released with this batch. Fix: compute such state from public data "
                "or constants before training (or in a worker_init_fn) and keep __getitem__ and the collate_fn "
                "per-record transforms. Allowed: state every fetch writes alike whatever the records (a count of "
                "calls, a cache keyed by a size all records share, the parameters of the last random draw), a cache "
                "keyed by the record's index holding that record's own value, and a handle opened on first use (a "
                "file, an LMDB or HDF5 handle) that holds no data.")

    def _judged(self, paths: list[str], entries: Digest, objects: dict[str, Any], count: Optional[int]) -> list[str]:
        """The ``paths`` the fetch wrote that fetching again from the state before it, on the same records, on them
        exchanged and on other records, writes otherwise (:mod:`~lightning_dp.records.fetch_reruns`); all of them when
        that cannot be judged. The fetch's records known, the plain rerun must write what the fetch wrote. The state
        the fetch left and the generators are put back."""
        pre, self._kept = self._kept, None
        try:
            n = len(self.dataset)
            real: Optional[list[Any]] = [frozen(_at(p, entries, objects)) for p in paths]
        except (TypeError, Unjudged):
            return paths
        post = reached([self.dataset, self.collate_fn])
        if pre is None or post is None or n < 1:
            return paths
        same = self._indices if self._indices is not None else fresh_randomness.LATEST[0]
        if same is None:  # the batch's indices unknown (a worker's, without per-record seeds): as many others
            same, real = [(self._compared * 7919 + k * 104729) % n for k in range(count or 2 * SAMPLED)], None
        listed = list(list.__iter__(same)) if isinstance(same, FreshIndices) else [int(i) for i in same]
        other = other_indices(listed, n)
        if self._read is not None:  # a library read: the other records read with the same records' seeds
            read, again = self._read, self._read
            plain, elsewhere = (lambda: read(listed)), (lambda: again(other, listed))
        else:  # the loader's fetch: per-record seeds by position (FreshIndices), alike for other records
            others = FreshIndices(other, same.seed) if isinstance(same, FreshIndices) else other
            plain, elsewhere = (lambda: self._fetch_again(same)), (lambda: self._fetch_again(others))
        put_back = self._generators or (lambda: None)  # (noted with pre)
        self.depth += 1
        try:
            with seeded(0):  # the generators put back after
                return judge(paths, pre, plain, elsewhere, self._values, self.exchange, self.dataset,
                             put_back, real)
        finally:
            post.restore()
            self.depth -= 1

    def _fetch_again(self, indices: Any) -> None:
        """Read ``indices`` as the loader's fetcher does and collate them with the user's collate function."""
        many = getattr(self.dataset, "__getitems__", None)
        items = many(indices) if many else [self.dataset[i] for i in indices]
        if self.reads_collate is not None:
            self.reads_collate(items)

    def _values(self, paths: list[str]) -> list[Any]:
        """The values at ``paths`` now, frozen (:func:`~lightning_dp.records.fetch_reruns.frozen`)."""
        entries, objects = self._take()
        return [frozen(_at(p, entries, objects)) for p in paths]

    def _refused(self, changed: list[str], entries: Digest, objects: dict[str, Any]) -> list[str]:
        allowed: list[str] = []  # paths below which every change is allowed
        refused: list[str] = []
        for path in changed:
            if any(path.startswith(a) and path[len(a):len(a) + 1] in (".", "[") for a in allowed):
                continue
            if any(_handle(objects[a]) for a in _ancestors(path) if a in objects):
                continue  # inside a handle that holds no data (a zip file's open-member count)
            now = objects.get(path, _ABSENT)
            if isinstance(now, dict) and self._cache_growth(now, entries.get(path), self._entries.get(path, _ABSENT)):
                allowed.append(path)
                continue
            value = now if now is not _ABSENT else _resolve(path, objects)
            if value is not _ABSENT and not holds_data(value):
                allowed.append(path)
                continue
            if value is not _ABSENT and self._loaded_on_first_use(path, value, objects):
                allowed.append(path)
                continue
            refused.append(path)
        return refused

    def _loaded_on_first_use(self, path: str, value: Any, objects: dict[str, Any]) -> bool:
        """An attribute that was ``None`` (or absent) and now holds an array, a tensor or a plain value (``self._x =
        np.load(path, mmap_mode="r")``, ``self.worker = get_worker_info().id`` on the first ``__getitem__``): allowed
        when it is the same whichever record triggered it — put back to ``None`` with its owner's other attributes
        loaded at the same read (``self._y``) and loaded again
        by a read of another record (generators seeded), each must come back equal; a statistic of the records read
        so far does not. The owner's attributes are put back afterwards."""
        if not self._was_none(path) or not isinstance(value, _LOADED) or "." not in path \
                or "[" in path.rsplit(".", 1)[1]:
            return False
        parent, name = path.rsplit(".", 1)
        fields = getattr(objects.get(parent, _ABSENT), "__dict__", None)
        try:
            n = len(self.dataset)
        except TypeError:
            return False
        if not isinstance(fields, dict) or fields.get(name) is not value or n < 1:
            return False
        loaded = {k: v for k, v in fields.items() if isinstance(v, _LOADED) and self._was_none(f"{parent}.{k}")}
        saved = dict(fields)
        j = (self._compared * 7919 + 1) % n
        try:
            fields.update(dict.fromkeys(loaded))
            with seeded(j):
                self.dataset[j]
            fresh = {k: fields.get(k) for k in loaded}
        except Exception:  # noqa: BLE001 — a read that fails this way is not allowed on trust
            return False
        finally:
            fields.clear()
            fields.update(saved)
        return all(fresh[k] is not None and _same(fresh[k], v) for k, v in loaded.items())

    def _was_none(self, path: str) -> bool:
        """Whether ``path`` held ``None`` (or nothing) when the state was last noted."""
        before = self._entries.get(path, _ABSENT)
        return before is _ABSENT or before is None

    def _cache_growth(self, now: dict, token: Any, before_token: Any) -> bool:
        """Whether ``now`` is an index-keyed cache that only gained entries keyed by valid indices."""
        if isinstance(before_token, tuple) and before_token[:2] == ("dict", Same(now)):
            old = before_token[2]
        elif before_token is _ABSENT or before_token is None or (
                isinstance(before_token, tuple) and before_token[0] == "dict" and before_token[2] == 0):
            old = 0
        else:
            return False
        grown = len(now) - old
        try:
            n = len(self.dataset)
        except TypeError:
            return False
        if grown < 0:
            return False
        keys = list(reversed(now))[:grown] if grown else []
        if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k < n for k in keys):
            return False
        self._unverified.extend((now, k) for k in keys)
        held = self.filled.get(id(now))
        if held is None or held[0] is not now:
            held = self.filled[id(now)] = (now, {})
        held[1].update((k, now[k]) for k in keys)
        return True

    def _verify_caches(self) -> list[str]:
        """Each cache entry added since the last verification read again: it must come back the same."""
        pending, self._unverified = self._unverified[:VERIFIED], self._unverified[VERIFIED:]
        kept_items = {id(c): (c, held_items(c)) for c, _ in pending}  # each cache put back as it was, in order
        try:
            return self._reread(pending)
        finally:
            for cache, items in kept_items.values():
                put_back(cache, items)
            if pending:
                self._entries, self._objects = self._take()

    def _reread(self, pending: list[tuple[dict, Any]]) -> list[str]:
        for cache, key in pending:
            if key not in cache:
                continue
            kept = cache.pop(key)
            try:
                with seeded(int(key)):
                    self.dataset[int(key)]
                fresh = cache.get(key, _ABSENT)
            finally:
                cache[key] = kept
            if fresh is not _ABSENT and not _same(fresh, kept):
                return [f"a cache keyed by index (entry {key!r} is not that record's own value read again)"]
        return []


def fetch_filled(cache: dict) -> dict[Any, Any]:
    """The entries of ``cache`` (this very dict) that a watched fetch of a training loader added, as an index-keyed
    cache (key → the value it stored: an entry holding another object since is not the fetch's): the fetch's, which
    the kept-state fingerprint leaves to this module
    (:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_token`)."""
    for state in list(WATCHED.values()):
        held = getattr(state, "filled", {}).get(id(cache))
        if held is not None and held[0] is cache and held[1]:
            return held[1]
    return {}


_ABSENT = object()

_LOADED = (np.ndarray, Tensor, bool, int, float, str)
"""What an attribute set on the first read may hold and be verified as loaded (an array, a worker's id, a path)."""


def _at(path: str, entries: Digest, objects: dict[str, Any]) -> Any:
    """The value at ``path`` in a digest: the container or object there, the tensor or array a token holds, a plain
    value, or the absent mark."""
    if path in objects:
        return objects[path]
    token = entries.get(path, _ABSENT)
    if isinstance(token, tuple) and len(token) > 1 and isinstance(token[1], Same):
        return token[1].obj
    return token


def _note_written(path: str, objects: dict[str, Any], batch: bool) -> None:
    """The attribute ``path`` is in (``owner.name``, ``owner.name[key]``…) noted as written by the fetch alike on any
    records (:func:`~lightning_dp.records.fetch_reruns.note_written`)."""
    for owner in reversed(_ancestors(path)):
        if path[len(owner):len(owner) + 1] == "." and owner in objects:
            name = path[len(owner) + 1:].split("[", 1)[0].split(".", 1)[0]
            fields = getattr(objects[owner], "__dict__", None)
            if isinstance(fields, dict) and name in fields:
                note_written(objects[owner], name, fields[name], batch)
            return


def _ancestors(path: str) -> list[str]:
    return [path[:i] for i, c in enumerate(path) if c in ".["]


def _label(path: str) -> str:
    return path.split("[", 1)[0] if "[" in path else path


def _resolve(path: str, objects: dict[str, Any]) -> Any:
    """The value at ``path`` (an attribute of an object whose path is known), or absent."""
    if "." not in path:
        return _ABSENT
    parent, name = path.rsplit(".", 1)
    owner = objects.get(parent, _ABSENT)
    if owner is _ABSENT or "[" in name:
        return _ABSENT
    try:
        return vars(owner).get(name, _ABSENT)
    except TypeError:
        return _ABSENT


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and same_tensor_values(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and same_array_values(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 — an object without a usable equality: not judged
        return True


def _stateful(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is an object that can keep state (not a plain function or a library's)."""
    return collate_fn is not None and not isinstance(collate_fn, _OPAQUE) and hasattr(collate_fn, "__dict__")


class WatchedCollate:
    """The training loader's collate (``inner``), each batch followed by :meth:`FetchState.check` of the process
    that fetched it. Picklable, for DataLoader workers."""

    def __init__(self, inner: Callable[[Any], Any], state: FetchState) -> None:
        self.inner = inner
        self.state = state

    def __call__(self, examples: Any) -> Any:
        state = self.state
        state.depth += 1  # a read inside the collate (an empty batch's template) is part of this fetch
        try:
            batch = self.inner(examples)
        finally:
            state.depth -= 1
        state.check(len(examples) if isinstance(examples, (list, tuple)) else None)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "state") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class NotedBatches:
    """The batches of indices a single-process loader fetches (``batches``), the fetch state noted as each is handed
    out: in the main process that is right before the batch is fetched, so :meth:`FetchState.check` after its collate
    judges that fetch's own writes only (not those of the user's hooks between batches: ``set_epoch``)."""

    def __init__(self, batches: Any, state: FetchState) -> None:
        self.batches = batches
        self.state = state

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        note = self.state.note
        for indices in self.batches:
            note(indices if isinstance(indices, list) else None)
            yield indices


class NotingWorkerInit:
    """A ``worker_init_fn``: the user's (if any), then the worker's baseline noted (before its first fetch)."""

    def __init__(self, user: Optional[Callable[[int], Any]], state: FetchState) -> None:
        self.user = user
        self.state = state

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        self.state.note()
