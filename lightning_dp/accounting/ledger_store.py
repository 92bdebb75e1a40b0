"""The ledger store: the records of trained weights on disk, so a new process finds them as the fitting one would.

In the process that trained them, :mod:`~lightning_dp.accounting.module_ledgers` finds weights a private fit trained
(their digests, sketches of weights near them, the path sketches of weights derived from the fit:
accounting/lineage.py) and continues the fit's ledger. A new process knew none of it unless it loaded a Lightning
checkpoint through Lightning (accounting/loaded_checkpoints.py): ``torch.save(model.state_dict(), "m.pt")`` then,
in a new process, ``model.load_state_dict(torch.load("m.pt"))`` and a private fit counted the second fit alone. So
whenever module_ledgers marks weights as trained by a record (the end of a fit and every checkpoint written:
``mark``; a Lightning checkpoint's record loaded: ``carry``), it also writes that record's lookup material here
(:func:`write`): the digests of the trained weights, their sketches (64 values per parameter at the start, at the end
and at up to 8 points along the fit), the ledger's ``state_dict`` (σ, q, steps and runs of its releases), the
names of the trained weights and a creation time. When a module is attached for a private fit and no record of this
process matches it, the store's entries (:func:`read`: loaded once per process, read again when the directory
changed) are matched by the same functions, and a match continues that ledger as in one process.

Where: the directory ``$LIGHTNING_DP_LEDGER_STORE`` (:data:`ENV`), else ``$XDG_CACHE_HOME/lightning_dp/ledgers``,
else ``~/.cache/lightning_dp/ledgers``. ``LIGHTNING_DP_LEDGER_STORE=off`` turns it off: then weights loaded in a
new process other than from a Lightning checkpoint by Lightning start a fresh ledger (ε counts only the new fit).

What it holds: no training data — digests of trained weights and values of the trained weights themselves (64 per
parameter per sketch), which are released state (the fit's output), and the ledger (public settings). One file per
fit (rewritten at each of its marks: a checkpoint, the end) or per loaded checkpoint record, written atomically
(a temporary file, then a rename); the newest :data:`KEPT` files are kept (about 5 kB per trained parameter tensor
each), older ones removed. An unreadable or malformed file is skipped with a warning, a directory that cannot be
written is warned about once: the store never stops a fit. Under DDP rank 0 writes (the ranks hold the same
weights) and every rank reads.

The same directory holds the data's records (accounting/data_store.py, files ``*.records``, kept apart: their own
bound): the releases made on each training dataset, so that a fresh model on the same records in a new process
continues them; their row digests are keyed under the store's secret key, the file ``records.key`` beside them
(accounting/store_key.py; ``LIGHTNING_DP_LEDGER_KEY`` names another).

What it cannot see: another machine's (or another user's) store, a store that was turned off, cleared or pruned
past :data:`KEPT` fits when the weights were trained or are loaded, and what module_ledgers cannot see in one process.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_dp.accounting.ledger import PrivacyLedger

ENV = "LIGHTNING_DP_LEDGER_STORE"
"""The environment variable naming the store's directory (``off``: no store)."""
KEPT = 256
"""The most entries (fits, loaded checkpoint records) the store keeps: the newest, by the time they were written."""
SUFFIX = ".ledger"
_VERSION = 1

Sketch = tuple[Tensor, Tensor, tuple[Tensor, ...]]
"""(sketch when bound, sketch after the releases, sketches along the fit ending with the latter) of one parameter."""


@dataclass
class Entry:
    """The lookup material of one record: what a fit (or a loaded checkpoint) leaves in the store.

    Attributes:
        key: the file's name (without :data:`SUFFIX`): one per fit, rewritten as it marks more weights.
        digests: digests of the trained weights' contents (module_ledgers' ``digest``, of roundings too).
        sketches: shape → :data:`Sketch` of each trained parameter of that shape.
        trained: the names of the trained weights.
        created: when the entry was first written (seconds since the epoch).
    """

    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    digests: set[bytes] = field(default_factory=set)
    sketches: dict[tuple[int, ...], list[Sketch]] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)


@dataclass
class Stored:
    """The store's entries as module_ledgers' lookups: digest → record, shape → (start, end, record, path)."""

    by_content: dict[bytes, PrivacyLedger] = field(default_factory=dict)
    sketches: dict[tuple[int, ...], list[tuple[Tensor, Tensor, PrivacyLedger, tuple[Tensor, ...]]]] = field(
        default_factory=dict)


def directory() -> Optional[Path]:
    """The store's directory (module docstring), ``None`` when turned off."""
    named = os.environ.get(ENV, "").strip()
    if named.lower() in ("off", "0", "false", "no", "none"):
        return None
    if named:
        return Path(named).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(cache) if cache else Path.home() / ".cache") / "lightning_dp" / "ledgers"


def content_key(ledger: PrivacyLedger, digests: set[bytes]) -> str:
    """A key naming a loaded checkpoint's record by what it holds: loading it again writes the same file."""
    h = hashlib.blake2b(repr(ledger.state_dict()).encode(), digest_size=16)
    for d in sorted(digests):
        h.update(d)
    return "carried-" + h.hexdigest()


