"""Per-record columns of the training data derived from its labels' statistics (rule 11, with :mod:`.data_statistics`).

A "balanced" sample-weight column stored with the records (``w_i = 1 / count(y_i)``, scikit-learn's
``compute_sample_weight("balanced", y)``, normalised to sum or average 1) and used to weight the loss carries the
same class counts as ``CrossEntropyLoss(weight=1 / counts)``, one copy per record; a target-encoded feature (each
record's category replaced by the mean label of the training records of that category, possibly smoothed toward the
global mean) is a statistic of every record of that category. Both are computed before training and no noise covers
them: flip one record's label and every record of its class or category changes.

:func:`derived_columns` looks, once before the first release, at the training tensors (and the NumPy arrays the
training datasets hold) for

* a column (a 1-D tensor or a column of a 2-D one) equal, record by record, to a class-weight formula of
  :mod:`.data_statistics` (class counts, frequencies, log frequencies, inverse counts and frequencies, balanced
  weights) evaluated at that record's label, as is, or normalised to sum 1 or to average 1 over the records;
* a floating-point column with between 2 and N/4 distinct values, not all integers, whose every value ``v`` is the
  mean label of the records holding ``v`` (an exact target encoding: the category is then the column itself, stored
  or not; at least two of its values over records of mixed labels, so a lone vote fraction of 0.5 over tied records
  is not taken for one), or that mean smoothed toward the global mean — ``(n·mean + m·global) / (n + m)`` for m in
  :data:`SMOOTHING`, and ``category_encoders``' sigmoid blend with its defaults — with n the number of such records;
  for labels of more than two classes, the same per class (the frequency of class k among them).

The labels are the 1-D (or ``[N, 1]``) integer-valued training tensors of 2 to 10,000 non-negative values (for
target encoding also a 1-D floating-point one: a regression target). Matches must hold for every record to a relative
tolerance of 1e-6; constant columns, and encodings equal to the labels themselves, are never taken. Not seen: an
encoding computed out of fold or leaving the record out (it is not a function of the category), smoothed otherwise,
rounded or rescaled, and weights from other counts (of a subset, of another column).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.fingerprints.public_names import is_public

SMOOTHING = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
"""Additive smoothing strengths m of a target encoding that are compared."""

MAX_COLUMNS = 4096
"""Columns of one tensor beyond which it is not read column by column."""

MAX_ELEMENTS = 1 << 27

_RTOL, _ATOL = 1e-6, 1e-9
_PREFIX = 32


def derived_columns(datasets: Sequence[Any], tensors: Sequence[tuple[str, Tensor]],
                    public: Sequence[str] = ()) -> list[str]:
    """The findings (module docstring) for the training ``tensors`` (path, tensor) and the NumPy arrays the
    ``datasets`` hold as attributes."""
    parts = [(path, t) for path, t in [*tensors, *_arrays(datasets)]
             if t.dim() in (1, 2) and 0 < t.numel() <= MAX_ELEMENTS and t.layout == torch.strided
             and not t.dtype.is_complex and t.dtype != torch.bool and not is_public(path.lstrip("."), public)]
    found: list[str] = []
    by_length: dict[int, list[tuple[str, Tensor]]] = {}
    for path, t in parts:
        by_length.setdefault(t.shape[0], []).append((path, t))
    for n, group in by_length.items():
        if n < 4:
            continue
        labels = [(path, _as_column(t)) for path, t in group if t.dim() == 1 or t.shape[1] == 1]
        columns = list(_columns(group))
        with torch.no_grad():
            for label_path, y in labels:
                if y is None:
                    continue
                others = [(p, c) for p, c in columns if p != _name(label_path, None)]
                found += _weight_columns(label_path, y, others)
                found += _encoded_columns(label_path, y, others)
    return list(dict.fromkeys(found))


def derived_columns_fix() -> str:
    return ("Per-record sample weights from the label counts and target-encoded features are such statistics, one "
            "copy per record: weight classes by a public prior, and encode categories by public values (an "
            "embedding learned under DP, one-hot columns) or by statistics estimated with a DP mechanism of your own.")


def _arrays(datasets: Sequence[Any]) -> Iterator[tuple[str, Tensor]]:
    """The numeric in-memory NumPy arrays the datasets hold as attributes (a memory-mapped one is read lazily: not)."""
    import numpy as np

    for d in datasets:
        for key, value in (vars(d).items() if hasattr(d, "__dict__") else ()):
            if isinstance(value, np.ndarray) and not isinstance(value, np.memmap) and value.dtype.kind in "fiu" \
                    and value.ndim in (1, 2):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a read-only array
                    yield f"dataset {type(d).__name__}.{key}", torch.as_tensor(value)


def _name(path: str, column: Optional[int]) -> str:
    where = path.lstrip(".") or "tensor"
    return where if column is None else f"column {column} of {where}"


def _as_column(t: Tensor) -> Optional[Tensor]:
    return t.detach().reshape(-1).to("cpu", torch.float64)


def _columns(group: Sequence[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(name, float64 CPU column) of the tensors of one length: 1-D tensors and ``[N, 1]`` ones whole, the columns
    of wider 2-D ones (up to :data:`MAX_COLUMNS`), read lazily."""
    for path, t in group:
        if t.dim() == 1 or t.shape[1] == 1:
            yield _name(path, None), _Lazy(t, None)
        elif t.shape[1] <= MAX_COLUMNS:
            for j in range(t.shape[1]):
                yield _name(path, j), _Lazy(t, j)


