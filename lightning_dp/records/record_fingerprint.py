"""A record's fingerprint: a stable digest of its content, and where its arrays live in memory.

The digest is BLAKE2b-128 of a canonical encoding: each value is written with a tag of its kind and,
for containers, its length, so two records share a digest only if they are equal value for value
(up to a 2⁻⁶⁴ birthday chance over a whole dataset):

    tensor, ndarray       dtype, shape, then the bytes of its elements in logical order (any device,
                          any strides: a view and a copy of the same values agree)
    numpy scalar          dtype and bytes
    bytes, str            the bytes (str as UTF-8)
    bool, int, float,     the type and ``repr`` (exact for floats), so ``1``, ``1.0`` and ``True`` differ
    complex, None
    tuple, list           the type (a namedtuple's name too) and each item in order
    dict, Mapping, set    the (key, value) pairs, or the items, in the order of their own digests
    PIL image             mode, size and pixel bytes
    other object          its class and ``vars()`` (a dataclass, a simple record class)

Anything else (an object with ``__slots__`` only, a file handle, nesting deeper than
:data:`MAX_DEPTH`) has no fingerprint: :func:`fingerprint` returns ``None`` and the checks that need
one skip the dataset rather than guess.

A record's **places** say where its tensor and array leaves that are views into a larger buffer live
(buffer address, offset, shape, strides, dtype), with the buffers themselves (``owners``) so that
they stay allocated while fingerprints are compared. Two records with equal digests and equal places
are the same memory read twice: ``data[i % n]`` over an in-memory tensor, never two records that
merely look alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

MAX_DEPTH = 16
"""Deepest nesting of containers fingerprinted (deeper: no fingerprint)."""


@dataclass(frozen=True)
class Fingerprint:
    """One record's content digest and the places of its views (see the module docstring).

    Attributes:
        digest: BLAKE2b-128 of the record's canonical encoding.
        places: one key per tensor/array leaf that is a view into a larger buffer, in reading order.
        owners: the buffers of those views (kept alive with the fingerprint), one per place.
        nbytes: bytes of tensor, array, bytes and str data digested (the cost of the digest).
    """

    digest: bytes
    places: tuple[tuple[Any, ...], ...]
    owners: tuple[Any, ...]
    nbytes: int


class _Opaque(Exception):
    """A value :func:`fingerprint` cannot encode canonically."""


def fingerprint(record: Any) -> Optional[Fingerprint]:
    """The record's :class:`Fingerprint`, or ``None`` if some part of it has no canonical encoding."""
    return _fingerprint(record, _Counted())


def near_digest(record: Any, offset: float) -> Optional[bytes]:
    """A digest of the record with each floating-point tensor or array of at least :data:`NEAR_VALUES` values
    rounded to a grid: steps of the power of two at or below :data:`NEAR_SCALE` × its root mean square, shifted by
    ``offset`` steps. Two records equal but for a perturbation well under the grid's step (a copy with jitter added)
    share it on a grid where no value of theirs straddles a step (of two grids offset by half a step, almost always
    one); ``None`` as for :func:`fingerprint`."""
    found = _fingerprint(record, _Counted(offset))
    return None if found is None else found.digest


NEAR_SCALE = 1e-3
NEAR_VALUES = 4


def _fingerprint(record: Any, hasher: "_Counted") -> Optional[Fingerprint]:
    places: list[tuple[Any, ...]] = []
    owners: list[Any] = []
    try:
        _feed(record, hasher, places, owners, 0)
    except _Opaque:
        return None
    return Fingerprint(hasher.digest(), tuple(places), tuple(owners), hasher.nbytes)


class _Counted:
    """BLAKE2b-128 that counts the bytes it is fed."""

    def __init__(self, offset: Optional[float] = None) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.nbytes = 0
        self.offset = offset  # rounding floats to a grid shifted by this many steps (near_digest), or not

    def update(self, data: Any) -> None:
        self._hash.update(data)
        self.nbytes += memoryview(data).nbytes

    def digest(self) -> bytes:
        return self._hash.digest()


