"""A LightningDataModule whose training set is another module's plus the audit's canaries."""

from __future__ import annotations

from typing import Optional

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset


class TrainSetWrapper(pl.LightningDataModule):
    """Wraps ``base``: preparation and setup are delegated, and the training loader serves
    :meth:`wrap_train_set` of the base training set with the same batch size (DPStrategy
    re-samples it with Poisson sampling anyway)."""

    def __init__(self, base: pl.LightningDataModule) -> None:
        super().__init__()
        self.base = base

    def wrap_train_set(self, dataset: Dataset) -> Dataset:
        """The training set to serve instead of the base one (subclasses add their canaries)."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Delegate to the wrapped module."""
        self.base.prepare_data()

    def setup(self, stage: Optional[str] = None) -> None:
        """Delegate to the wrapped module."""
        self.base.setup(stage)

    def train_dataloader(self) -> DataLoader:
        """The wrapped loader's dataset through :meth:`wrap_train_set`, same batch size."""
        loader = self.base.train_dataloader()
        dataset = self.wrap_train_set(loader.dataset)
        return DataLoader(dataset, batch_size=loader.batch_size, shuffle=True, num_workers=loader.num_workers)
