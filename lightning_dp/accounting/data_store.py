"""The data's record in the ledger store: the releases made on each training dataset, so a new process finds them.

:mod:`~lightning_dp.accounting.data_ledgers` keeps, in one process, each private fit's ledger against the records it
read. k-fold cross-validation run one fold per process (a job per fold, a notebook restarted between folds) would
start each fold with none of the others' releases. So at the end of each fit (the strategy's teardown, a failed fit's
too: its releases were made) the fit's *data record* is written beside the module records of
:mod:`~lightning_dp.accounting.ledger_store`, in the same directory (``LIGHTNING_DP_LEDGER_STORE``; ``off``: none is
written or read): one file per fit (:data:`SUFFIX`), holding the row digests that identify its records (8 bytes per
record and kind of digest: never a value of the data), each keyed under the store's secret key
(:mod:`~lightning_dp.accounting.store_key`: without the key the file is no membership test of a candidate row), the
key's name, and the ledger's ``state_dict`` (σ, q, steps and runs of its releases). A later fit in any process on
this machine whose records share :data:`~.data_ledgers.OVERLAP` with a stored record's continues its ledger, each
fit's releases once (by run, as in one process).

Bounded: at most :data:`MAX_DIGESTS` digests per file (2 MiB): a larger population keeps the digests of a fixed
pseudo-random sample of its records (the digests under a threshold after mixing, stored with the file), and a later
fit is compared on the same sample of its own; the newest :data:`KEPT` files are kept (64 MiB at most; a fit per user
adds its partition into users, :mod:`~.unit_partitions`, up to 3 MiB more, and none when its digests are sampled:
a later fit per user is then charged the worst case), older ones removed. Written by rank 0 alone; an unreadable
file is skipped with a warning.

What a later process does with them is :data:`ENV` (``LIGHTNING_DP_DATA_RECORDS``): ``warn`` (the default) names
the earlier processes' fits on these records in a warning and leaves them out of the fit's ledger — a run done again
after a fix, whose first model was thrown away, is the common case, and the library cannot tell it from a kept one;
``compose`` continues their releases as in one process (one fold per process composes; ε, ``target_epsilon`` and
``PrivacyBudget`` count them).

Earlier versions' records (1 and 2, :data:`_VERSION`: digests as computed, unkeyed) are read as before — keyed when
read, so they match as they did — and written again in their place keyed. A record of another key is skipped with a
warning. Still shown by the files: how many records each fit read, how many fits, their ledgers.

Not seen: a fit whose process was killed before its teardown, a store turned off, cleared (``forget_data_releases``)
or pruned past :data:`KEPT` fits, another machine's store.
"""

from __future__ import annotations

import ast
import os
import time
from typing import Any, Optional

import numpy as np
import torch

import lightning_dp.accounting.ledger_store as ledger_store
import lightning_dp.accounting.store_key as store_key
import lightning_dp.accounting.unit_partitions as unit_partitions
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError

SUFFIX = ".records"
"""The data records' files (the module records' are ``.ledger``)."""
KEPT = 32
"""The most data records the store keeps: the newest fits'."""
MAX_DIGESTS = 1 << 18
"""The most row digests one data record holds (all its kinds together)."""
_VERSION = 3
"""3: the digests keyed (:mod:`~.store_key`), with the key's name; 2: with the partition of a fit per user's records
into users (:mod:`~.unit_partitions`), digests as they are; 1 (without) is read as a partition not known. A record of
1 or 2 is read, keyed, and written again as 3 (:func:`_migrated`)."""
ENV = "LIGHTNING_DP_DATA_RECORDS"
"""What a fit does with earlier processes' data records on its records: ``warn`` (default) or ``compose``."""


