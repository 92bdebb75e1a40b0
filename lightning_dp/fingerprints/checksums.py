"""Tokens of contents: what the kept-state fingerprint compares of a tensor, an array or a byte container.

Tensors' content checksums (float64 Σx, Σx², Σ (1 + j mod 251)·x_j; :func:`content_sums`), cached by identity,
storage and version counter (:class:`Checksums`); the contents of parameters and floating buffers compared every step
(:func:`norm_tokens`): on the CPU bit for bit against a copy (:class:`_Contents`), on an accelerator by their L2 norms
by one fused reduction (kept on their device: :class:`_DeviceNorms`); digests of NumPy arrays (:func:`numpy_token`,
:func:`_array_digest`) and of mutable byte containers and streams (:func:`_raw_token`); the bytes of a storage
that the state's tensors reach beyond their views (:func:`beyond_views`).
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import hashlib
import io
import itertools
import operator
import os
import weakref
from itertools import repeat
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dp.records.library_code import installed_class
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint

class Checksums:
    """Content checksums of tensors, cached by (identity, storage, version counter): unchanged tensors cost a
    dictionary lookup; changed ones one float64 reduction each, gathered with one host copy per device."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, tuple[Any, ...], bytes]] = {}  # id → (weak reference, key, checksum)
        self.masks: dict[tuple[Any, ...], Optional[Tensor]] = {}  # beyond_views': a storage's bytes no view covers
        self.covering: Optional[tuple[list[Tensor], tuple[list[int], list[Any]]]] = None  # beyond_views': tensors
        # last found each covering its whole storage, with their addresses and shapes then
        self.snapshots: dict[tuple[Any, ...], _Snapshot] = {}
        self.layouts: dict[tuple[torch.device, torch.dtype], _GroupLayout] = {}  # norm_tokens' groups, as last seen
        """The last copy of the contents of each group of tensors (:func:`norm_tokens`), by the group's layout: a
        fingerprint finding the tensors' bits still those of the copy holds the copy again instead of a new one."""

    @staticmethod
    def key(t: Tensor) -> tuple[Any, ...]:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.layout != torch.strided:  # sparse: no storage of its own to key on, so never taken as unchanged
            return (id(t), object(), t._version, tuple(t.shape), t.dtype)
        return (id(t), local.data_ptr() if local.numel() else 0, t._version, tuple(t.shape), t.dtype)

    def tokens(self, tensors: Sequence[Tensor], full: bool) -> list[Hashable]:
        keys = [self.key(t) for t in tensors]
        todo = [i for i, (t, k) in enumerate(zip(tensors, keys)) if full or not self._fresh(t, k)]
        for i, value in zip(todo, content_sums([tensors[i] for i in todo]) if todo else ()):
            self._cache[id(tensors[i])] = (weakref.ref(tensors[i]), keys[i], value)
        return [(k[3], str(k[4]), self._cache[id(t)][2]) for t, k in zip(tensors, keys)]

    def _fresh(self, t: Tensor, key: tuple[Any, ...]) -> bool:
        """A cached checksum of this very tensor (not a new one at a reused address) at this version."""
        cached = self._cache.get(id(t))
        return cached is not None and cached[0]() is t and cached[1] == key

    def forget(self) -> None:
        self._cache.clear()
        self.snapshots.clear()
        self.layouts.clear()
        self.masks.clear()
        self.covering = None


def content_sums(tensors: Sequence[Tensor]) -> list[bytes]:
    """(Σx, Σx², Σ w_j x_j) in float64 per tensor, w_j = 1 + (j mod 251): a write of any value shows, and a
    permutation of values mostly does too."""
    out: list[Optional[bytes]] = [None] * len(tensors)
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            local = t.to_local() if hasattr(t, "to_local") else t
            x = _flat_contents(local.detach())
            if x.numel() == 0:
                stats = torch.zeros(3, dtype=torch.float64, device=x.device)
            else:
                weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64).remainder_(251).add_(1)
                stats = torch.stack([x.sum(), x.square().sum(), (x * weights).sum()])
            by_device.setdefault(stats.device, []).append((i, stats))
        for items in by_device.values():
            host = torch.stack([s for _, s in items]).cpu().numpy()
            for (i, _), row in zip(items, host):
                out[i] = row.tobytes()
    return [b for b in out if b is not None]


