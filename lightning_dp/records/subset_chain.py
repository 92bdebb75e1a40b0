"""A dataset under its ``Subset`` wrappers: which records of each level a selection reads.

``random_split`` and hand-made ``Subset`` s nest; the training population, a validation split and data declared
public are compared by the dataset at the bottom of the chain and the indices of it they read (negative indices
counted from the end, as ``Subset`` reads them)."""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data import Subset


def subset_levels(dataset: Any, indices: Optional[list[int]] = None) -> list[tuple[Any, Optional[list[int]]]]:
    """``dataset`` and each dataset under its ``Subset`` wrappers, with the indices of it that positions ``indices``
    of ``dataset`` read (``None``: all)."""
    out = [(dataset, indices)]
    while isinstance(dataset, Subset):
        own, size = [int(i) for i in dataset.indices], len(dataset.dataset)  # type: ignore[arg-type]
        own = [i + size if i < 0 else i for i in own]
        indices = own if indices is None else [own[i] for i in indices]
        dataset = dataset.dataset
        out.append((dataset, indices))
    return out


def selected_rows(dataset: Any, indices: Optional[list[int]] = None) -> tuple[Any, Optional[set[int]]]:
    """(the dataset under any ``Subset`` wrappers, the indices of it that positions ``indices`` of ``dataset`` read;
    ``None``: all)."""
    base, rows = subset_levels(dataset, indices)[-1]
    return base, None if rows is None else set(rows)