def composes() -> bool:
    """Whether earlier processes' fits on the same records are continued in a fit's ledger (:data:`ENV` is
    ``compose``) rather than named in a warning (``warn``, the default). Any other value is refused."""
    mode = os.environ.get(ENV, "warn").strip().lower() or "warn"
    if mode not in ("warn", "compose"):
        raise PrivacyConfigurationError(f"{ENV}={mode!r}: expected 'warn' (the default: earlier processes' fits on "
                                        "the same records are named in a warning) or 'compose' (their releases "
                                        "are continued in the fit's ledger).")
    return mode == "compose"

Record = tuple[str, dict[tuple, np.ndarray], Optional[int], PrivacyLedger, Optional[unit_partitions.Partition]]
"""(key, digests per kind — keyed, :func:`~.store_key.keyed` —, the sample's threshold — ``None``: every record —,
the ledger, the partition of its records into users — ``None``: a fit per example's, or not known)."""


def sampled(digests: np.ndarray, limit: Optional[int]) -> np.ndarray:
    """The ``digests`` in the sample of threshold ``limit`` (``None``: all): those whose mixed high 32 bits are under
    it (splitmix64's finaliser: a fixed pseudo-random choice of records, the same in every process). Taken of the
    digests as computed, before they are keyed: a stored record keeps the keyed digests of its sample."""
    return digests if limit is None else digests[in_sample(digests, limit)]


def in_sample(digests: np.ndarray, limit: int) -> np.ndarray:
    """Which of ``digests`` are in the sample of threshold ``limit`` (:func:`sampled`), as a boolean mask."""
    with np.errstate(over="ignore"):
        z = digests.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(32)) < np.uint64(limit)


def write(key: str, digests: dict[tuple, np.ndarray], ledger: PrivacyLedger,
          partition: Optional[unit_partitions.Partition] = None) -> None:
    """Write the data record ``key`` (its fit's row digests, ledger and, for a fit per user, the partition of its
    records into users: kept only when every digest is, else a later fit per user is charged the worst case),
    atomically, then keep the newest :data:`KEPT`; nothing when the store is off, on a rank other than 0, or when
    there is nothing to find."""
    where = ledger_store.directory()
    total = sum(len(d) for d in digests.values())
    if where is None or not ledger.steps or not total or not ledger_store._writes():
        return
    secret = store_key.secret()
    if secret is None:
        return
    limit = None if total <= MAX_DIGESTS else int((1 << 32) * MAX_DIGESTS / total)
    keep = partition if limit is None and partition is not None and partition.size() <= MAX_DIGESTS else None
    state = {"version": _VERSION, "key": store_key.key_id(secret), "created": time.time(),
             "ledger": ledger.state_dict(), "limit": -1 if limit is None else limit,
             "partition": unit_partitions.to_state(keep, secret),
             "digests": [[repr(kind), _tensor(store_key.keyed(sampled(d, limit), secret))]
                         for kind, d in digests.items()]}
    ledger_store.save_file(where, f"{key}{SUFFIX}", state, SUFFIX, KEPT,
                           "the releases made on this fit's records are not found by a fit in a new process")


def _tensor(digests: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(digests, dtype=np.uint64).view(np.int64))


_CACHE: dict[str, Any] = {"where": None, "loaded": {}}


def read() -> list[Record]:
    """The store's data records (:data:`Record`), oldest first; loaded once per process and again for the files that
    changed."""
    where = ledger_store.directory()
    if where is None:
        return []
    stamps = ledger_store._listing(where, SUFFIX)
    if not stamps:
        return []
    secret = store_key.secret()
    if secret is None:
        return []
    loaded = _CACHE["loaded"] if _CACHE["where"] == (where, secret) else {}
    loaded = {name: loaded[name] for name in stamps if name in loaded and loaded[name][0] == stamps[name]}
    for name, stamp in stamps.items():
        if name not in loaded:
            parsed = _load(where, name, secret)
            if parsed is not None and parsed[2]:  # an earlier version's, its digests unkeyed: written again, keyed
                stamp = _migrated(where, name, parsed, secret, stamp)
            loaded[name] = (stamp, parsed)
    _CACHE.update(where=(where, secret), loaded=loaded)
    found = [parsed[:2] for _, parsed in loaded.values() if parsed is not None]
    return [record for _, record in sorted(found, key=lambda item: item[0])]