def _feed(value: Any, h: "_Counted", places: list, owners: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Opaque
    if isinstance(value, torch.Tensor):
        _feed_tensor(value, h, places, owners)
    elif isinstance(value, np.ndarray):
        _feed_array(value, h, places, owners, depth)
    elif isinstance(value, np.generic):
        h.update(b"n" + value.dtype.str.encode() + value.tobytes())
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        h.update(b"B%d:" % len(data) + data)
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(data) + data)
    elif value is None or isinstance(value, (bool, int, float, complex)):
        h.update(f"P{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (tuple, list)):
        h.update(f"L{type(value).__name__}:{len(value)}(".encode())
        for item in value:
            _feed(item, h, places, owners, depth + 1)
        h.update(b")")
    elif isinstance(value, Mapping):
        _feed_unordered([(k, v) for k, v in value.items()], b"M", h, places, owners, depth)
    elif isinstance(value, Set):
        _feed_unordered(list(value), b"U", h, places, owners, depth)
    elif type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes"):
        h.update(f"I{value.mode}:{value.size}:".encode() + value.tobytes())
    elif hasattr(value, "__dict__") and not callable(value):
        h.update(f"O{type(value).__module__}.{type(value).__qualname__}".encode())
        _feed(vars(value), h, places, owners, depth + 1)
    else:
        raise _Opaque


def _feed_tensor(t: torch.Tensor, h: "_Counted", places: list, owners: list) -> None:
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise _Opaque
    h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
    if h.offset is not None and t.is_floating_point() and t.numel() >= NEAR_VALUES:
        h.update(_on_grid(t.cpu().double().numpy(), h.offset))
        return
    if t.device.type == "cpu" and t.numel():
        storage = t.untyped_storage()
        if storage.nbytes() > t.numel() * t.element_size():  # a view into a larger buffer
            places.append(("T", storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                           t.dtype))
            owners.append(storage)
    h.update(t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _feed_array(a: np.ndarray, h: "_Counted", places: list, owners: list, depth: int) -> None:
    if a.dtype.hasobject:
        h.update(f"A{a.shape}".encode())
        for item in a.reshape(-1):
            _feed(item, h, places, owners, depth + 1)
        return
    h.update(f"N{a.dtype.str}{a.shape}".encode())
    if h.offset is not None and a.dtype.kind == "f" and a.size >= NEAR_VALUES:
        h.update(_on_grid(a.astype(np.float64), h.offset))
        return
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root is not a and a.size and root.nbytes > a.nbytes:  # a view into a larger buffer
        places.append(("N", a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str))
        owners.append(root)
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _on_grid(values: np.ndarray, offset: float) -> bytes:
    """``values`` as steps of the grid :func:`near_digest` describes (int64 bytes)."""
    finite = values[np.isfinite(values)]  # the scale of the record's finite values (a missing value, an inf: apart)
    rms = float(np.sqrt(np.mean(np.square(finite.astype(np.float64))))) if finite.size else 0.0
    step = 2.0 ** np.floor(np.log2(NEAR_SCALE * rms)) if rms > 0 and np.isfinite(rms) else 1.0
    grid = np.floor(values.reshape(-1) / step + offset)
    grid = np.nan_to_num(grid, nan=-(2.0 ** 62), posinf=2.0 ** 62, neginf=-(2.0 ** 62) + 1024)  # inf, NaN: apart
    return np.clip(grid, -(2.0 ** 62), 2.0 ** 62).astype(np.int64).tobytes() + repr(step).encode()


def _feed_unordered(items: list, tag: bytes, h: "_Counted", places: list, owners: list, depth: int) -> None:
    """Items whose order carries no meaning (a mapping's pairs, a set's members): each digested alone, in the order
    of their digests."""
    parts = []
    for item in items:
        sub = _Counted(h.offset)
        _feed(item, sub, places, owners, depth + 1)
        parts.append(sub.digest())
        h.nbytes += sub.nbytes
    h.update(tag + b"%d:" % len(parts) + b"".join(sorted(parts)))
