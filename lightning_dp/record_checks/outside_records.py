"""Only the step's own sampled records may enter it: the training data's other copies exchanged, the step unchanged.

Poisson sampling charges a record's privacy loss on the steps that sample it, and per-example clipping bounds what
one sampled example adds to the sum. Both hold only if a step's gradients are functions of its own sampled batch. A
step that reads other training records — soft targets from the nearest training neighbours (``torch.cdist(x,
dataset.tensors[0])``), negatives or a memory bank that *is* the training tensor or a copy of it held by the model,
the LightningDataModule or a global (``self.trainer.datamodule.x_train``) — makes every example's gradient depend on
records the step did not sample: no clipping bounds their influence and no q is their rate.

:class:`ExchangedRecords` is the batch check's last pass (:mod:`lightning_dp.validators.batch_check`): the checked
batch, read as usual,
passes through the step again while every other copy of the training data in memory is *exchanged* in place, exactly
reversibly, for other values (:func:`exchange`):

* floating point: in every element the top bit of the mantissa, the next one, or both (never neither: every
  magnitude moves by an eighth to a half of its binade), and the sign bit by a coin — per element, by secret chances;
* integers: in every element bit 0, bit 1 or both (``uint8`` pixels: bits 7 and 6), per element, by secret chances
  (a label 0 becomes 1, 2 or 3; 1 becomes 0, 3 or 2); ``bool``: negated;
* a list: its strings reversed and lengthened, its integers as above, its floats by ``-a·v - b`` with a secret
  ``a``, ``b`` (restored item by item).

Every element changes in every exchange, so a read of one element or one label outside the batch is set apart by
every judged run (never by chance). And the exchange is SECRET: the chances (each of the three masks at least 0.1,
bit 0 alone at most 0.6; the sign's coin in [0.1, 0.9]) and the masks are drawn anew at each exchange (each
``exchanged()`` block) from a private NumPy generator seeded from the operating system (:data:`SECRET`), never
torch's, NumPy's or Python's global generators, which the user's code and the replays seed. No bit is flipped in
every element. The exchange was a fixed public involution (a float's sign and top mantissa bit, an integer's
lowest bit): every statistic it left alike passed every judge — p(1 − p) of binary labels (p ↔ 1 − p), |p − ½|
rounded, a band symmetric about ½, ½(s(X) + s(e(X))) with e the public map (zoo36 T46, T47, T49, T51). Now the
labels' mean moves from p to at least 1 − p + ½ in expectation, the parity's rate to ½ + (p − ½)(1 − 2r) with a
secret r in [0.1, 0.9], the signs of a secret share of the features: those statistics are set apart — p(1 − p) and
|p − ½| of 64 labels in every one of 20 000 exchanges tried, of 10 labels in all but 0.02 % to 2 % (a window of 7 or
9 ones) of them, and a judge runs an exchange per judged step.

Why this design. A random exchange that leaves some elements alike (a label's parity flipped by chance) sets a
one-label read apart only by chance; two exchanged runs per judge (one by the public map, one secret) double the
judges' runs; a fixed bit flipped in every element beside secret ones (bit 0 always, bit 1 on a secret subset)
leaves the public swap to whoever reads that bit alone (``y & 1``). So every element changes, and which of its bits
change is secret. The cost: a label leaves its range (2 and 3 in a two-class problem). Only code reading records
outside its batch meets an exchanged label — the step's own batch is read before the exchange, the row probes
(:mod:`~lightning_dp.record_checks.shared_records`, :mod:`~lightning_dp.record_statistics.read_records`,
:mod:`~lightning_dp.record_checks.copied_rows`) use the public map (``fixed=True``: an array and its copies must
change alike); a step or hook that fails on them where it ran is refused by the judges that take a failure for a
difference (this pass, :mod:`~lightning_dp.validators.judged_updates`, :mod:`~lightning_dp.validators.judged_writes`,
:mod:`~lightning_dp.validators.judged_schedules`, :mod:`~lightning_dp.validators.epoch_ends`). The judges that leave
such a run out (a hook may rightly reject values it is handed) exchange integers within the values each array holds
instead (``exchanged(fixed_integers=True)``: the replays of the epoch hooks and of the batch hooks, the decision
windows, the end-of-fit and checkpoint reruns, a fetch's reruns; :mod:`~lightning_dp.record_checks.label_exchange`:
each element shifted to another of its array's values by a secret amount, bools and arrays of one value by the
public map): there a label out of its range would make a read of the training labels — a closed-form head fitted
with ``one_hot(y, 2)`` — fail and go unjudged, and bit 0 alone left ``y // 2`` alike (zoo39 L01). A batch's exchanged
copy (:func:`exchanged_copy`, the batch hooks' replays: the user's code computes on its batch) keeps the public map
for its integers, so that a label stays a label (0 ↔ 1) — an index past the classes is a device assertion on a GPU,
which no replay survives —, and takes secret masks for its floats; so do the arrays of the user's state that a
judged hook's run again exchanges beside the training data (``fixed_integers``,
:func:`~lightning_dp.validators.held_values.other_values`: stored labels and predictions a hook indexes with).

The masks: a block of a secret length in [2¹⁵, 2¹⁶) elements, drawn per exchange, laid over the array's memory in
turn and kept until the restore (at most 512 KiB; no mask of the array's size): exchange and restore of a 60 000 ×
784 float32 tensor cost about 1.5 times the public map's two exclusive ors (24 ms against 17 ms, one thread; as
uint8 pixels 2 times, 6 ms against 3; ``benchmarks/exchange_cost.py``). The block repeats every period: the masks
of elements a period apart are alike. The judges compare every exchanged run with runs on the data only
(:func:`~lightning_dp.fingerprints.fingerprint_entries.moved_by_data`), never two exchanged runs with each other.

Not set apart: a statistic every mask the exchange may draw leaves alike — of the bits it never flips (a float's
exponent and lower mantissa, ``x.view(torch.int32) & 0x7F9FFFFF``; an integer's bits above bit 1, ``y >> 2``), of a
bool array (negation is its only exchange), or symmetric over the masks (a sum over the four values of the two
mantissa bits); a decision the exchanged values only rarely reverse — a band's outside (|p − ½| > 0.02 on labels
at rate 0.455: the exchanged labels' mean moves away from ½, never into the band; zoo36 T50), a threshold the
exchanged values keep meeting (a rate above 0.3) —; and integers where the public map exchanges them: a batch's,
in its exchanged copy (a decision on a batch's label rate symmetric about ½), and the training labels in the judges
that leave a failing run out (p(1 − p) of the labels kept by an epoch hook).

A step that reads only its batch cannot tell: its per-example gradients are bit for bit those of the plain pass
(same batch, same seed, same state). Any difference — a norm, a parameter's sum, an exception — proves that it read
the exchanged memory: refused before the step's release (:func:`outside_records_error`). The exchange writes through
``tensor.data`` (no version counter moves, no autograd graph notices) and is undone in a ``finally``.

What is exchanged (:func:`training_copies`): the tensors of the training dataset and of the datasets it wraps
(:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_parts`; every view of their memory, anywhere, with them), the
NumPy arrays and lists of records those datasets keep, and *copies* of the training tensors elsewhere — a tensor or
NumPy array the model (buffers, attributes), the datamodule, a callback, a global of the user's code, an optimizer or
a scheduler (their attributes, rate functions, classes of the user's) or a ``DataLoader``'s dataset holds,
directly or further in (:func:`~lightning_dp.record_checks.holders.held_arrays`: nested containers, helper objects and
fitted estimators, a ``functools.partial``'s arguments, a function's defaults and closure, the weights of a module
held outside the model; a bounded walk), whose rows are rows of a training tensor (its sampled rows found in the
tensor's row digests, :func:`~lightning_dp.records.held_records.row_digests`; a float16 or bfloat16 copy in the
digests of the rows rounded to its type; a wider matrix by its first or last columns), that is of its shape and the
same rows under one affine map (raw pixels of data scaled by 1/255), or, for labels, equal to a training tensor; and
records kept one per item of a dict or a list (``{i: (x_i, y_i)}``), each item exchanged. A view of memory already
listed is exchanged with it, not twice.
Not exchanged: tensors in shared memory (a DataLoader's worker processes may be
reading them) or backed by a file, read-only or memory-mapped NumPy arrays, copies the walk does not reach, and copies
transformed after they were taken (projected, tokenised again): a step reading those is not seen. Nor is a record read
from its file again.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.holders import RowItems, held_arrays
from lightning_dp.record_checks.label_exchange import shifted_list, shifted_within_values
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.records.held_records import ROWS_SAMPLED, holds_records, row_digests
from lightning_dp.records.memory_spans import memory_span

# The bits an exchange may flip, per element type: (bits' integer dtype, sign bit, low bit, high bit). Floats: the
# two top bits of the mantissa (each flip moves a magnitude by at least an eighth) and the sign; integers: bits 0 and
# 1 (uint8 pixels: bits 7 and 6) and no sign.
_FLOAT_BITS = {torch.float16: (torch.int16, -0x8000, 0x0200, 0x0100),
               torch.bfloat16: (torch.int16, -0x8000, 0x0040, 0x0020),
               torch.float32: (torch.int32, -0x80000000, 0x00400000, 0x00200000),
               torch.float64: (torch.int64, -0x8000000000000000, 0x0008000000000000, 0x0004000000000000)}
_INT_BITS = {torch.uint8: (0x80, 0x40), torch.int8: (1, 2), torch.int16: (1, 2), torch.int32: (1, 2),
             torch.int64: (1, 2)}
_NUMPY_FLOAT_BITS = {2: (-0x8000, 0x0200, 0x0100), 4: (-0x80000000, 0x00400000, 0x00200000),
                     8: (-0x8000000000000000, 0x0008000000000000, 0x0004000000000000)}


class _Secret:
    """The exchange's private draws (module docstring): a NumPy generator seeded from the operating system
    (``os.urandom``), never torch's or Python's generators, which the user's code and the replays seed."""

    def __init__(self) -> None:
        self.generator = np.random.Generator(np.random.PCG64(int.from_bytes(os.urandom(16), "little")))

    def reseed(self, seed: int) -> None:
        """Test hook: the draws from ``seed`` (a test's fits then draw the same masks at every run). Production
        never calls it; the generator is seeded from the operating system at import."""
        self.generator = np.random.Generator(np.random.PCG64(seed))

    def rates(self) -> np.ndarray:
        """The chances that an element's mask flips its low bit only, its high bit only, or both: drawn per exchange,
        each at least 0.1 and the low bit alone at most 0.6 (no bit flipped in every element, nor in none)."""
        while True:
            rates = self.generator.dirichlet((1.0, 1.0, 1.0))
            if rates.min() >= 0.1 and rates[0] <= 0.6:
                return rates

    def block(self, size: int, low: int, high: int, sign: int = 0) -> np.ndarray:
        """The masks of ``size`` elements (int64): one of low, high, low | high each, by :meth:`rates`; with ``sign``
        flipped too by a coin of a secret chance in [0.1, 0.9]."""
        g = self.generator
        rates = self.rates()
        draws = g.random(size, dtype=np.float32)
        choice = (draws >= rates[0]).astype(np.intp) + (draws >= rates[0] + rates[1])
        block = np.array([low, high, low | high], dtype=np.int64)[choice]
        if sign:
            block |= (g.random(size, dtype=np.float32) < g.uniform(0.1, 0.9)) * np.int64(sign)
        return block

    def period(self, size: int) -> int:
        """How many elements one block of masks covers before it repeats: a secret length in [2¹⁵, 2¹⁶) (the masks
        drawn for every element of a smaller array)."""
        return min(size, int(self.generator.integers(1 << 15, 1 << 16)))


