"""Record content kept as non-tensor state: a vocabulary, a category table or a fitted encoder built from the training
records, held by the model, its hyperparameters, the LightningDataModule or a checkpoint.

A word vocabulary built from the training texts (``{w: i for i, w in enumerate(sorted(words))}`` kept by
``save_hyperparameters``), a tokenizer trained on them, a label encoder's ``classes_``, scikit-learn's
``OneHotEncoder.categories_`` or a table of the zip codes seen in a training column hold each item *because* some
record has it. An item that occurs in exactly one training record is that record's content, verbatim, and its
presence in the released model says that the record was in the training set: no noise covers it, so the model is not
differentially private (ε = ∞ for that record) whatever σ the ledger counts.

:func:`vocabulary_held` (once before the first release) and :func:`vocabulary_in` (a checkpoint about to be written)
look for **containers built from the training records that hold an item found in one record only**:

* containers: dicts with string keys and number values (``word → id``, ``zip → index``, ``word → count``) or string
  values (``id → word``), lists, tuples, sets and NumPy arrays of strings (an ``itos`` list, ``classes_``,
  ``categories_``), and a tokenizer's ``get_vocab()``, of at least :data:`MIN_ITEMS` distinct strings, found by a
  bounded walk of the model's submodules' attributes, the ``hparams`` of the model and the datamodule, the
  datamodule's attributes, the objects the training loader holds (:func:`loader_holders`: its ``collate_fn``,
  ``sampler``, ``batch_sampler`` and ``worker_init_fn``: a collator holding the tokenizer it encodes with is released
  with the model trained on its ids), the helper objects they hold (fitted encoders; a ``functools.partial``'s
  arguments, a closure's cells, a bound method's object), and the checkpoint's entries;
* items of the records: each training record's strings (a record that is a string, a tuple, list or dict holding
  strings), whole, split at whitespace (raw and lower-cased with the punctuation around them stripped) and split as a
  basic tokenizer splits lower-cased text (words and single punctuation marks), counted
  once per record they occur in — one pass over ``dataset[i]``, only when some container was found, the first record
  holds a string and the dataset has at most :data:`MAX_RECORDS` records (read within :data:`MAX_SECONDS`; otherwise
  skipped with a warning); and, for a container that maps items to ids (a dict's int values, a list's positions), the
  training dataset's integer tensors that encode it (at least 95% of the container's ids occur in the tensor and
  almost all of the tensor's values are its ids): the item of id ``v`` occurs in as many records as rows holding
  ``v`` (a category column, pre-tokenised text);
* refused: a container :data:`BUILT_SHARE` (95%) or more of whose items occur in the training records (it was built
  from them) that holds an item occurring in exactly one record.

The threshold is one record (k = 2: an item must occur in at least two records), and only that case is refused. An
item in one record is a deterministic function of that record alone: the neighbouring training set without it
cannot produce the same "all items" vocabulary, so its presence is a membership disclosure and a verbatim copy of
record content. No deterministic count threshold is differentially private — a vocabulary cut at ``min_freq = k``
changes when one of the k records of an item at the cut is removed — and a cut vocabulary is indistinguishable by
value from a public list of common words, so it is not refused: the honest fix for both is a public vocabulary (a
pretrained tokenizer, a public word list, a fixed category list) or a vocabulary chosen by a DP mechanism (noisy
counts and a threshold, with its ε accounted for), declared with ``DPStrategy(public_state=[name])``.

The 95% condition keeps a public vocabulary apart from one built from the data, by a heuristic, not a proof: a
public word list that happens to hold a word one training record has is refused only if nearly all of its other
words occur in the training records too (a large public vocabulary mostly holds words the data does not have; a
small one over a large corpus may not — declare it public). The datamodule holding the training texts themselves
(most items are whole record strings) is its data, not a vocabulary, and is not refused, nor is the loader's collate
function holding them; the model or a checkpoint holding them is.

What it cannot see: a container of fewer than :data:`MIN_ITEMS` strings; numbers, bytes or other non-string items
(a table keyed by integer zip codes); items transformed (stemmed, hashed, sub-word pieces of a BPE or WordPiece
vocabulary, characters of a character vocabulary); a vocabulary cut at a count threshold (above); records whose
strings are not returned by ``dataset[i]`` and ids encoded in non-integer or wrapped tensors; an iterable dataset,
one over :data:`MAX_RECORDS` records or slower to read than :data:`MAX_SECONDS` (skipped with a warning); holders the
walk does not reach (a global, a callback, an object of an extension type without ``__dict__``, a Rust tokenizer
without ``get_vocab()``, a function's globals).
"""