def _writes() -> bool:
    """Whether this process writes: rank 0 of a process group (or of ``RANK``), or a process without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") in ("", "0")


_WARNED: set[Any] = set()


def _warn_once(what: Any, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def write(entry: Entry, ledger: PrivacyLedger) -> None:
    """Write ``entry`` with ``ledger`` (its record) as one file of the store, atomically, then keep the newest
    :data:`KEPT`; nothing when the store is off, on a rank other than 0, or when there is nothing to find."""
    where = directory()
    if where is None or not ledger.steps or not (entry.digests or entry.sketches) or not _writes():
        return
    state = {
        "version": _VERSION, "created": float(entry.created), "ledger": ledger.state_dict(),
        "trained": list(entry.trained), "digests": sorted(d.hex() for d in entry.digests),
        "sketches": [[list(shape), start, end, torch.stack(path)] for shape, kept in entry.sketches.items()
                     for start, end, path in kept],
    }
    save_file(where, f"{entry.key}{SUFFIX}", state, SUFFIX, None,
              "weights trained here are not found by their record in a new process")


def save_file(where: Path, name: str, state: dict, suffix: str, kept: Optional[int], lost: str) -> None:
    """Write ``state`` as the store's file ``name``, atomically (a temporary file, then ``os.replace``), then keep the
    newest ``kept`` files of ``suffix`` (:func:`_prune`). A failed write warns once, saying what is ``lost``."""
    tmp = where / f".tmp-{uuid.uuid4().hex}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with open(tmp, "wb") as out:
            out.write(buffer.getvalue())
        os.replace(tmp, where / name)
        _prune(where, suffix, kept)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        _warn_once(("write", str(where)), f"The ledger store {where} cannot be written ({type(error).__name__}): "
                   f"{lost}. Set {ENV} to a writable directory (or to 'off').")


def _prune(where: Path, suffix: str = SUFFIX, kept: Optional[int] = None) -> None:
    """Remove all but the newest ``kept`` (:data:`KEPT`) files of ``suffix``."""
    files = sorted(_listing(where, suffix).items(), key=lambda item: item[1], reverse=True)
    for name, _ in files[KEPT if kept is None else kept:]:
        try:
            (where / name).unlink()
        except OSError:
            pass


def _listing(where: Path, suffix: str = SUFFIX) -> dict[str, tuple[int, int]]:
    """The store's files (of ``suffix``) → (modification time in ns, size)."""
    out: dict[str, tuple[int, int]] = {}
    try:
        with os.scandir(where) as found:
            for item in found:
                if item.name.endswith(suffix) and item.is_file():
                    stat = item.stat()
                    out[item.name] = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        pass
    return out


_CACHE: dict[str, Any] = {"where": None, "stamps": {}, "loaded": {}, "stored": Stored()}


def read() -> Stored:
    """The store's entries as lookups (:class:`Stored`), newest last (a digest two entries hold is the newest's,
    as the latest mark is in one process); loaded once per process and again for the files that changed."""
    where = directory()
    if where is None:
        return Stored()
    stamps = _listing(where)
    if _CACHE["where"] == where and _CACHE["stamps"] == stamps:
        return _CACHE["stored"]
    loaded = _CACHE["loaded"] if _CACHE["where"] == where else {}
    loaded = {name: loaded[name] for name in stamps if name in loaded and loaded[name][0] == stamps[name]}
    for name, stamp in stamps.items():
        if name not in loaded:
            loaded[name] = (stamp, _load(where / name))
    stored = Stored()
    for _, parsed in sorted((item for item in loaded.values() if item[1] is not None), key=lambda i: i[1][0]):
        _, ledger, digests, sketches = parsed
        for d in digests:
            stored.by_content[d] = ledger
        for shape, start, end, path in sketches:
            stored.sketches.setdefault(shape, []).append((start, end, ledger, path))
    _CACHE.update(where=where, stamps=stamps, loaded=loaded, stored=stored)
    return stored


def load_versioned(path: Path, version: Union[int, tuple[int, ...]], what: str) -> tuple[dict, PrivacyLedger]:
    """The store's file ``path`` loaded (tensors only) with its ledger; raises ``ValueError`` unless it is ``what``
    (a dict) of ``version`` (or one of them: older versions still read). The one reading of this module's entries and
    of accounting/data_store.py's records."""
    versions = version if isinstance(version, tuple) else (version,)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("version") not in versions:
        raise ValueError(f"not {what} of this version")
    ledger = PrivacyLedger()
    ledger.load_state_dict(state["ledger"])
    return state, ledger


def _load(path: Path) -> Optional[tuple[float, PrivacyLedger, list[bytes], list[tuple[Any, ...]]]]:
    """One file of the store parsed, ``None`` (with a warning) when it cannot be read or is not an entry."""
    try:
        state, ledger = load_versioned(path, _VERSION, "a ledger store entry")
        digests = [bytes.fromhex(d) for d in state["digests"]]
        sketches = []
        for shape, start, end, path_states in state["sketches"]:
            tensors = (start, end, path_states)
            if not all(isinstance(t, Tensor) and t.dtype == torch.float64 for t in tensors) or path_states.ndim != 2 \
                    or not start.shape == end.shape == path_states.shape[1:]:
                raise ValueError("malformed sketches")
            sketches.append((tuple(int(n) for n in shape), start, end, tuple(path_states.unbind(0))))
        return float(state["created"]), ledger, digests, sketches
    except Exception as error:  # noqa: BLE001 - a damaged file is skipped, never a crash
        _warn_once(("read", str(path), path.stat().st_mtime_ns if path.exists() else 0),
                   f"Skipped the ledger store's file {path} ({type(error).__name__}): it cannot be read as a "
                   "record of trained weights. Delete it, or ignore this if no weights it recorded are used.")
        return None