SECRET = _Secret()
"""The private generator of the exchanges' masks (tests seed it through :meth:`_Secret.reseed`)."""


class ExchangedRecords:
    """The training data's copies in memory (:func:`training_copies`), exchanged for the length of a ``with``.

    Args:
        arrays: (name, tensor or NumPy array or list) to exchange; a name says where it is held (never its data).
        ready: whether the pass may run now (the caller's condition: its batch was read before the exchange).
        also: ``also(floating_only)``, a context entered with the exchange: what else reads of the training data
            reads other values inside (the non-private diagnostics,
            :func:`lightning_dp.validators.diagnostic_reads.moved`).
        fixed_integers: integers and bools by the public map (:func:`exchange`): arrays that are not the training
            data's copies but what the user's state holds (stored predictions a hook indexes with).
    """

    def __init__(self, arrays: Sequence[tuple[str, Any]], ready: Callable[[], bool] = lambda: True,
                 also: Optional[Callable[[bool], AbstractContextManager]] = None,
                 fixed_integers: bool = False) -> None:
        self._arrays = [(name, value) for name, value in arrays if exchangeable(value)]
        self._ready = ready
        self._also = also
        self._fixed_integers = fixed_integers

    @property
    def arrays(self) -> list[tuple[str, Any]]:
        """What is exchanged; empty when not :attr:`ready`."""
        return self._arrays if self._ready() else []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._arrays]

    @contextmanager
    def exchanged(self, floating_only: bool = False, fixed_integers: Optional[bool] = None) -> Iterator[None]:
        """Every array exchanged (:func:`exchange`) on entry and restored on exit, whatever happens in between.
        ``floating_only``: only the arrays of floating-point numbers (the features, not the labels beside them: a
        statistic of how the two pair, a training loss, may come out alike on both exchanged). Each entry draws
        its masks anew (module docstring). ``fixed_integers``: the integers by the public map in this exchange (the
        judges that leave out a run the exchanged values make fail — a label out of its range, indexing —: there a
        label read so would go unjudged); ``None``: as constructed."""
        undo: list[Callable[[], None]] = []
        try:
            for _, value in self._arrays:
                if not floating_only or _floating(value):
                    undo.append(exchange(value, fixed_integers=self._fixed_integers if fixed_integers is None
                                         else fixed_integers))
            with self._also(floating_only) if self._also is not None else nullcontext():
                yield
        finally:
            for restore in reversed(undo):
                restore()


