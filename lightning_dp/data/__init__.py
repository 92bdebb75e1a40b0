"""Small DataModules over data that ships with installed packages (no downloads)."""

from lightning_dp.data.digits import DigitsDataModule

__all__ = ["DigitsDataModule"]
