"""scikit-learn's handwritten digits (1,797 images of 8×8 pixels) as a LightningDataModule.

The data ships inside scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp._extras import require
from lightning_dp.data.augmentation import AugmentedViews, RandomShift


class DigitsDataModule(pl.LightningDataModule):
    """Train/test split of ``sklearn.datasets.load_digits``, pixels scaled to [-1, 1].

    Args:
        batch_size: expected (Poisson) batch size per process under DPStrategy.
        test_fraction: share of the 1,797 images held out for testing (stratified).
        val_fraction: share of the *training* images held out for validation (0 = none: then
            :attr:`val_dataloader` is ``None`` and Lightning skips validation).
        split_seed: seed of the (public) train/test split.
        num_workers: DataLoader workers.
        augmentation_multiplicity: K views per training example (:class:`AugmentedViews`, random shifts of
            up to ``max_shift`` pixels); give the same K to ``DPStrategy(augmentation_multiplicity=K)``.
        max_shift: largest shift of an augmented view, in pixels.
    """

    num_classes = 10
    image_shape = (1, 8, 8)

    def __init__(
        self,
        batch_size: int = 64,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        split_seed: int = 0,
        num_workers: int = 0,
        augmentation_multiplicity: int = 1,
        max_shift: int = 1,
    ) -> None:
        super().__init__()
        if not 0 < test_fraction < 1 or not 0 <= val_fraction < 1:
            raise ValueError("test_fraction must be in (0, 1) and val_fraction in [0, 1)")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.save_hyperparameters()
        self._has_val = val_fraction > 0
        self.batch_size = batch_size
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load, split and scale to [-1, 1] (idempotent)."""
        if self.train_set is not None:
            return
        load_digits = require("sklearn.datasets", "data").load_digits
        train_test_split = require("sklearn.model_selection", "data").train_test_split

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
        y = torch.tensor(digits.target, dtype=torch.long)
        seed = self.hparams.split_seed
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=self.hparams.test_fraction, random_state=seed,
                                                  stratify=y)
        if self.hparams.val_fraction > 0:
            x_tr, x_va, y_tr, y_va = train_test_split(
                x_tr, y_tr, test_size=self.hparams.val_fraction, random_state=seed, stratify=y_tr
            )
        # Public normalisation constants: the 0..16 pixel range of the sensor, not data statistics.
        scale = lambda t: (t / 16.0 - 0.5) / 0.5  # noqa: E731
        self.train_set = TensorDataset(scale(x_tr), y_tr)
        self.test_set = TensorDataset(scale(x_te), y_te)
        if self.hparams.val_fraction > 0:
            self.val_set = TensorDataset(scale(x_va), y_va)

    def train_dataloader(self) -> DataLoader:
        """Training loader (DPStrategy rebuilds it around Poisson sampling); with augmentation multiplicity
        K > 1, each example arrives as K shifted views (the first unshifted), consecutive rows."""
        k = self.hparams.augmentation_multiplicity
        if k == 1:
            return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                              num_workers=self.hparams.num_workers)
        views = AugmentedViews(self.train_set, RandomShift(self.hparams.max_shift, fill=-1.0), k, identity_first=True)
        return DataLoader(views, batch_size=self.batch_size, shuffle=True, collate_fn=AugmentedViews.collate,
                          num_workers=self.hparams.num_workers)

    @property
    def val_dataloader(self) -> Optional[Callable[[], DataLoader]]:  # type: ignore[override]
        """The validation hook (``dm.val_dataloader()`` builds the loader), or ``None`` when
        ``val_fraction`` is 0.

        ``None`` is how a datamodule tells Lightning it has no validation data (its
        ``is_overridden`` check): validation is skipped. Returning an empty list instead makes
        Lightning warn "Total length of `list` across ranks is zero" on every fit.
        """
        return self._validation_loader if getattr(self, "_has_val", False) else None

    def _validation_loader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        """Held-out test loader."""
        return DataLoader(self.test_set, batch_size=256, num_workers=self.hparams.num_workers)