def exchangeable(value: Any) -> bool:
    """Whether :func:`exchange` may write ``value`` in place: a dense tensor of a masked dtype outside shared memory
    and files, a writeable in-memory NumPy array of numbers, a non-empty list of numbers or strings, or records held
    one per item of a container (:class:`~lightning_dp.record_checks.holders.RowItems`) of which one is exchangeable."""
    if isinstance(value, RowItems):
        return any(exchangeable(a) for a in value.arrays)
    if isinstance(value, Tensor):
        dtype_ok = value.dtype in _FLOAT_BITS or value.dtype in _INT_BITS or value.dtype == torch.bool
        if not dtype_ok or value.layout != torch.strided or value.numel() == 0:
            return False
        storage = value.untyped_storage()  # its is_shared() costs a tenth of the tensor's (many per-record items)
        return not storage.is_shared() and getattr(storage, "filename", None) is None
    if isinstance(value, np.ndarray):
        sized = value.dtype.kind != "f" or value.dtype.itemsize in (2, 4, 8)
        return (value.size > 0 and value.dtype.kind in "fiub" and sized and value.flags.writeable
                and not isinstance(value, np.memmap) and not _file_backed(value))
    return isinstance(value, list) and bool(value) and all(isinstance(v, (int, float, str)) for v in value[:64])


