"""Small DataModules over data that ships with installed packages (no downloads)."""

from lightning_dp.data.digits import DigitsDataModule
from lightning_dp.data.pydoc_text import PydocTextDataModule

__all__ = ["DigitsDataModule", "PydocTextDataModule"]
