"""Small DataModules over data that ships with installed packages (no downloads)."""

from lightning_dp.data.augmentation import AugmentedViews, RandomShift
from lightning_dp.data.digits import DigitsDataModule
from lightning_dp.data.font_digits import FontDigits, render_font_digits
from lightning_dp.data.pydoc_text import PydocTextDataModule
from lightning_dp.records.distinct_records import DistinctRecords

__all__ = ["AugmentedViews", "DigitsDataModule", "DistinctRecords", "FontDigits", "PydocTextDataModule", "RandomShift",
           "render_font_digits"]
