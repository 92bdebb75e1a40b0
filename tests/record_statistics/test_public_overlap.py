"""Data declared public compared with the private training records (record_statistics/public_overlap.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_statistics.public_overlap import check_public_dataset, training_rows_share


def _data(n: int, seed: int, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_a_subset_copy_or_half_copy_of_the_training_rows_is_refused():
    full = _data(600, seed=0)
    x, y = full.tensors
    training = Subset(full, range(100, 400))
    mixed = torch.cat([x[100:160], _data(240, seed=5).tensors[0]])  # a fifth of its rows are training rows
    for public in (TensorDataset(x[100:400].clone(), y[100:400]), TensorDataset(x[100:400].half(), y[100:400]),
                   TensorDataset(mixed, torch.zeros(300).long()), Subset(full, [399, 450]), full):
        with pytest.raises(PrivacyConfigurationError, match="Pass public data"):
            check_public_dataset(public, training)


def test_independent_data_a_held_out_part_and_low_entropy_rows_pass():
    full = _data(600, seed=0)
    training = Subset(full, range(100, 400))
    check_public_dataset(_data(600, seed=1), training)
    check_public_dataset(Subset(full, range(400, 600)), training)  # the other indices of the same tensor
    binary = TensorDataset((torch.rand(500, 6, generator=torch.Generator().manual_seed(0)) > 0.5).float())
    other = TensorDataset((torch.rand(500, 6, generator=torch.Generator().manual_seed(1)) > 0.5).float())
    check_public_dataset(other, binary)  # 64 possible rows: independent sets share them by nature


def test_only_the_rows_a_training_subset_selects_count():
    full = _data(600, seed=0)
    held_out = [r for r in full.tensors[0][400:600]]
    assert training_rows_share(held_out, Subset(full, range(100, 400))) == (0, 200)
    assert training_rows_share(held_out, full) == (200, 200)


def test_font_digits_still_pretrain_for_scikit_learns_digits():
    pytest.importorskip("sklearn")
    from lightning_dp.data import FontDigits
    from lightning_dp.data.digits import DigitsDataModule

    digits = DigitsDataModule()
    digits.setup("fit")
    font = FontDigits(size=2000)
    assert training_rows_share([x for x, _ in font], digits.train_set)[0] == 0
    check_public_dataset(font, digits.train_set)
    check_public_dataset(digits.test_set, digits.train_set)  # another split: no shared rows (nor public: not judged)
