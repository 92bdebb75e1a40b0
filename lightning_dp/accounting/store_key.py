"""The ledger store's secret key: the data records' row digests are written keyed, so the store is no membership test.

A data record (:mod:`~lightning_dp.accounting.data_store`) identifies the records a fit read by their row digests
(:func:`~lightning_dp.record_checks.stored_records.row_digests` and the other kinds of
:mod:`~lightning_dp.accounting.data_ledgers`): deterministic functions of a row with public constants. Written as they
are, whoever reads the store recomputes them for a candidate row and learns whether it was trained on, and rebuilds
rows of few enough values by enumeration. So every digest the store holds is :func:`keyed`: BLAKE2b keyed with a
secret of this machine (32 bytes of ``secrets.token_bytes``), over the row's digest, 8 bytes kept. Without the key the
stored values are unrelated to any row one can compute; with it, the same records still give the same values, so a
later fit on this machine (or any process that reads the same key) continues the ledger as before.

Where: the file :data:`FILE` in the store's directory (the key lives with the store: a store on a file system that
several nodes of one job share has one key), or the file ``$LIGHTNING_DP_LEDGER_KEY`` (:data:`ENV`) names — for a
store in a directory others can read, keep the key where only you can. Created on first use with mode 0600,
atomically (``O_CREAT | O_EXCL``: of processes racing to create it one writes it and the others read it), read
afterwards. Each data record names the key it was written under (:func:`key_id`, a keyed digest of a constant: it
reveals nothing of the key): a record of another key (the key file deleted or replaced) is skipped with a warning.

What it does not protect: whoever can read the key file can test membership as before (keep it, as the data, readable
by the data's owner only); the store still shows how many records each fit read (one digest per record and kind) and
how many fits there were. A key that cannot be read or created (a directory that cannot be written, another user's
key) stops the data records only, with a warning: nothing is written, and stored ones are not matched.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path
from typing import Optional

import numpy as np

import lightning_dp.accounting.ledger_store as ledger_store

ENV = "LIGHTNING_DP_LEDGER_KEY"
"""The environment variable naming the key file (default: :data:`FILE` in the store's directory)."""
FILE = "records.key"
"""The key file's name in the store's directory."""
SIZE = 32
"""The key's bytes."""
_PERSON = b"ldp-rows"
_WAIT = 2.0
"""Seconds a process waits for another that created the key file to finish writing it."""

_KEYS: dict[str, tuple[tuple[int, int, int], bytes]] = {}
"""path → ((device, inode, modification time), key) of the key files read in this process."""


class KeyUnavailable(OSError):
    """The store's key can be neither read nor created (the message names the file and the fix)."""


def path() -> Optional[Path]:
    """The key file (module docstring); ``None`` when the store is off."""
    named = os.environ.get(ENV, "").strip()
    if named:
        return Path(named).expanduser()
    where = ledger_store.directory()
    return None if where is None else where / FILE


def key() -> bytes:
    """The store's key: read from :func:`path`, created there first when there is none (module docstring).

    Raises:
        KeyUnavailable: it can be neither read nor created.
    """
    where = path()
    if where is None:
        raise KeyUnavailable("the ledger store is off: no key")
    try:
        return _read(where)
    except FileNotFoundError:
        pass
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(where, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:  # another process created it first: read it once it is written
        return _read(where, wait=True)
    except OSError as error:
        raise _unavailable(where, error) from error
    fresh = secrets.token_bytes(SIZE)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(fresh)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        raise _unavailable(where, error) from error
    return _read(where)


def _read(where: Path, wait: bool = False) -> bytes:
    """The key in ``where`` (cached while the file is unchanged). A file shorter than a key is being written by the
    process that created it: waited for up to :data:`_WAIT` seconds; ``wait``: a file not found is waited for too
    (created by another process, then removed)."""
    deadline = time.monotonic() + _WAIT
    while True:
        try:
            stat = where.stat()
        except FileNotFoundError:
            if not wait:
                raise
            stat = None
        except OSError as error:
            raise _unavailable(where, error) from error
        if stat is not None:
            stamp = (stat.st_dev, stat.st_ino, stat.st_mtime_ns)
            cached = _KEYS.get(str(where))
            if cached is not None and cached[0] == stamp and stat.st_size == SIZE:
                return cached[1]
            try:
                data = where.read_bytes()
            except OSError as error:
                raise _unavailable(where, error) from error
            if len(data) == SIZE:
                _KEYS[str(where)] = (stamp, data)
                return data
            if len(data) > SIZE or time.monotonic() > deadline:
                raise _unavailable(where, ValueError(f"it holds {len(data)} bytes, not {SIZE}"))
        elif time.monotonic() > deadline:
            raise _unavailable(where, FileNotFoundError("it was removed while being created"))
        time.sleep(0.01)


def _unavailable(where: Path, error: BaseException) -> KeyUnavailable:
    return KeyUnavailable(
        f"the ledger store's key {where} cannot be read or created ({type(error).__name__}: {error}). Make it "
        f"readable by you (it is created with mode 0600 by its first user), or set {ENV} to a key file of your own "
        f"(a new one is created there), or set {ledger_store.ENV}=off")


def keyed(digests: np.ndarray, secret: bytes) -> np.ndarray:
    """``digests`` (uint64) under ``secret``: each the first 8 bytes of BLAKE2b keyed with it over the digest's 8
    bytes (a pseudo-random function of the digest: without the key, unrelated to it). uint64, in the same order."""
    values = np.ascontiguousarray(digests, dtype=np.uint64)
    if not len(values):
        return values.copy()
    base = hashlib.blake2b(key=secret, digest_size=8, person=_PERSON)
    raw = values.astype("<u8").tobytes()
    out = []
    for start in range(0, len(raw), 8):  # ~0.55 µs a digest: copying the keyed state skips the key's block
        h = base.copy()
        h.update(raw[start:start + 8])
        out.append(h.digest())
    return np.frombuffer(b"".join(out), dtype="<u8").astype(np.uint64)


def key_id(secret: bytes) -> str:
    """A name of ``secret`` written with each record (a keyed digest of a constant: nothing of the key)."""
    return hashlib.blake2b(b"lightning_dp ledger store key", key=secret, digest_size=8, person=b"ldp-kid").hexdigest()


def secret() -> Optional[bytes]:
    """:func:`key`, or ``None`` with a warning (once per key file) when it is unavailable: the data records are then
    neither written nor matched."""
    try:
        return key()
    except KeyUnavailable as error:
        ledger_store._warn_once(("key", str(path())), f"The ledger store's data records are not used: {error}. "
                                "Earlier processes' fits on this fit's records are not found, and this fit's are not "
                                "written for later ones.")
        return None