from __future__ import annotations

import re
import string
import functools
import time
import types
import warnings
import weakref
from collections import Counter
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_dp.records.library_code import library_rooted, users_code
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.fetch import fetch, seeded
from lightning_dp.fingerprints.callback_state import is_datamodule
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.records.library_objects import framework_keys
from lightning_dp.fingerprints.public_names import is_public

MIN_ITEMS = 8
"""Distinct strings a container must hold to be looked at: fewer are configuration (layer or optimizer names, a few
class names), not a vocabulary built from records."""

BUILT_SHARE = 0.95
"""Share of a container's items found in the training records above which it is taken for built from them."""

MAX_RECORDS = 100_000
"""Training sets with more records are not read for their strings (skipped with a warning)."""

MAX_SECONDS = 60.0
"""Time the pass over the records may take before it is abandoned (skipped with a warning)."""

MAX_VISITED = 20_000
"""Objects visited by one walk of the holders."""

MAX_ITEMS = 1 << 21
"""Items of one container read (a larger one is read up to this many)."""

_OPAQUE = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_dp", "numpy", "builtins",
           "typing", "abc", "logging", "threading", "multiprocessing", "weakref")
_PUNCTUATION = string.punctuation + "“”‘’«»…"
_SKIPPED_CHECKPOINT_KEYS = frozenset({"state_dict", "optimizer_states", "lr_schedulers", "loops"})


class _Container:
    """Strings held together, with the id of each where the container maps them to ids."""

    def __init__(self, path: str, items: list[str], ids: Optional[list[int]], holder: str) -> None:
        self.path, self.items, self.ids, self.holder = path, items, ids, holder


class _Records:
    """What the training records hold: in how many records each string (whole or token) occurs, the whole string
    fields, and the integer tensors' per-value row counts."""

    def __init__(self, counts: Counter, whole: set[str], columns: list[tuple[str, Tensor]], note: str) -> None:
        self.counts, self.whole, self.columns, self.note = counts, whole, columns, note


_CACHE: dict[int, tuple[Any, _Records]] = {}


def vocabulary_held(holders: Iterable[tuple[str, Any]], dataset: Any, public: Sequence[str] = ()) -> list[str]:
    """The containers ``holders`` ((path, object): the model, a datamodule) keep that were built from ``dataset``'s
    records and hold an item found in one record only (module docstring), as readable findings."""
    containers = []
    for label, owner in holders:
        kind = "datamodule" if is_datamodule(owner) else "loader" if label.startswith(_LOADER) else label
        roots = [(label, owner)] if kind == "loader" else _roots(label, owner)
        containers += [c for c in _containers(roots, kind) if not _public(c.path, public)]
    return _judge(containers, dataset)


_LOADER = "loader."


def loader_holders(loader: Any) -> list[tuple[str, Any]]:
    """The objects the training ``loader`` holds besides its dataset (its ``collate_fn``, ``sampler``,
    ``batch_sampler`` and ``worker_init_fn``), as holders for :func:`vocabulary_held`: record content kept there
    (a tokenizer built from the records, held by a collator) is released with the model as much as the model's own."""
    names = ("collate_fn", "sampler", "batch_sampler", "worker_init_fn")
    return [(_LOADER + name, getattr(loader, name)) for name in names if getattr(loader, name, None) is not None]


def _public(path: str, public: Sequence[str]) -> bool:
    """Declared public: the path (``vocab``, ``encoder.classes_``), or one of its names (``vocab`` in
    ``hparams['vocab']`` and ``checkpoint['hyper_parameters']['vocab']``)."""
    names = [a or b for a, b in re.findall(r"\['([^']*)'\]|([A-Za-z_]\w*)", path)]
    return is_public(path, public) or any(is_public(name, public) for name in names)