def _flat_contents(x: Tensor) -> Tensor:
    """``x``'s numbers as one float64 vector: a strided tensor's elements (complex as pairs), a sparse tensor's indices
    then values (a sparse adjacency kept by a graph model: no dense copy)."""
    if x.layout != torch.strided:
        coo = x if x.layout == torch.sparse_coo else x.to_sparse_coo()
        return torch.cat([coo._indices().reshape(-1).to(torch.float64), _flat_contents(coo._values())])
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.reshape(-1).to(torch.float64)


def beyond_views(named: Sequence[tuple[str, Tensor]], sums: Optional[Checksums] = None) -> Fingerprint:
    """The memory the state's tensors reach beyond their views: a buffer or parameter that is a view of a larger
    storage (``register_buffer("scale", torch.zeros(16)[:4])``, ``nn.Parameter(big[:4])``, a tensor ``set_`` onto a
    larger storage) holds bytes no element of it covers, which ``as_strided(..., offset)`` or ``untyped_storage()``
    read and write; the contents of the tensors are compared elsewhere, not these bytes. One entry per such storage
    (``"storage of buffer scale beyond its view"``, named by its first tensor) holding a digest of the bytes that no
    tensor of ``named`` covers (a storage shared by several of them, as a flattened RNN's weights: only what none of
    them covers). A tensor that covers its whole storage costs a size comparison (the usual case: no entry);
    a sparse, distributed or meta tensor is not read. ``sums``: where the masks of covered bytes are kept
    (:attr:`Checksums.masks`), reused while the storage holds the same views, and the tensors last found each
    covering its whole storage: the same tensors again at the same addresses with the same shapes cost two C loops
    (a storage grown or a tensor ``set_`` onto another moves its address or its shape)."""
    tensors = list(map(_TENSOR, named))
    try:
        places = (list(map(Tensor.data_ptr, tensors)), list(map(_SHAPE, tensors)))
    except RuntimeError:  # a sparse tensor (no storage of its own): each one read below
        places = None
    kept = sums.covering if sums is not None and places is not None else None
    if kept is not None and kept[1] == places and len(kept[0]) == len(tensors) \
            and all(map(operator.is_, tensors, kept[0])):
        return {}  # the same tensors at the same places with the same shapes, each its whole storage as last time
    partial: dict[int, list[tuple[str, Tensor]]] = {}
    whole: list[tuple[str, Tensor]] = []
    for name, t in named:
        if t.layout != torch.strided or hasattr(t, "to_local") or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        size = storage.nbytes()
        if t.storage_offset() == 0 and size == t.numel() * t.element_size() and t.is_contiguous():
            whole.append((name, t))  # its view is its storage (a view sharing it with a partial one: seen below)
            continue
        partial.setdefault(storage.data_ptr(), []).append((name, t))
    if not partial:
        if sums is not None and places is not None:
            sums.covering = (tensors, places)  # (held: no id of theirs is reused while kept)
        return {}
    for name, t in whole:  # a tensor covering a storage another one only partly covers
        held = partial.get(t.untyped_storage().data_ptr())
        if held is not None:
            held.append((name, t))
    out: Fingerprint = {}
    with torch.no_grad():
        for views in partial.values():
            storage = views[0][1].untyped_storage()
            outside = _outside(views, storage.nbytes(), sums)
            if outside is None:
                continue  # the views together cover it all (a transposed weight, a flattened RNN's weights)
            raw = torch.empty(0, dtype=torch.uint8, device=outside.device).set_(storage)
            out[f"storage of {views[0][0]} beyond its view"] = (storage.nbytes(), _digest(raw[outside].cpu().numpy()))
    return out


