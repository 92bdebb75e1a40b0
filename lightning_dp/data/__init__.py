"""Small DataModules over data that ships with installed packages (no downloads)."""

from lightning_dp.data.augmentation import AugmentedViews, RandomShift
from lightning_dp.data.digits import DigitsDataModule
from lightning_dp.data.pydoc_text import PydocTextDataModule

__all__ = ["AugmentedViews", "DigitsDataModule", "PydocTextDataModule", "RandomShift"]