def vocabulary_in(checkpoint: Any, dataset: Any, public: Sequence[str] = ()) -> list[str]:
    """:func:`vocabulary_held` for the entries of a checkpoint about to be written (the weights, optimizer and loop
    states left out)."""
    roots = [(f"checkpoint[{k!r}]", v) for k, v in checkpoint.items() if k not in _SKIPPED_CHECKPOINT_KEYS] \
        if isinstance(checkpoint, dict) else [("checkpoint", checkpoint)]
    return _judge([c for c in _containers(roots, "checkpoint") if not _public(c.path, public)], dataset)


def vocabulary_error(found: Sequence[str], where: str = "before training") -> PrivacyConfigurationError:
    """The refusal of :func:`vocabulary_held`'s or :func:`vocabulary_in`'s findings (the items are named: the
    message is seen by whoever holds the data)."""
    lines = "\n".join(f"- {f}" for f in found[:6])
    return PrivacyConfigurationError(
        f"Record content is kept as non-tensor state ({where}):\n{lines}\nA vocabulary, category table or encoder "
        "built from the training records holds items that occur in one training record only. It is released with "
        "the model and its checkpoints as it is: such an item is that record's content, verbatim, and its presence "
        "says the record was trained on; no noise covers it, so the model would not be differentially private "
        "whatever σ the ledger counts. Nothing was released. Use a public vocabulary (a pretrained tokenizer, a "
        "public word list, a fixed list of categories) or one chosen with a DP mechanism (noisy counts and a "
        "threshold, its ε accounted for), and declare it: DPStrategy(public_state=[name]). Dropping rare items with "
        "a fixed count threshold (min_freq) hides these but is not differentially private either."
        + (" A tokenizer or table held by the training loader (loader.*: its collate_fn, sampler or worker_init_fn) "
           "counts as the model's: it is what the model's ids mean, and is published with it."
           if any(f.startswith(_LOADER) for f in found) else ""))


# ---------------------------------------------------------------------- the holders' containers
def _roots(label: str, owner: Any) -> list[tuple[str, Any]]:
    """Where a holder keeps state: a module's submodules' attributes and its ``hparams``; another object's
    attributes (a datamodule's ``hparams`` among them)."""
    if isinstance(owner, nn.Module):
        skip = framework_keys() | {"_hparams", "_hparams_initial"}
        roots = [(f"{prefix + '.' if prefix else ''}{key}", value) for prefix, m in owner.named_modules()
                 for key, value in vars(m).items() if key not in skip and not key.startswith("__")]
        hparams = getattr(owner, "_hparams", None)
        if hparams is not None:
            roots.append(("hparams", hparams))
        return roots
    return [(f"{label}.{'hparams' if key == '_hparams' else key}", value)
            for key, value in (vars(owner).items() if hasattr(owner, "__dict__") else ())
            if key != "_hparams_initial" and not key.startswith("__")]


def _containers(roots: Sequence[tuple[str, Any]], holder: str) -> list[_Container]:
    """The string containers reachable from ``roots`` (breadth first, :data:`MAX_VISITED` objects, six levels)."""
    found: list[_Container] = []
    seen: set[int] = set()
    queue = [(path, value, 0) for path, value in roots]
    while queue and len(seen) < MAX_VISITED:
        path, value, depth = queue.pop(0)
        if id(value) in seen or depth > 6 or _skipped(value):
            continue
        seen.add(id(value))
        container = _container(path, value, holder)
        if container is not None:
            found.append(container)
            if container.path.endswith(".get_vocab()"):
                continue  # a tokenizer: its vocabulary is read once, not again in its inner objects
        queue.extend((p, v, depth + 1) for p, v in _inner(path, value))
    return found


def _skipped(value: Any) -> bool:
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        module = getattr(value, "__module__", None) or getattr(getattr(value, "func", None), "__module__", None)
        return (module or "").split(".")[0] in _OPAQUE \
            and not users_code(getattr(value, "func", value))  # the user's: its closure, arguments or object are walked
    if isinstance(value, (str, bytes, int, float, complex, bool, type(None), Tensor, nn.Module, Dataset, DataLoader,
                          type, types.BuiltinFunctionType, types.ModuleType)):
        return True  # a callable object of the user's (a tokenizer with __call__) is walked
    return library_rooted(type(value), _OPAQUE) \
        and not isinstance(value, (dict, list, tuple, set, frozenset, np.ndarray))