def _outside(views: Sequence[tuple[str, Tensor]], nbytes: int, sums: Optional[Checksums]) -> Optional[Tensor]:
    """A bool mask, on the views' device, of the bytes of a storage of ``nbytes`` bytes that none of ``views``
    covers (every byte when a view's elements do not line up with the storage's bytes), ``None`` when they cover
    every byte; kept in ``sums`` by the views' layouts."""
    device = views[0][1].device
    key = (device, nbytes, *((t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) for _, t in views))
    if sums is not None and key in sums.masks:
        return sums.masks[key]
    covered = torch.zeros(nbytes, dtype=torch.bool)
    for _, t in views:
        size = t.element_size()
        if nbytes % size:
            covered.zero_()
            break
        elements = torch.zeros(nbytes // size, dtype=torch.bool)
        elements.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(True)
        covered |= elements.repeat_interleave(size)
    outside = None if bool(covered.all()) else (~covered).to(device)
    if sums is not None:
        sums.masks[key] = outside
    return outside


SNAPSHOT_BYTES = 1 << 28
"""Parameters and floating buffers of one dtype on the CPU up to this many bytes in all are compared bit for bit
against a copy taken at each fingerprint (:class:`_Contents`: two copies a step and one comparison, each a pass over
the memory, as the two norms were); more (a model too large to copy every step) by their L2 norms, as on an
accelerator."""


def norm_tokens(named: Sequence[tuple[str, Tensor]], sums: Optional[Checksums] = None) -> Fingerprint:
    """The contents of parameters and floating buffers, as a write through ``p.data`` or a NumPy view (which moves
    neither the storage nor the version counter) shows. On the CPU one entry per tensor (``"contents of parameter
    NAME"``) holding its bytes in a copy of all the tensors of its dtype made by one concatenation (:class:`_Contents`:
    any change of any bit shows: a sign flip, two elements swapped, the lowest bit of a mantissa, a NaN's payload,
    ``-0.0`` for ``0.0``). On an accelerator (or past :data:`SNAPSHOT_BYTES` on the CPU: no copy of the model every
    step) each tensor's L2 norm by one fused reduction, one entry per device (:class:`_DeviceNorms`: no host copy until
    compared, so taking the baseline after the update does not wait for the device); a norm does not show a sign flip,
    a permutation or a change below its rounding (docs/results/performance_log.md). ``sums``: where the last copy of
    each group is kept (:attr:`Checksums.snapshots`): contents found bit for bit as copied last time (the check before
    the release, with nothing written since the update) are held by that copy again, so a step copies the weights once
    (after the update) and compares them once, as many passes over the memory as the two norms took."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor]]] = {}
    for name, t in named:
        groups.setdefault((t.device, t.dtype), []).append((name, t))
    out: Fingerprint = {}
    normed: dict[torch.device, list[tuple[str, Tensor]]] = {}
    with torch.no_grad():  # (so no graph: the tensors need no detach)
        for (device, dtype), group in groups.items():
            tensors = [t for _, t in group]
            layout = _GroupLayout.of(sums, device, dtype, group, tensors)
            if device.type == "cpu" and dtype.itemsize in _BITS and not any(map(hasattr, tensors, repeat("to_local"))) \
                    and layout.numel * dtype.itemsize <= SNAPSHOT_BYTES:
                last = sums.snapshots.get(layout.key) if sums is not None else None
                # (the key fixes the layout: the shapes, one dtype)
                snapshot = last if last is not None and last.holds(tensors, True) else _Snapshot(tensors, last)
                if sums is not None:
                    sums.snapshots[layout.key] = snapshot
                out.update(zip(layout.names, layout.contents(snapshot)))
            else:
                normed.setdefault(device, []).extend(group)
        for device, group in normed.items():
            # in their own dtype: a float32 norm read as a Python float is exact, so equal exactly when the float64
            # conversion's was (one kernel fewer)
            norms = torch.stack(torch._foreach_norm([t for _, t in group]))
            if device.type == "cpu":
                out.update(zip(["contents of " + name for name, _ in group], norms.tolist()))
            else:
                out[f"contents of {len(group)} parameters and buffers on {device}"] = _DeviceNorms(norms)
    return out


class _GroupLayout:
    """What :func:`norm_tokens` derives from a group's tensors (one device and dtype) and their names alone: the
    snapshot key (ids and shapes), the total size, the entry names and, per snapshot, its tokens (:class:`_Contents`).
    Kept in :class:`Checksums` (``layouts``) and used again while the group holds the same tensors (by identity: held
    here, so no id is reused) under the same names with the same shapes (a ``.data`` swap or ``set_`` to another size
    shows there), each compared in a C loop; else made anew."""

    __slots__ = ("tensors", "named", "names", "shapes", "key", "numel", "_tokens")

    def __init__(self, device: torch.device, dtype: torch.dtype, group: Sequence[tuple[str, Tensor]],
                 tensors: list[Tensor], shapes: list[torch.Size]) -> None:
        self.tensors, self.shapes = tensors, shapes
        self.named = list(map(_NAME, group))
        self.names = ["contents of " + name for name in self.named]
        self.key = (device, dtype, *zip(map(id, tensors), map(tuple, shapes)))
        self.numel = sum(t.numel() for t in tensors)
        self._tokens: Optional[tuple[_Snapshot, list[_Contents]]] = None

    @classmethod
    def of(cls, sums: Optional["Checksums"], device: torch.device, dtype: torch.dtype,
           group: Sequence[tuple[str, Tensor]], tensors: list[Tensor]) -> "_GroupLayout":
        """The layout of ``group`` (``tensors``: its tensors), kept in ``sums`` if it is the one kept there."""
        shapes = list(map(_SHAPE, tensors))
        kept = sums.layouts.get((device, dtype)) if sums is not None else None
        if kept is not None and len(kept.tensors) == len(tensors) and all(map(operator.is_, tensors, kept.tensors)) \
                and kept.shapes == shapes and kept.named == list(map(_NAME, group)):
            return kept
        layout = cls(device, dtype, group, tensors, shapes)
        if sums is not None:
            sums.layouts[(device, dtype)] = layout
        return layout

    def contents(self, snapshot: "_Snapshot") -> list["_Contents"]:
        """The tokens of the group's tensors in ``snapshot`` (the same objects again for the same snapshot)."""
        if self._tokens is None or self._tokens[0] is not snapshot:
            self._tokens = (snapshot, [_Contents(snapshot, k) for k in range(len(self.tensors))])
        return self._tokens[1]


_SHAPE, _NAME, _TENSOR = operator.attrgetter("shape"), operator.itemgetter(0), operator.itemgetter(1)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype a tensor's bits are compared as, by item size (a float compared as a float would take a NaN for
changed and ``-0.0`` for ``0.0``)."""


def _memcmp() -> Optional[Callable[[int, int, int], int]]:
    """The C library's ``memcmp`` (through ``ctypes``), or ``None`` where it cannot be found (then NumPy compares)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None) if os.name != "nt" else ctypes.cdll.msvcrt
        fn = libc.memcmp
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _memcmp()


