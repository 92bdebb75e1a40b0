"""Records that share data (record_checks/shared_records.py): overlapping windows, records mixed with a neighbour or a
random partner, and records normalised by the whole tensor are refused before training; records that are their own
rows — a TensorDataset, a Subset or random_split of one, several rows of one's own, a shared class table, next-token
chunks whose last target is the next chunk's first input, a padding row, a lookup table read through the record's own
ids — are not; two indices reading one stored row (a __len__ of 2N over N rows, the second N augmented views) are
refused; the data is left exactly as it was."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, random_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError, Users  # noqa: E402
from lightning_dp.data.pydoc_text import windows  # noqa: E402
from lightning_dp.record_checks.shared_records import check_shared_records, row_sources  # noqa: E402

G = torch.Generator().manual_seed(3)
X = torch.randn(64, 4, generator=G)
Y = (X[:, 0] > 0).long()
TOKENS = torch.randint(0, 50, (64 * 8 + 1,), generator=G)
PARTNER = torch.randperm(64, generator=G)
TABLE = torch.randn(2, 4, generator=G)  # one row per class: no person's
WIDE = torch.randn(64, 64, generator=G)
PAD = torch.zeros(1, 4)  # a constant row every record reads
EMB = torch.randn(32, 4, generator=G)  # a lookup table, read through each record's own token ids
TOKEN_IDS = torch.randint(0, 32, (64, 3), generator=G)


class Records(Dataset):
    """``n`` records, record i given by ``make(i)`` (reading the module's globals above)."""

    def __init__(self, make: Callable[[int], Any], n: int = 64) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.make(i), Y[i % 64]


class Flat(Dataset):
    """Windows over a flat copy the dataset keeps (views of its memory)."""

    def __init__(self, stride: int) -> None:
        self.flat, self.stride = X.reshape(-1).clone(), stride

    def __len__(self) -> int:
        return (self.flat.numel() - 4) // self.stride + 1

    def __getitem__(self, i: int) -> Any:
        return self.flat[i * self.stride: i * self.stride + 4], Y[i % 64]


def check(dataset: Dataset) -> None:
    check_shared_records(dataset, lambda p: p, len(dataset))


SHARING = {
    "windows over rows": Records(lambda i: X[i:i + 4].mean(0), 61),
    "windows over a flat copy (views)": Flat(stride=2),
    "mixed with its neighbour": Records(lambda i: 0.5 * (X[i] + X[(i + 1) % 64])),
    "mixed with a random partner": Records(lambda i: 0.7 * X[i] + 0.3 * X[PARTNER[i]]),
    "halves of its own row and of the next": Records(lambda i: torch.cat([X[i, :2], X[(i + 1) % 64, 2:]])),
    "mixed with a random partner (wide rows)": Records(lambda i: 0.7 * WIDE[i] + 0.3 * WIDE[PARTNER[i]]),
    "normalised by the whole tensor": Records(lambda i: (X[i] - X.mean(0)) / X.std(0)),
    "next-token windows at half stride": Records(lambda i: TOKENS[i * 4:i * 4 + 9].float()),
}

# offline augmentation doubling the data: index i >= 64 is a view of stored row i % 64 (zoo24 e2_dup_aug_x2)
AUGMENTED_TWICE = {
    "flipped": Records(lambda i: X[i % 64] if i < 64 else torch.flip(X[i % 64], [0]) * 1.0, 128),
    "cropped": Records(lambda i: X[i % 64] if i < 64 else X[i % 64][1:], 128),
    "noised": Records(lambda i: X[i % 64] if i < 64 else X[i % 64] + 0.1 * torch.randn(4), 128),
    "interleaved (index // 2)": Records(lambda i: X[i // 2] if i % 2 == 0 else torch.flip(X[i // 2], [0]), 128),
}

OWN = {
    "a TensorDataset": TensorDataset(X, Y),
    "windows at their own stride (views)": Flat(stride=4),
    "two rows of its own": Records(lambda i: X[2 * (i % 32)] + X[2 * (i % 32) + 1], 32),
    "a class table smaller than the population": Records(lambda i: X[i] + TABLE[Y[i]]),
    "next-token chunks sharing their edge token": Records(lambda i: TOKENS[i * 8:i * 8 + 9].float()),
    "next-token windows as [windows, T] views of one text": windows(TOKENS, 8),
    "a Subset of a TensorDataset": Subset(TensorDataset(X, Y), list(range(0, 64, 2))),
    "a shared padding row": Records(lambda i: torch.cat([X[i, :2], PAD[0, :2]])),
    "a lookup table read through its own ids": Records(lambda i: X[i] + EMB[TOKEN_IDS[i]].mean(0)),
}


@pytest.mark.parametrize("name", sorted(SHARING))
def test_records_sharing_rows_are_refused(name: str) -> None:
    dataset = SHARING[name]
    with pytest.raises(PrivacyConfigurationError, match="Training records share data"):
        check(dataset)


@pytest.mark.parametrize("name", sorted(OWN))
def test_records_made_of_their_own_rows_pass_and_the_data_is_untouched(name: str) -> None:
    before = [X.clone(), TOKENS.clone()]
    versions = [X._version, TOKENS._version]
    check(OWN[name])
    assert torch.equal(X, before[0]) and torch.equal(TOKENS, before[1])
    assert [X._version, TOKENS._version] == versions


@pytest.mark.parametrize("name", sorted(AUGMENTED_TWICE))
def test_indices_reading_one_stored_row_are_refused_whatever_the_fetch_does(name: str) -> None:
    """Two indices of one dataset reading the same row (a __len__ of 2N, the second N a flipped, cropped or noised
    view): one person's row is two records, each sampled with its own chance: refused, naming the fix."""
    with pytest.raises(PrivacyConfigurationError, match="Augment on the fly inside __getitem__, one index per record"):
        check(AUGMENTED_TWICE[name])


class Padded(Dataset):
    """Records held in a dict (no array the checks see), each read with the one padding row of a tiny table."""

    def __init__(self) -> None:
        self.records = {i: X[i].clone() for i in range(8)}
        self.pad = torch.zeros(1, 4)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return torch.cat([self.records[i], self.pad[0]]), i % 2


def test_a_padding_row_every_record_reads_trains() -> None:
    """A constant row that every record reads is no one's: not refused, also when the table is the only array the
    dataset holds and has 1 row for 8 records; the fit trains."""
    check(Padded())
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(OWN["a shared padding row"], batch_size=16))
    assert dp.ledger.steps == 2


def test_augmented_twice_behind_random_split_is_refused_in_a_fit() -> None:
    """The twin index i + N is at some other position of the split: found through the split's indices."""
    train, _ = random_split(AUGMENTED_TWICE["flipped"], [112, 16], generator=torch.Generator().manual_seed(0))
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="one row several records"):
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(train, batch_size=16))
    assert dp.ledger.steps == 0