def _inner(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    """What a value holds that may hold containers: a dict's values, a sequence's non-string items (64 of them), an
    object's attributes."""
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items() if not isinstance(v, (str, int, float))]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value) if not isinstance(v, (str, int, float))]
    elif isinstance(value, np.ndarray):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, np.ndarray)] \
            if value.dtype == object and value.ndim == 1 and value.size <= 64 else []
    elif isinstance(value, functools.partial):
        items = [(f"{path}.func", value.func)] + [(f"{path}.args[{i}]", v) for i, v in enumerate(value.args)] \
            + [(f"{path}.keywords[{k!r}]", v) for k, v in value.keywords.items()]
    elif isinstance(value, types.MethodType):
        items = [(f"{path}.__self__", value.__self__), (path, value.__func__)]
    elif isinstance(value, types.FunctionType):  # a closure's cells, by the names the function gives them
        cells = zip(value.__code__.co_freevars, value.__closure__ or ())
        items = [(f"{path}.<{name}>", _cell(cell)) for name, cell in cells]
    elif hasattr(value, "__dict__") and not isinstance(value, (set, frozenset)):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items() if not k.startswith("__")]
    else:
        items = []
    yield from items[:64]


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name bound later)
        return None


def _container(path: str, value: Any, holder: str) -> Optional[_Container]:
    items: list[Any]
    ids: Optional[list[Any]] = None
    if isinstance(value, dict):
        keys, values = list(value)[:MAX_ITEMS], list(value.values())[:MAX_ITEMS]
        if keys and all(isinstance(k, str) for k in keys) and all(_number(v) for v in values):
            items, ids = keys, values
        elif values and all(isinstance(v, str) for v in values):
            items, ids = values, keys
        else:
            return None
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)[:MAX_ITEMS]
        ids = list(range(len(items))) if isinstance(value, (list, tuple)) else None
    elif isinstance(value, np.ndarray) and value.dtype.kind in "UO" and value.ndim == 1:
        items = value[:MAX_ITEMS].tolist()
        ids = list(range(len(items)))
    elif hasattr(value, "get_vocab"):  # a tokenizer
        try:
            vocab = value.get_vocab()
        except Exception:  # noqa: BLE001 - an object of the user's that only looks like one
            return None
        return _container(f"{path}.get_vocab()", vocab, holder) if isinstance(vocab, dict) else None
    else:
        return None
    if len(items) < MIN_ITEMS or not all(isinstance(s, str) for s in items) or len(set(items)) < MIN_ITEMS:
        return None
    if ids is not None and not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        ids = None
    return _Container(path, items, None if ids is None else [int(i) for i in ids], holder)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# ---------------------------------------------------------------------- the records' items
_WORD_TOKENS = re.compile(r"\w+|[^\w\s]")
"""Words and single punctuation marks, as a basic tokenizer splits lower-cased text (torchtext's ``basic_english``:
``print(x)`` → ``print``, ``(``, ``x``, ``)``)."""


def _normal(s: str) -> str:
    return s.strip(_PUNCTUATION).lower()