class _OtherKey(ValueError):
    """A record written under another key than this store's (:mod:`~.store_key`)."""


def _load(where: Any, name: str, secret: bytes) -> Optional[tuple[float, Record, bool]]:
    """The data record ``name`` (its creation time, :data:`Record`, and whether it is of an earlier version, its
    digests written unkeyed: keyed here); ``None`` with a warning when it cannot be read."""
    path = where / name
    try:
        state, ledger = ledger_store.load_versioned(path, (1, 2, _VERSION), "a data record")
        old = state["version"] < 3
        if not old and state.get("key") != store_key.key_id(secret):
            raise _OtherKey()
        digests = {}
        for kind, values in state["digests"]:
            if not isinstance(values, torch.Tensor) or values.dtype != torch.int64 or values.ndim != 1:
                raise ValueError("malformed digests")
            found = values.numpy().view(np.uint64)
            digests[ast.literal_eval(kind)] = np.unique(store_key.keyed(found, secret) if old else found)
        limit = int(state["limit"])
        partition = unit_partitions.from_state(state.get("partition"), keyed=not old)  # version 1: none kept
        if old and partition is not None:
            partition = unit_partitions.stored_form(partition, secret)
        record = (name[:-len(SUFFIX)], digests, None if limit < 0 else limit, ledger, partition)
        return float(state["created"]), record, old
    except _OtherKey:
        ledger_store._warn_once(("key", str(path)), f"Skipped the ledger store's file {path}: its digests are keyed "
                                f"with another key than {store_key.path()} (the key file was replaced or removed, or "
                                f"{store_key.ENV} names another). Its fit's records are not found: point "
                                f"{store_key.ENV} at the key it was written with, or delete the file.")
        return None
    except Exception as error:  # noqa: BLE001 - a damaged file is skipped, never a crash
        ledger_store._warn_once(("read", str(path)), f"Skipped the ledger store's file {path} "
                                f"({type(error).__name__}): it cannot be read as a data record. Delete it, or ignore "
                                "this if its fits' records are not trained on again.")
        return None


def _migrated(where: Any, name: str, parsed: tuple[float, Record, bool], secret: bytes,
              stamp: tuple[int, int]) -> tuple[int, int]:
    """Write the data record ``name`` of an earlier version (its digests unkeyed), read as ``parsed`` (keyed by
    :func:`_load`), again as :data:`_VERSION` in its place (rank 0; its modification time kept: the newest
    :data:`KEPT` stay the same); returns the file's stamp now (``stamp`` when it was not written)."""
    created, (_, digests, limit, ledger, partition), _ = parsed
    path = where / name
    if not ledger_store._writes():
        return stamp
    state = {"version": _VERSION, "key": store_key.key_id(secret), "created": created,
             "ledger": ledger.state_dict(), "limit": -1 if limit is None else limit,
             "partition": unit_partitions.to_state(partition, secret),
             "digests": [[repr(kind), _tensor(d)] for kind, d in digests.items()]}
    ledger_store.save_file(where, name, state, SUFFIX, None, "an earlier version's data record stays unkeyed")
    try:
        os.utime(path, ns=(time.time_ns(), stamp[0]))
        return ledger_store._listing(where, SUFFIX).get(name, stamp)
    except OSError:
        return stamp


def remove(keys: Optional[set[str]] = None) -> int:
    """Delete the data records ``keys`` (``None``: every one); returns how many were deleted."""
    where = ledger_store.directory()
    if where is None:
        return 0
    removed = 0
    for name in ledger_store._listing(where, SUFFIX):
        if keys is None or name[:-len(SUFFIX)] in keys:
            try:
                (where / name).unlink()
                removed += 1
            except OSError:
                pass
    return removed