class _Snapshot:
    """A copy of the bits of some CPU tensors of one dtype, flat (one concatenation), with each one's span. Two
    snapshots of the same layout are compared whole once (the answer kept: both are copies, never written), so that
    comparing a fingerprint's entries costs one comparison of the memory, not one per tensor."""

    __slots__ = ("layout", "spans", "bits", "_compared", "_places", "__weakref__")

    def __init__(self, tensors: Sequence[Tensor], like: Optional["_Snapshot"] = None) -> None:
        """A copy of ``tensors``; ``like``: an earlier snapshot of the same layout (its layout and spans reused)."""
        if like is not None:
            self.layout, self.spans = like.layout, like.spans
        else:
            self.layout = tuple((tuple(t.shape), t.dtype) for t in tensors)
            ends = list(itertools.accumulate(t.numel() for t in tensors))
            self.spans = list(zip([0, *ends[:-1]], ends))
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
        self.bits = flat.view(_BITS[flat.dtype.itemsize]).numpy()
        self._compared: Optional[tuple[weakref.ReferenceType, bool]] = None
        self._places: Optional[tuple[list[int], list[int]]] = None  # each span's address and bytes (holds())

    def holds(self, tensors: Sequence[Tensor], same_layout: bool = False) -> bool:
        """Whether ``tensors`` hold, bit for bit, what this copy holds (``memcmp``: it stops at the first difference,
        so tensors the optimizer just updated cost next to nothing); ``same_layout``: their shapes and dtype are known
        to be this copy's."""
        if not same_layout and tuple((tuple(t.shape), t.dtype) for t in tensors) != self.layout:
            return False
        size = self.bits.itemsize
        base = self.bits.ctypes.data
        if _MEMCMP is not None and all(map(Tensor.is_contiguous, tensors)) and not any(map(Tensor.is_conj, tensors)) \
                and not any(map(Tensor.is_neg, tensors)):  # each by memcmp as below, in C loops (no Python per tensor)
            if self._places is None:
                self._places = ([base + start * size for start, _ in self.spans],
                                [(stop - start) * size for start, stop in self.spans])
            if all(self._places[1]):  # (an empty tensor's span is skipped below: no address read)
                return not any(map(_MEMCMP, map(Tensor.data_ptr, tensors), *self._places))
        for t, (start, stop) in zip(tensors, self.spans):
            if stop == start:
                continue
            if _MEMCMP is not None and t.is_contiguous() and not t.is_conj() and not t.is_neg():
                if _MEMCMP(t.data_ptr(), base + start * size, (stop - start) * size) != 0:
                    return False
            elif not np.array_equal(t.detach().reshape(-1).view(_BITS[size]).numpy(), self.bits[start:stop]):
                return False
        return True

    def same_as(self, other: "_Snapshot") -> bool:
        """Every bit alike (same layout, same bits); the last answer kept."""
        if other is self:
            return True
        if self._compared is not None and self._compared[0]() is other:
            return self._compared[1]
        same = self.layout == other.layout and bool(np.array_equal(self.bits, other.bits))
        self._compared = (weakref.ref(other), same)
        return same