def _strings(value: Any, depth: int = 0) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for item in value[:64]:
            yield from _strings(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in list(value.values())[:64]:
            yield from _strings(item, depth + 1)


def _record_items(dataset: Any, wanted: bool) -> _Records:
    """The training records' items (module docstring); the string pass only when ``wanted``; cached per dataset."""
    cached = _CACHE.get(id(dataset))
    if cached is not None and cached[0]() is dataset and (cached[1].counts or cached[1].note or not wanted):
        return cached[1]
    columns = _id_columns(dataset)
    counts: Counter = Counter()
    whole: set[str] = set()
    note = ""
    if wanted and not isinstance(dataset, IterableDataset):
        with seeded(0):  # read as the library's checks read (records/fetch.py), the generators left as they were
            try:
                n = len(dataset)
                first = _read(dataset, 0) if n else None
            except Exception:  # noqa: BLE001 - a dataset without len or indexing: nothing to count
                n, first = 0, None
            if n and next(_strings(first), None) is not None:
                counts, whole, note = _read_all(dataset, n)
    found = _Records(counts, whole, columns, note)
    try:
        _CACHE.clear()
        _CACHE[id(dataset)] = (weakref.ref(dataset), found)
    except TypeError:  # not weak-referenceable: not cached
        pass
    return found


def _read(dataset: Any, i: int) -> Any:
    items = fetch(dataset, [i])
    return items[0] if isinstance(items, list) and len(items) == 1 else items


def _read_all(dataset: Any, n: int) -> tuple[Counter, set[str], str]:
    """In how many of the ``n`` records each string and token occurs, and the whole string fields (or a note why
    they were not read)."""
    counts: Counter = Counter()
    whole: set[str] = set()
    if n > MAX_RECORDS:
        return counts, whole, f"the training set has {n} records (over {MAX_RECORDS})"
    start = time.monotonic()
    for i in range(n):
        fields = list(_strings(_read(dataset, i)))
        whole.update(fields)
        tokens = set(fields)
        for s in fields:
            for t in s.split():
                tokens.add(t)
                tokens.add(_normal(t))
            tokens.update(_WORD_TOKENS.findall(s.lower()))  # a tokenizer's split: words and each punctuation mark
        counts.update(tokens)
        if time.monotonic() - start > MAX_SECONDS:
            return Counter(), set(), f"reading its records took over {MAX_SECONDS:g} s"
    return counts, whole, ""


def _id_columns(dataset: Any) -> list[tuple[str, Tensor]]:
    """Per integer tensor of the dataset (rows of ids: a category column, token ids), the number of rows that hold
    each value."""
    columns = []
    for path, t in dataset_parts(dataset)[1]:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() not in (1, 2) \
                or not 0 < t.numel() <= 1 << 26 or t.layout != torch.strided:
            continue
        x = t.detach().to("cpu", torch.int64)
        if int(x.min()) < 0 or int(x.max()) >= 1 << 22:
            continue
        if x.dim() == 2:
            x = x.sort(dim=1).values
            first = torch.ones_like(x, dtype=torch.bool)
            first[:, 1:] = x[:, 1:] != x[:, :-1]
            x = x[first]
        columns.append((path.lstrip(".") or "tensor", torch.bincount(x.reshape(-1))))
    return columns


# ---------------------------------------------------------------------- the judgement
def _judge(containers: list[_Container], dataset: Any) -> list[str]:
    if not containers:
        return []
    records = _record_items(dataset, wanted=True)
    if records.note:
        warnings.warn(f"lightning_dp: vocabularies held by the model were not compared with the training records: "
                      f"{records.note}. A vocabulary built from them is not refused (docs/release_boundary.md, rule "
                      "11).", UserWarning, stacklevel=3)
    found = []
    for c in containers:
        counts = _counts(c, records)
        distinct = {s: n for s, n in zip(c.items, counts)}
        present = [s for s, n in distinct.items() if n > 0]
        if len(present) < BUILT_SHARE * len(distinct):
            continue
        if c.holder in ("datamodule", "loader") and sum(s in records.whole for s in present) * 2 >= len(present):
            continue  # the datamodule (or the loader's collate function) holding the training texts: its data
        single = sorted(s for s, n in distinct.items() if n == 1)
        if single:
            shown = ", ".join(repr(s[:60]) for s in single[:4]) + (" …" if len(single) > 4 else "")
            found.append(f"{c.path} ({len(distinct)} items, {len(present)} found in the training records) holds "
                         f"{len(single)} item(s) found in one training record only: {shown}")
    return found


def _counts(c: _Container, records: _Records) -> list[int]:
    """In how many records each of the container's items occurs: as a string, or through an integer tensor that
    encodes the container's ids."""
    counts = [max(records.counts.get(s, 0), records.counts.get(_normal(s) or s, 0)) for s in c.items]
    if c.ids is None or not records.columns:
        return counts
    ids = torch.tensor(c.ids, dtype=torch.int64)
    if int(ids.min()) < 0:
        return counts
    for _, rows in records.columns:
        inside = ids < len(rows)
        held = torch.zeros(len(rows), dtype=torch.int64)
        held[ids[inside]] = rows[ids[inside]]
        present = int((held > 0).sum())
        values = int((rows > 0).sum())
        if present < BUILT_SHARE * len(set(c.ids)) or values - present > max(2, 0.05 * values):
            continue  # this tensor does not encode the container
        by_id = torch.where(inside, held[ids.clamp(max=len(rows) - 1)], torch.zeros_like(ids))
        counts = [max(a, int(b)) for a, b in zip(counts, by_id)]
    return counts
