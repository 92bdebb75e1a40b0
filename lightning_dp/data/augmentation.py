"""Augmentation multiplicity (De et al. 2022, "Unlocking high-accuracy differentially private image
classification through scale", §3.1): each sampled example contributes the mean gradient of K
augmented views of itself, clipped once.

:class:`AugmentedViews` turns a dataset into one of K views per item, and :meth:`AugmentedViews.collate`
lays a batch out as the mechanism expects: example i's views are rows i·K … i·K + K − 1 of every
tensor, so the user's ``training_step`` runs unchanged on B·K rows. Pass the same K to
``DPStrategy(augmentation_multiplicity=K)``: the engine checks every layer sees B·K rows and
averages each example's K per-row gradients before clipping.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate


class AugmentedViews(Dataset):
    """Item i is a list of K views ``transform(dataset[i])`` (fresh randomness for each).

    Args:
        dataset: the original dataset (map-style).
        transform: maps one item (e.g. ``(image, label)``) to an augmented item of the same structure.
        views: K ≥ 1.
        identity_first: the first view is the item itself (untransformed), as in De et al.
    """

    def __init__(self, dataset: Dataset, transform: Callable[[Any], Any], views: int,
                 identity_first: bool = False) -> None:
        if not (isinstance(views, int) and views >= 1):
            raise ValueError(f"views must be an integer >= 1, got {views!r}")
        self.dataset, self.transform, self.views, self.identity_first = dataset, transform, views, identity_first

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> list[Any]:
        item = self.dataset[index]
        first = [item] if self.identity_first else []
        return first + [self.transform(item) for _ in range(self.views - len(first))]

    @staticmethod
    def collate(batch: Sequence[list[Any]]) -> Any:
        """B lists of K views → one batch of B·K rows, each example's views consecutive."""
        return default_collate([view for views in batch for view in views])


class RandomShift:
    """Shift an image ``[C, H, W]`` by up to ``max_shift`` pixels in each direction, filling with
    ``fill`` (small translations: the augmentation that suits 8×8 digits). Applied to the first
    element of an ``(image, label)`` item; labels pass through.

    Args:
        max_shift: largest shift in pixels.
        fill: value of the pixels shifted in (the background; -1 for DigitsDataModule's [-1, 1] scale).
    """

    def __init__(self, max_shift: int = 1, fill: float = -1.0) -> None:
        self.max_shift, self.fill = max_shift, fill

    def __call__(self, item: Any) -> Any:
        if isinstance(item, (tuple, list)):
            return type(item)([self(item[0]), *item[1:]])
        return self.shift(item)

    def shift(self, image: Tensor) -> Tensor:
        """One random translation of ``image``."""
        m = self.max_shift
        dy, dx = (int(v) for v in torch.randint(-m, m + 1, (2,)))
        padded = torch.nn.functional.pad(image, (m, m, m, m), value=self.fill)
        h, w = image.shape[-2:]
        return padded[..., m + dy: m + dy + h, m + dx: m + dx + w]