class _Contents:
    """The token of one tensor's contents: its span in a :class:`_Snapshot`. Equal to another when the bits are: the
    two snapshots alike whole, else this span's bits alike (the refusal names only the tensors that changed)."""

    __slots__ = ("snapshot", "index")

    def __init__(self, snapshot: _Snapshot, index: int) -> None:
        self.snapshot, self.index = snapshot, index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Contents):
            return False
        mine, theirs = self.snapshot, other.snapshot
        if mine.layout[self.index] != theirs.layout[other.index]:
            return False
        if self.index == other.index and mine.same_as(theirs):
            return True
        (a, b), (c, d) = mine.spans[self.index], theirs.spans[other.index]
        return bool(np.array_equal(mine.bits[a:b], theirs.bits[c:d]))

    def __hash__(self) -> int:
        return hash(self.snapshot.layout[self.index])

    def __repr__(self) -> str:
        shape, dtype = self.snapshot.layout[self.index]
        return f"Contents({tuple(shape)}, {dtype})"


class _DeviceNorms:
    """Norms kept on their device; equal when every norm is (one comparison, one wait for the device)."""

    def __init__(self, norms: Tensor) -> None:
        self.norms = norms

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _DeviceNorms) and self.norms.shape == other.norms.shape and bool(
            torch.equal(self.norms, other.norms))

    def __hash__(self) -> int:
        return hash(tuple(self.norms.shape))


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _raw_token(value: Any) -> Optional[Hashable]:
    """Mutable byte containers and streams, which hold data without a ``__dict__``: their contents (``bytearray``,
    ``array.array``, ``memoryview``, ``io.BytesIO``, ``io.StringIO``) or, for another stream (a file written by the
    step), its position: a write moves it."""
    if isinstance(value, (bytearray, memoryview)):
        return (type(value).__name__, _digest(value))
    if isinstance(value, array.array):
        return ("array", value.typecode, _digest(value.tobytes()))
    if isinstance(value, io.BytesIO):
        return ("BytesIO", _digest(value.getbuffer()), value.tell())
    if isinstance(value, io.StringIO):
        return ("StringIO", _digest(value.getvalue().encode("utf-8", "surrogatepass")), value.tell())
    if isinstance(value, io.IOBase):
        try:
            position = None if value.closed else value.tell()
        except (OSError, ValueError):  # a pipe or socket: not seekable
            position = None
        return ("stream", type(value).__name__, id(value), value.closed, position)
    return None


def numpy_token(value: Any) -> Optional[Hashable]:
    """A token of a NumPy value's contents: a scalar by its value, an array by its shape, dtype and digest
    (:func:`_array_digest`; an object array by its identity); ``None`` for anything not NumPy's."""
    module = type(value).__module__
    if module != "numpy" or not installed_class(type(value)):  # (a class of the user's claiming NumPy's: walked)
        return None
    import numpy as np

    if isinstance(value, np.generic):
        return ("numpy scalar", repr(value.item()))
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("ndarray", value.shape, "object", id(value))
        return ("ndarray", value.shape, str(value.dtype), _array_digest(value))
    return None


ARRAY_BYTES = 1 << 20
"""NumPy arrays up to this size are compared by a digest of all their bytes; larger ones (a datamodule's raw data)
by their identity, memory address and a digest of :data:`ARRAY_BYTES` bytes in strided rows, every step."""


def _array_digest(value: Any) -> bytes:
    if value.nbytes <= ARRAY_BYTES:
        return _digest(value.tobytes())
    flat = value.reshape(-1) if value.flags.c_contiguous else value.ravel()
    stride = max(1, flat.size // (ARRAY_BYTES // max(1, value.itemsize)))
    return _digest(flat[::stride].tobytes()) + id(value).to_bytes(8, "little") + \
        value.__array_interface__["data"][0].to_bytes(8, "little")
