"""Small DataModules over data that ships with installed packages (no downloads), and a private standardiser for
tabular features (:class:`PrivateStandardizer`) and imputer of missing values (:class:`PrivateImputer`)."""

from lightning_dp.data.augmentation import AugmentedViews, RandomShift
from lightning_dp.data.digits import DigitsDataModule
from lightning_dp.data.font_digits import FontDigits, render_font_digits
from lightning_dp.data.private_imputer import PrivateImputer
from lightning_dp.data.private_standardizer import PrivateStandardizer
from lightning_dp.data.pydoc_text import PydocTextDataModule
from lightning_dp.records.distinct_records import DistinctRecords

__all__ = ["AugmentedViews", "DigitsDataModule", "DistinctRecords", "FontDigits", "PrivateImputer",
           "PrivateStandardizer", "PydocTextDataModule", "RandomShift", "render_font_digits"]