def test_the_sources_are_the_datasets_arrays_and_their_modules_globals() -> None:
    names = [name for name, _ in row_sources(SHARING["mixed with its neighbour"], 64)]
    assert any(n.endswith(f"{__name__}.X") for n in names)
    assert not any(n.endswith(".TABLE") for n in names), "fewer rows than records: a table, no person's"
    assert not [n for n, _ in row_sources(SHARING["mixed with its neighbour"], 10_000)], "fewer rows than records"


def test_overlapping_windows_behind_random_split_are_refused_in_a_fit() -> None:
    train, _ = random_split(Records(lambda i: X[i:i + 4].mean(0), 61), [48, 13],
                            generator=torch.Generator().manual_seed(0))
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="Training records share data"):
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(train, batch_size=16))
    assert dp.ledger.steps == 0


def test_user_level_units_may_span_several_records() -> None:
    """Windows of one user's series overlap, and the user is the unit: not refused (the unit is sampled whole)."""
    dp = strategy(privacy_unit=Users([i // 4 for i in range(61)], users_per_batch=4))
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(
        Records(lambda i: X[i:i + 4].mean(0), 61), batch_size=16))
    assert dp.ledger.steps == 2


class Decoding(Dataset):
    """Decodes a record into a preallocated tensor on every read (``always``) or on its first read only."""

    def __init__(self, always: bool) -> None:
        self.cache = torch.zeros(64, 4)
        self.filled = [False] * 64
        self.always = always

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        if self.always or not self.filled[i]:
            self.cache[i] = X[i] * 2  # the "decoding"
            self.filled[i] = True
        return self.cache[i], Y[i]


@pytest.mark.parametrize("always", [True, False], ids=["writes on every read", "fills a cache once"])
def test_a_dataset_writing_as_it_reads_is_left_intact(always: bool) -> None:
    dataset = Decoding(always)
    check(dataset)
    filled = torch.tensor(dataset.filled)
    assert filled.any()
    assert torch.equal(dataset.cache[filled], X[filled] * 2), "no record garbled by an exchange"
    assert not dataset.cache[~filled].any()
