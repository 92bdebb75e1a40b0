"""Statistics of coarse classes of the training labels: the class counts of a public map of the labels.

Rule 11 matches what the user's objects hold with the labels' class counts and the weights derived from them
(:func:`~.training_statistics.statistics_of`), and for two classes with the single numbers a binary loss keeps (a
``pos_weight = neg / pos``, a focal loss's alpha). Code on a task of K > 2 classes often trains or weights a coarser
task: an ordinal grade binarised (``y >= 2``, ``y > 0``, ``y.clamp(max=1)``), one class against the rest
(``y == 3``), fine classes folded into coarse ones
(``y // 2``, ``y >> 1``), a parity (``y % 2``). A ``pos_weight`` or prior of those, computed in a datamodule's
``setup`` from the records it loads there (where no exchange of the training data in memory reaches: zoo39 L05), was
no statistic the check knew.

:func:`coarse_statistics` gives, from the K class counts, those of the public groupings — the thresholds ``y >= k``
(k = 1 … K − 1), one class against the rest ``y == k``, the folds ``y // d`` (d = 2 … K // 2), the residues
``y % m`` (m = 2 … K // 2) — as class frequencies (vectors of the groups, with their log and balanced weights when every
group is present) and, for the two-group ones, the single numbers a binary loss keeps: each group's fraction and the
ratio of the two counts. At most 10 classes (under a hundred numbers: a lone number is matched at float precision,
and every extra statistic is a chance for a held value to meet one; :func:`~.training_statistics._lone_tolerance`).

Not seen: groupings other than these (an arbitrary table of fine to coarse classes, CIFAR-100's superclasses), and
more than 10 classes.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

__all__ = ["coarse_statistics", "MAX_CLASSES"]

MAX_CLASSES = 10
"""The most classes whose coarse groupings are summarised."""


def groupings(classes: int) -> Iterator[tuple[str, Tensor]]:
    """(name, group of each class) of the public groupings of ``classes`` classes (module docstring)."""
    labels = torch.arange(classes)
    for k in range(1, classes):
        yield f"y >= {k}", (labels >= k).long()
    for k in range(classes):
        yield f"y == {k}", (labels == k).long()
    for d in range(2, classes // 2 + 1):
        if -(-classes // d) > 2:  # two groups: a threshold above
            yield f"y // {d}", labels // d
    for m in range(2, classes // 2 + 1):
        yield f"y % {m}", labels % m


def coarse_statistics(counts: Tensor) -> Iterator[tuple[str, Tensor]]:
    """The statistics of the coarse groupings of labels whose class counts are ``counts`` (float64, K of them);
    nothing for K < 3 or K > :data:`MAX_CLASSES` (module docstring)."""
    classes = len(counts)
    if classes < 3 or classes > MAX_CLASSES:
        return
    total = counts.sum()
    for name, group in groupings(classes):
        grouped = torch.zeros(int(group.max()) + 1, dtype=counts.dtype).index_add_(0, group, counts)
        yield f"class frequencies of {name}", grouped / total
        if not bool((grouped > 0).all()):
            continue
        yield f"log class frequencies of {name}", (grouped / total).log()
        yield f"balanced class weights of {name}", total / (len(grouped) * grouped)
        if len(grouped) == 2:
            for g in (0, 1):
                yield f"fraction of class {g} of {name}", grouped[g] / total
                yield f"ratio of the class counts ({g} to {1 - g}) of {name}", grouped[g] / grouped[1 - g]