def _file_backed(array: np.ndarray) -> bool:
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
        if isinstance(base, np.memmap) or type(base).__name__ == "mmap":
            return True
    return False


def exchange(value: Any, rows: slice = slice(None), fixed: bool = False,
             fixed_integers: bool = False) -> Callable[[], None]:
    """Exchange ``value``'s contents in place (module docstring), or only its ``rows`` (along dimension 0); returns
    the function that restores them exactly (the same masks applied again: an exclusive or undoes itself). Secret
    masks drawn anew for this call; ``fixed``: the public map instead (every float's sign and top mantissa bit, every
    integer's low bit) — the probes that find which rows a record reads, where an array and its copies must change
    alike (:mod:`~lightning_dp.record_checks.shared_records`), and the integers of a batch's exchanged copy
    (:func:`exchanged_copy`); ``fixed_integers``: integers within the values they hold (a secret shift,
    :mod:`~lightning_dp.record_checks.label_exchange`; of one value, and bools, the public map) — values the user's
    code may index with: labels kept, stored predictions. A :class:`~lightning_dp.record_checks.holders.RowItems`: each
    of its exchangeable arrays, whole."""
    if isinstance(value, RowItems):
        return _exchange_items(value, fixed, fixed_integers)
    if fixed_integers and not fixed and rows == slice(None):
        shifted = _within_values(value)  # a label to another label, by a secret shift (label_exchange.py)
        if shifted is not None:
            return shifted
    fixed = fixed or (fixed_integers and not _floating(value) and isinstance(value, (Tensor, np.ndarray)))
    if isinstance(value, Tensor):
        data = value.data if rows == slice(None) else value.data[rows]  # its own version counter: the tensor's stays
        flip = _tensor_flip(data, fixed)
        flip()
        return flip
    if isinstance(value, np.ndarray):
        flip = _array_flip(value if rows == slice(None) else value[rows], fixed)
        flip()
        return flip
    rates = None if fixed or fixed_integers else SECRET.rates()
    slope, offset = (1.5, 1.0) if fixed else SECRET.generator.uniform(1.25, 2.0, 2)
    value[rows] = [_marked(v, rates, slope, offset) for v in value[rows]]

    def restore() -> None:  # each exchanged item back, where the hooks moved it (an order shuffled by set_epoch)
        value[:] = [v.original if isinstance(v, _MARKED) else v for v in value]
    return restore


