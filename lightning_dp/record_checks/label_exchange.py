"""Integers exchanged within the values they hold: every label moved to another label, by a secret shift.

The judges that leave out a run the exchanged values make fail (the replays of the epoch hooks and of the batch
hooks, the decision windows, the end-of-fit and checkpoint reruns, a fetch's reruns; a batch's exchanged copy) must
keep a label a label: a label out of its range would make a read of the training labels (``one_hot(y, 4)``, an
embedding's index) fail and go unjudged. They exchanged integers by the public map, bit 0 flipped in every element
(0 ↔ 1, 2 ↔ 3): every function of the other bits — ``y // 2``, ``y >> 1``, ``y >= 2``, a bucketed token count —
came out alike on the data and on its exchange, so a statistic of them kept by an epoch hook, ``on_train_start``,
a datamodule's ``setup``, ``on_fit_end``, ``teardown`` or ``on_save_checkpoint`` passed every judge (zoo39 L01, L02,
L04, L05, L18, L19, L23, L24: a coarse-class prior of the training labels written into a buffer).

Here an integer array is exchanged within the set of values it holds (:func:`shifted_within_values`): with u its
K distinct values in order, element y = u[r] becomes u[(r + s) mod K], the shift s ∈ [1, K) drawn per element by the
exchange's private generator (a block of a secret period laid over the elements in turn, as the masks of
:mod:`~lightning_dp.record_checks.outside_records`). Every element changes (s ≠ 0), stays among the array's own values
(a label stays a label, an ignore index -100 stays a value the loss accepts), and which other value it takes is
secret: no map of the labels is left alike but the one K = 2 forces (0 ↔ 1, documented). An array of one value
(K = 1) cannot change within its values: the caller keeps the public map for it. The restore undoes the same shifts
exactly (integer arithmetic). Each element's shift is drawn alone, so a count over coarse classes of balanced
labels comes out alike by chance in about one exchange in 1.8·√N (6 % for 64 labels of four classes, 1.7 % for
1,000): no map of the values could move every such count, since each judged run draws one exchange.

``uint8`` arrays (pixels) keep the public map (bit 7): a 256-valued image is exchanged as features, not indexed with.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

__all__ = ["shifted_within_values", "shifted_list"]

_SHIFTED_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _shifts(generator: np.random.Generator, classes: int, size: int, period: int) -> np.ndarray:
    """``size`` shifts in [1, ``classes``): a block of ``period`` secret draws repeated over the elements."""
    block = generator.integers(1, classes, size=max(1, min(size, period)), dtype=np.int64)
    return np.resize(block, size)


def shifted_within_values(value: Any, generator: np.random.Generator,
                          period: Callable[[int], int]) -> Optional[Callable[[], None]]:
    """Exchange the integer tensor or NumPy array ``value`` in place within its own values (module docstring);
    returns the function that restores it exactly, or ``None`` (nothing written) when it is not such an array or
    holds fewer than two distinct values. ``period(n)``: the secret length of the shifts' block for n elements."""
    if isinstance(value, Tensor):
        if value.dtype not in _SHIFTED_DTYPES or value.numel() == 0:
            return None
        return _shifted_tensor(value.data, generator, period)
    if isinstance(value, np.ndarray) and value.dtype.kind == "i" and value.size:
        return _shifted_array(value, generator, period)
    return None


def _shifted_tensor(data: Tensor, generator: np.random.Generator,
                    period: Callable[[int], int]) -> Optional[Callable[[], None]]:
    """:func:`shifted_within_values` of a tensor (written through ``.data``: its version counter does not move)."""
    values = torch.unique(data)  # sorted
    classes = values.numel()
    if classes < 2:
        return None
    shifts = torch.from_numpy(_shifts(generator, classes, data.numel(), period(data.numel()))).to(data.device)

    def moved(by: Tensor) -> None:
        ranks = torch.searchsorted(values, data.reshape(-1))
        data.copy_(values[(ranks + by) % classes].view(data.shape))

    moved(shifts)
    return lambda: moved(-shifts)


def _shifted_array(array: np.ndarray, generator: np.random.Generator,
                   period: Callable[[int], int]) -> Optional[Callable[[], None]]:
    """:func:`shifted_within_values` of a NumPy array."""
    values = np.unique(array)
    classes = values.size
    if classes < 2:
        return None
    shifts = _shifts(generator, classes, array.size, period(array.size))

    def moved(by: np.ndarray) -> None:
        ranks = np.searchsorted(values, array.reshape(-1))
        array[...] = values[(ranks + by) % classes].reshape(array.shape)

    moved(shifts)
    return lambda: moved(-shifts)


def shifted_list(items: list, generator: np.random.Generator) -> Optional[list]:
    """Other values for a list of plain integers (not bools), each shifted within the list's own values as
    :func:`shifted_within_values` does; ``None`` when the list holds anything else or fewer than two values."""
    if not all(type(v) is int for v in items):
        return None
    values = sorted(set(items))
    if len(values) < 2:
        return None
    rank = {v: r for r, v in enumerate(values)}
    shifts = generator.integers(1, len(values), size=len(items))
    return [values[(rank[v] + int(s)) % len(values)] for v, s in zip(items, shifts)]