class _Lazy:
    """One column of a training tensor, its first rows read at once and the whole on demand (float64, CPU)."""

    def __init__(self, t: Tensor, j: Optional[int]) -> None:
        self.t, self.j = t, j
        self._whole: Optional[Tensor] = None
        self.head = self._read(slice(0, _PREFIX))

    def _read(self, rows: slice) -> Tensor:
        part = self.t.detach()[rows]
        return (part if self.j is None else part[:, self.j]).reshape(-1).to("cpu", torch.float64)

    @property
    def whole(self) -> Tensor:
        if self._whole is None:
            self._whole = self._read(slice(None))
        return self._whole


def _close(a: Tensor, b: Tensor) -> bool:
    return bool(((a - b).abs() <= _RTOL * b.abs() + _ATOL).all())


def _equal_column(expected: Tensor, column: Any) -> bool:
    """Equal to ``expected`` for every record (to :data:`_RTOL`): the first rows first, then all."""
    return _close(column.head, expected[:_PREFIX]) and _close(column.whole, expected)


def _labels(y: Tensor) -> Optional[Tensor]:
    """``y`` as class indices (int64) if it holds 2 to 10,000 non-negative integers, else ``None``."""
    if not bool(torch.isfinite(y).all()) or not bool((y == y.round()).all()) or float(y.min()) < 0 \
            or float(y.max()) >= 10_000:
        return None
    classes = y.to(torch.int64)
    return classes if int(torch.unique(classes).numel()) >= 2 else None


def _class_formulas(counts: Tensor) -> Iterator[tuple[str, Tensor]]:
    """The class-weight formulas of :func:`~.training_statistics.statistics_of`, over classes."""
    present = counts > 0
    yield "class count", counts
    yield "class frequency", counts / counts.sum()
    if bool(present.all()):
        yield "log class frequency", (counts / counts.sum()).log()
    inverse = torch.where(present, 1 / counts.clamp(min=1), torch.zeros_like(counts))
    k = int(present.sum())
    yield "inverse class count", inverse
    yield "inverse class frequency (summing to 1 over the classes)", inverse / inverse.sum()
    yield "inverse class frequency (averaging 1 over the classes)", inverse * k / inverse.sum()
    yield "balanced class weight", torch.where(present, counts.sum() / (k * counts.clamp(min=1)),
                                               torch.zeros_like(counts))