def _within_values(value: Any) -> Optional[Callable[[], None]]:
    """The integers of ``value`` (a tensor, a NumPy array, a list of plain integers) exchanged within the values it
    holds (:mod:`~lightning_dp.record_checks.label_exchange`), written in place; returns the restore, or ``None``
    (nothing written) for other values and those of fewer than two distinct integers: the public map then."""
    if isinstance(value, list):
        others = shifted_list(value, SECRET.generator)
        if others is None:
            return None
        value[:] = [_marked_as(other, v) for v, other in zip(value, others)]

        def restore() -> None:  # item by item, where the hooks moved it (as the other lists' restore)
            value[:] = [v.original if isinstance(v, _MARKED) else v for v in value]
        return restore
    return shifted_within_values(value, SECRET.generator, SECRET.period)


class _Int(int):
    original: Any


class _Float(float):
    original: Any


class _Str(str):
    original: Any


_MARKED = (_Int, _Float, _Str)


def _marked(v: Any, rates: Optional[np.ndarray], slope: float, offset: float) -> Any:
    """:func:`_other` of a list's item, marked with the item it stands for: restored item by item, what a hook
    did with the list meanwhile (shuffled it, appended the epoch) stays done (alike on any data), as do its values."""
    return _marked_as(_other(v, rates, slope, offset), v)


def _marked_as(other: Any, v: Any) -> Any:
    """``other`` marked as standing for ``v`` (a string, float or integer; anything else as it is)."""
    kind = _Str if isinstance(other, str) else _Float if isinstance(other, float) else _Int \
        if isinstance(other, int) else None
    if kind is None:
        return other
    marked = kind(other)
    marked.original = v
    return marked


def _other(v: Any, rates: Optional[np.ndarray] = None, slope: float = 1.5, offset: float = 1.0) -> Any:
    """Another value for a list's item: a string reversed and lengthened, a bool negated, an integer's bit 0, bit 1
    or both flipped by the chances ``rates`` (``None``: bit 0), a float mapped by ``-slope·v - offset`` (secret in
    a secret exchange; a float ``v`` that map leaves alike is moved by one more)."""
    if isinstance(v, str):
        return v[::-1] + "\x00"
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        if rates is None:
            return v ^ 1
        return v ^ (1, 2, 3)[int(np.searchsorted(np.cumsum(rates)[:2], SECRET.generator.random(), side="right"))]
    if isinstance(v, float):
        other = -slope * v - offset
        return other if other != v else other + 1.0
    return v  # an item of another kind further on (only the first 64 were looked at): left as it is


def _exchange_items(rows: RowItems, fixed: bool, fixed_integers: bool = False) -> Callable[[], None]:
    """Exchange every exchangeable array of ``rows`` (their in-place views found once, kept on ``rows``: a container
    may hold a record per item for a hundred thousand records); returns the function restoring them all. A secret
    mask per item (one draw for all its elements; :func:`_masks`): every element of every item changes."""
    if rows.flips is None:
        rows.flips = [_item_view(a) for a in rows.arrays if exchangeable(a)]
    views = rows.flips
    flips = [_scalar_flip(view, fixed or (fixed_integers and not _floating(view))) for view in views]

    def flip_all() -> None:
        for flip in flips:
            flip()
    flip_all()
    return flip_all


def _item_view(value: Any) -> Any:
    """The array an item is flipped through: a CPU tensor's NumPy view (a NumPy call costs less than torch's)."""
    if isinstance(value, Tensor):
        if value.device.type == "cpu" and value.dtype != torch.bfloat16:
            return value.detach().numpy()
        return value.data
    return value


def _scalar_flip(view: Any, fixed: bool) -> Callable[[], None]:
    """The flip of one item: all its elements by one mask (drawn here unless ``fixed``)."""
    if isinstance(view, Tensor):
        if view.dtype == torch.bool:
            return lambda: view.logical_not_()
        bits = view.view(_FLOAT_BITS[view.dtype][0]) if view.dtype in _FLOAT_BITS else view
        mask = int(_masks(view.dtype, 1, fixed)[0])
        return lambda: bits.bitwise_xor_(mask)
    if view.dtype.kind == "b":
        return lambda: np.logical_not(view, out=view)
    bits = _bits(view)
    mask = _masks(view.dtype, 1, fixed).astype(bits.dtype)[0]
    return lambda: np.bitwise_xor(bits, mask, out=bits)


