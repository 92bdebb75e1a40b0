"""Batches built from the training population, so that behaviour a rare label or a batch size switches on shows at once.

The batch check (:mod:`~lightning_dp.validators.batch_check`) compares the step's own sampled batch. Behaviour that
depends on what a batch holds shows only on the batches that hold it: rare-class rows sharing a fixed loss budget
(``l = where(y == rare, l * 4 / rare.sum(), l)``: two rare rows in one batch couple), standardising a batch only when
it is large (``if len(x) >= 36``), something done to batches of two. The first step's batch may hold none of it and
later steps are only sampled. At the first check the batch check therefore also runs on the batches built here from
the records the loader draws from (read and compared like the sampled one, never trained on, never released):

* **every label** (:func:`label_batch`): two records of each label value present in the population (one only if
  it has one), one of each pair in each half of the comparison, the rarest labels first, at most
  ``max_examples // 2`` labels. The labels are found without reading a record: the integer 1-D tensors of a
  ``TensorDataset`` (the last first) or a ``targets``/``labels``/``y`` attribute of the dataset under its ``Subset``
  wrappers (torchvision's datasets), holding 2 to :data:`MAX_LABELS` values; none found, no such batch;
* **the largest batch** the Poisson sampler plausibly draws: ⌈B + 4√B⌉ records at random (B the expected batch of
  this process; a Poisson batch exceeds it with probability about 3·10⁻⁵), at most the population; the check compares
  ``max_examples`` of them and passes them at the size the step sees (``max_physical_batch_size`` caps it);
* not the smallest (2 records): at 2 or 3 examples some models' layers cannot tell their examples from their own
  dimensions (the zoo's stacked speakers), a false refusal; behaviour switched on by a tiny batch is left to the
  sampled checks.

The choice of records is public (an OS-seeded generator, the labels' values never leave: only which rows are
compared); the cost is at most three more batch checks on at most ``max_examples`` examples each, once per fit.
"""

from __future__ import annotations

import math
import random
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

MAX_LABELS = 10_000
"""Distinct values beyond which an integer column is not taken for labels."""

_NAMES = ("targets", "labels", "y", "target", "label")


def largest_batch(expected: float, population: int) -> int:
    """⌈B + 4√B⌉ for the expected batch B, at most ``population``."""
    return max(2, min(population, math.ceil(expected + 4 * math.sqrt(max(expected, 0.0)))))


def label_batch(dataset: Any, population: Sequence[int], max_examples: int,
                rng: random.Random) -> Optional[list[int]]:
    """Dataset indices (of ``population``, the loader's) holding every label value present, two of each where there
    are two: the first half of the list one of each pair (and half of the labels seen once), the second half the
    other; ``None`` when no labels are found or they hold one value."""
    base, rows = _base_rows(dataset, population)
    labels = _labels(base)
    if labels is None or not len(rows):
        return None
    values = labels[rows]
    kinds, counts = torch.unique(values, return_counts=True)
    if kinds.numel() < 2:
        return None
    pairs: list[tuple[int, int]] = []
    single: list[int] = []
    for kind in kinds[counts.argsort(stable=True)][: max(1, max_examples // 2)].tolist():
        where = (values == kind).nonzero().flatten().tolist()
        taken = rng.sample(where, min(2, len(where)))
        if len(taken) == 2:
            pairs.append((taken[0], taken[1]))
        else:
            single.append(taken[0])
    half = [a for a, _ in pairs] + single[: len(single) // 2]
    rest = [b for _, b in pairs] + single[len(single) // 2:]
    return [int(population[i]) for i in half + rest]


def _base_rows(dataset: Any, population: Sequence[int]) -> tuple[Any, torch.Tensor]:
    """The dataset under ``dataset``'s ``Subset`` wrappers and the rows of it the indices ``population`` read (as
    :func:`~lightning_dp.records.subset_chain.subset_levels`, in tensors: a ``range`` of millions stays cheap)."""
    rows = (torch.arange(population.start, population.stop, population.step) if isinstance(population, range)
            else torch.as_tensor(list(population), dtype=torch.int64))
    while isinstance(dataset, Subset):
        own = torch.as_tensor(list(dataset.indices), dtype=torch.int64).reshape(-1)
        own = torch.where(own < 0, own + len(dataset.dataset), own)
        rows, dataset = own[rows], dataset.dataset
    return dataset, rows


def _labels(base: Any) -> Optional[torch.Tensor]:
    """The labels of every record of ``base`` as int64 (module docstring), or ``None``."""
    n = len(base) if hasattr(base, "__len__") else -1
    found: list[Any] = list(reversed(base.tensors)) if isinstance(base, TensorDataset) else []
    found += [getattr(base, name) for name in _NAMES if name in getattr(base, "__dict__", {})]
    for value in found:
        column = _column(value, n)
        if column is not None:
            return column
    return None


def _column(value: Any, n: int) -> Optional[torch.Tensor]:
    """``value`` as an int64 column of ``n`` labels (2 to :data:`MAX_LABELS` non-negative integers), or ``None``."""
    try:
        if isinstance(value, list) and value and not isinstance(value[0], (int, np.integer)):
            return None
        t = torch.as_tensor(np.asarray(value) if isinstance(value, list) else value)
    except Exception:  # noqa: BLE001  (not a numeric array)
        return None
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1 or t.shape[0] != n or t.dtype == torch.bool or t.is_complex() or n < 2:
        return None
    t = t.detach().to("cpu")
    if t.is_floating_point() and not bool((torch.isfinite(t) & (t == t.round())).all()):
        return None
    if float(t.min()) < 0 or float(t.max()) >= 2**31:
        return None
    t = t.to(torch.int64)
    return t if 2 <= int(torch.unique(t).numel()) <= MAX_LABELS else None