def _weight_columns(label_path: str, y: Tensor, columns: Sequence[tuple[str, Any]]) -> list[str]:
    classes = _labels(y)
    if classes is None:
        return []
    counts = torch.bincount(classes).to(torch.float64)
    found, matched = [], set()
    formulas = [(f, per_class[classes]) for f, per_class in _class_formulas(counts)]
    for how, scale in (("", None), (", normalised to sum 1 over the records", "sum"),
                       (", normalised to average 1 over the records", "mean")):
        for formula, e in formulas:
            if bool((e == e[0]).all()):  # every class as frequent: the weights say nothing
                continue
            expected = e if scale is None else e / (e.sum() if scale == "sum" else e.mean())
            for name, column in columns:
                if name not in matched and _equal_column(expected, column):
                    matched.add(name)
                    found.append(f"{name} is the {formula} of each record's label ({_name(label_path, None)}){how}: "
                                 "a sample weight computed from the training labels' counts")
    return found


def _encoded_columns(label_path: str, y: Tensor, columns: Sequence[tuple[str, Any]]) -> list[str]:
    classes = _labels(y)
    if classes is not None:
        k = int(classes.max()) + 1
        targets = [("", y)] + ([(f" of class {c}", (classes == c).to(torch.float64)) for c in range(min(k, 16))]
                               if k > 2 else [])
    elif y.dtype.is_floating_point and bool(torch.isfinite(y).all()):
        targets = [("", y)]  # a regression target
    else:
        return []
    low, high = float(y.min()), float(y.max())
    if classes is not None:
        low, high = min(low, 0.0), max(high, 1.0)
    n = y.numel()
    found = []
    for name, column in columns:
        head = column.head
        if bool((head < low).any()) or bool((head > high).any()):  # a mean of the labels lies within their range
            continue
        values = column.whole
        if not bool(torch.isfinite(values).all()) or bool((values == values.round()).all()) \
                or float(values.min()) < low or float(values.max()) > high:
            continue
        groups, inverse, sizes = torch.unique(values, return_inverse=True, return_counts=True)
        if not 2 <= groups.numel() <= n // 4:
            continue
        sizes = sizes.to(torch.float64)
        for what, target in targets:
            sums = torch.zeros(groups.numel(), dtype=torch.float64).index_add_(0, inverse, target)
            means = sums / sizes
            if _close(means[inverse], target):
                continue  # each value's records share one label: the column tells the label, no statistic
            mixed = (means > float(target.min()) + 1e-12) & (means < float(target.max()) - 1e-12)
            if int(mixed.sum()) < 2:
                continue  # one mixed level (a vote fraction of 0.5 over tied records) can match its mean by chance
            how = _smoothing(groups, means, sizes, float(target.mean()))
            if how is not None:
                found.append(f"{name} is the mean label{what} ({_name(label_path, None)}) of the training records "
                             f"holding each of its values{how}: a target encoding of a category")
                break
    return found


def _smoothing(groups: Tensor, means: Tensor, sizes: Tensor, overall: float) -> Optional[str]:
    """How ``groups`` (a column's distinct values) encode the per-value label ``means`` (exactly, or smoothed toward
    ``overall`` with the records' counts ``sizes``), or ``None``."""
    if _close(groups, means):
        return ""
    for m in SMOOTHING:
        if _close(groups, (sizes * means + m * overall) / (sizes + m)):
            return f" (smoothed toward the global mean with strength {m:g})"
    for leaf, smoothing in ((20.0, 10.0), (1.0, 1.0)):  # category_encoders.TargetEncoder's defaults, old and new
        blend = 1 / (1 + torch.exp(-(sizes - leaf) / smoothing))
        encoded = torch.where(sizes == 1, torch.full_like(means, overall), overall * (1 - blend) + means * blend)
        if _close(groups, encoded):
            return f" (category_encoders' smoothing, min_samples_leaf={leaf:g}, smoothing={smoothing:g})"
    return None