def _bits(array: np.ndarray) -> np.ndarray:
    """A float array's memory as integers of its width and byte order (the array itself for integers)."""
    if array.dtype.kind != "f":
        return array
    size = array.dtype.itemsize
    return array.view(f"<i{size}" if array.dtype.byteorder in "<=|" else f">i{size}")


def _masks(dtype: Any, size: int, fixed: bool) -> np.ndarray:
    """``size`` masks (int64) for elements of ``dtype`` (a torch or NumPy dtype, not bool): the public map's when
    ``fixed`` (one), else secret (:meth:`_Secret.block`)."""
    if isinstance(dtype, torch.dtype):
        sign, low, high = _FLOAT_BITS[dtype][1:] if dtype in _FLOAT_BITS else (0, *_INT_BITS[dtype])
    elif dtype.kind == "f":
        sign, low, high = _NUMPY_FLOAT_BITS[dtype.itemsize]
    else:
        sign, (low, high) = 0, ((0x80, 0x40) if dtype == np.uint8 else (1, 2))
    if fixed:
        return np.array([sign | low], dtype=np.int64)
    return SECRET.block(size, low, high, sign)


def _tensor_flip(data: Tensor, fixed: bool = False) -> Callable[[], None]:
    """The in-place flip of ``data`` (called again, its restore): the public map's constant when ``fixed``, else a
    block of secret masks (:meth:`_Secret.period` elements, kept until the restore) laid over the elements in turn."""
    if data.dtype == torch.bool:
        return lambda: data.logical_not_()
    bits = data.view(_FLOAT_BITS[data.dtype][0]) if data.dtype in _FLOAT_BITS else data
    if fixed:
        mask = int(_masks(data.dtype, 1, True)[0])
        return lambda: bits.bitwise_xor_(mask)
    n = bits.numel()
    block = torch.from_numpy(_masks(data.dtype, SECRET.period(n), False)).to(bits.dtype).to(bits.device)
    return lambda: _tiled_xor(bits, block)


def _tiled_xor(bits: Any, block: Any) -> None:
    """``bits ^= block`` repeated over the elements in memory order: contiguous memory as rows of the block's length
    (one call, no mask of the array's size); other memory through a temporary mask of its shape."""
    n, period = (bits.numel(), block.numel()) if isinstance(bits, Tensor) else (bits.size, block.size)
    whole = n // period * period
    if isinstance(bits, Tensor):
        if bits.is_contiguous():
            flat = bits.view(-1)
            flat[:whole].view(-1, period).bitwise_xor_(block)
            flat[whole:].bitwise_xor_(block[: n - whole])
        else:
            bits.bitwise_xor_(block.repeat(-(-n // period))[:n].view(bits.shape))
        return
    if bits.flags.c_contiguous:
        flat = bits.reshape(-1)
        np.bitwise_xor(flat[:whole].reshape(-1, period), block, out=flat[:whole].reshape(-1, period))
        np.bitwise_xor(flat[whole:], block[: n - whole], out=flat[whole:])
    else:
        np.bitwise_xor(bits, np.resize(block, n).reshape(bits.shape), out=bits)


def _array_flip(array: np.ndarray, fixed: bool = False) -> Callable[[], None]:
    """:func:`_tensor_flip` of a NumPy array."""
    if array.dtype.kind == "b":
        return lambda: np.logical_not(array, out=array)
    bits = _bits(array)
    if fixed:
        mask = _masks(array.dtype, 1, True).astype(bits.dtype)[0]
        return lambda: np.bitwise_xor(bits, mask, out=bits)
    block = _masks(array.dtype, SECRET.period(array.size), False).astype(bits.dtype)
    return lambda: _tiled_xor(bits, block)


def exchanged_copy(batch: Any, floating_only: bool = False) -> Any:
    """A copy of a collated batch with every tensor and NumPy array in it exchanged (:func:`exchange`; lists,
    tuples and dicts walked; anything else kept): the first step's replays of the batch hooks run on it, so a
    decision taken from the batch's values (a learning rate, a stop, a seed) differs from the plain replay's.
    Its floats by secret masks, its integers and bools by the public map (``fixed``): the user's code computes on
    its batch, and a label must stay a label (0 ↔ 1; a secret mask's 2 or 3 would index past two classes, a device
    assertion on a GPU). ``floating_only``: only its floating-point arrays (see :meth:`ExchangedRecords.exchanged`)."""
    if isinstance(batch, (Tensor, np.ndarray)):
        copy = batch.detach().clone() if isinstance(batch, Tensor) else batch.copy()
        if exchangeable(copy) and (not floating_only or _floating(copy)):
            exchange(copy, fixed_integers=True)
        return copy
    if type(batch) is dict:  # a dict of another class (a tokenizer's batch) is kept: its replay is the plain one's
        return {k: exchanged_copy(v, floating_only) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(exchanged_copy(v, floating_only) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(exchanged_copy(v, floating_only) for v in batch)
    return batch


MAX_REREAD_EXCHANGE = 64 << 20
"""Bytes of records :func:`records_exchanged` flips at most (twice per judged fetch)."""


def records_exchanged(dataset: Any) -> Optional[AbstractContextManager]:
    """``dataset``'s records in memory (:func:`training_copies`, without holders) exchanged for the length of a
    ``with``: a fetch that wrote state is read again on them (:mod:`~lightning_dp.records.fetch_reruns`). ``None``
    (no exchanged rerun) in a DataLoader worker (its pages are the parent's until written: flipping them would copy
    the dataset into every worker) or beyond :data:`MAX_REREAD_EXCHANGE` bytes."""
    if torch.utils.data.get_worker_info() is not None:
        return None
    copies = training_copies(dataset, ())
    size = sum(v.numel() * v.element_size() if isinstance(v, Tensor) else v.nbytes if isinstance(v, np.ndarray)
               else 8 * len(v) if isinstance(v, list) else 0 for _, v in copies)
    return ExchangedRecords(copies, fixed_integers=True).exchanged() if size <= MAX_REREAD_EXCHANGE else None


def _floating(value: Any) -> bool:
    """A tensor or NumPy array of floating-point numbers, a list starting with floats, or rows of them."""
    if isinstance(value, RowItems):
        return bool(value.arrays) and _floating(value.arrays[0])
    if isinstance(value, Tensor):
        return value.is_floating_point()
    if isinstance(value, np.ndarray):
        return value.dtype.kind == "f"
    return isinstance(value, list) and bool(value) and isinstance(value[0], float)


# ---------------------------------------------------------------------------- what is exchanged
def training_copies(dataset: Any, holders: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(name, array) of the training data in memory: ``dataset``'s tensors and its datasets' arrays and lists of
    records, and the copies of its tensors ``holders`` ((label, object): the model, the datamodule, callbacks, a
    module of globals) keep (:func:`~lightning_dp.record_checks.holders.held_arrays`; module docstring). A copy whose
    memory is the training data's or an earlier copy's (a view) is exchanged with it, not listed again."""
    datasets, tensors = dataset_parts(dataset)
    found: list[tuple[str, Any]] = [(f"the training data{path}", t) for path, t in tensors]
    memory = _Memory()
    for _, t in tensors:
        memory.add(t, whole_storage=True)
    for d in datasets:
        for key, value in (vars(d).items() if hasattr(d, "__dict__") else ()):
            if isinstance(value, (np.ndarray, list)) and not isinstance(value, Tensor):
                found.append((f"the training data's {type(d).__name__}.{key}", value))
                memory.add(value)
    digests = [(t, row_digests(t)) for _, t in tensors]
    for path, value in held_arrays(holders, loaders=True):
        copy = _held_copy(value, digests, memory)
        if copy is not None:
            found.append((path, copy))
            memory.add(copy)
    return found


def _held_copy(value: Any, digests: Sequence[tuple[Tensor, Optional[set[int]]]], memory: "_Memory") -> Any:
    """``value`` if it holds records of a training tensor (:func:`holds_records`) in memory not already listed;
    for records held one per item, those of its items outside the listed memory; ``None`` otherwise."""
    if isinstance(value, RowItems):
        sample = value.sample(ROWS_SAMPLED)
        if sample is None or not any(holds_records(sample, t, rows) for t, rows in digests):
            return None
        items = memory.outside(value)
        return items if items.arrays else None
    if memory.overlaps(value) or not any(holds_records(value, t, rows) for t, rows in digests):
        return None
    return value


class _Memory:
    """The byte ranges (per device) of what is already listed: a view of them is exchanged with them (listing it
    again would flip its bits twice, back)."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, int, int]] = []
        self._items: set[int] = set()  # the arrays of records held one per item, by identity

    def add(self, value: Any, whole_storage: bool = False) -> None:
        if isinstance(value, RowItems):
            self._items.update(id(a) for a in value.arrays)
            return
        span = memory_span(value, whole_storage)
        if span is not None:
            self._spans.append(span)

    def overlaps(self, value: Any) -> bool:
        span = memory_span(value)
        return id(value) in self._items or span is not None \
            and any(d == span[0] and lo < span[2] and span[1] < hi for d, lo, hi in self._spans)

    def outside(self, rows: RowItems) -> RowItems:
        """``rows``' arrays that start outside the listed memory and were not listed one per item already."""
        device = str(rows.arrays[0].device) if isinstance(rows.arrays[0], Tensor) else "cpu"
        starts = np.array([a.data_ptr() if isinstance(a, Tensor) else a.__array_interface__["data"][0]
                           for a in rows.arrays], dtype=np.uint64)
        keep = np.array([id(a) not in self._items for a in rows.arrays], dtype=bool)
        for d, lo, hi in self._spans:
            if d == device:
                keep &= (starts < np.uint64(lo)) | (starts >= np.uint64(hi))
        return RowItems([a for a, k in zip(rows.arrays, keep.tolist()) if k])


def records_in(value: Any, dataset: Any, path: str = "", depth: int = 0) -> list[str]:
    """The paths, in a nested dict/list/tuple ``value`` (a checkpoint about to be written), of the tensors and NumPy
    arrays that hold records of ``dataset``'s tensors (:func:`holds_records`)."""
    tensors = [t for _, t in dataset_parts(dataset)[1] if t.numel()]
    digests = [(t, row_digests(t)) for t in tensors]
    found: list[str] = []

    def visit(item: Any, where: str, level: int) -> None:
        if level > 6:
            return
        if isinstance(item, (Tensor, np.ndarray)):
            if any(holds_records(item, t, rows) for t, rows in digests):
                found.append(where or "the checkpoint")
        elif isinstance(item, dict):
            for key, inner in item.items():
                visit(inner, f"{where}[{key!r}]", level + 1)
        elif isinstance(item, (list, tuple)) and len(item) <= 4096:
            for i, inner in enumerate(item):
                visit(inner, f"{where}[{i}]", level + 1)

    if digests:
        visit(value, path, depth)
    return found


def outside_records_error(step: int, differing: int, summed: Sequence[str], names: Sequence[str],
                          failure: Optional[BaseException] = None, as_of: str = "") -> PrivacyConfigurationError:
    """The refusal of a step that read training records outside its batch (names and counts: no data values)."""
    when = f" ({as_of})" if as_of else ""
    held = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
    if failure is not None:
        what = f"the step failed ({type(failure).__name__}) where it had run"
    else:
        what = f"{differing} example gradient(s)" + (f" and the sums of {', '.join(summed[:4])}" if summed else "") \
            + " changed"
    return PrivacyConfigurationError(
        f"The step reads training records outside its sampled batch at step {step}{when}: passed again with its own "
        f"batch unchanged and the training data's other copies in memory exchanged for other values ({held}), "
        f"{what}. Its gradients then depend on records it did not sample: no per-example clipping bounds their "
        "influence and the sampling rate is not theirs, so the ledger's ε does not hold. Nothing was released for "
        "this step. Typical causes: soft targets, weights or negatives computed from the training tensors "
        "(dataset.tensors[0], a nearest-neighbour search over them), a memory bank or reference set that is the "
        "training data or a copy of it (self.trainer.datamodule.x_train). Draw negatives and references from "
        "public data, or from the batch itself with a per-example loss.")


def records_in_checkpoint_error(held: list[str]) -> PrivacyConfigurationError:
    """The refusal of a checkpoint holding training records (paths only)."""
    return PrivacyConfigurationError(
        f"The checkpoint about to be written holds training records: {', '.join(held[:4])}"
        f"{' …' if len(held) > 4 else ''}. A checkpoint is released with the model; the guarantee covers the noised "
        "updates, not records copied into it (examples added in on_save_checkpoint, data passed to the module's "
        "__init__ and kept by save_hyperparameters). Nothing was written. Keep examples out of checkpoints (pass data "
        "through a LightningDataModule, save_hyperparameters(ignore=[...]) for tensors).")
