"""State a dataset's reads write besides its records (record_checks/read_writes.py, through record_checks/records.py and
record_checks/shared_records.py): statistics of the whole tensor computed on the first read and cached — an attribute,
a ``cached_property``, an ``lru_cache`` method, a module global, a transform fitted on first use — are computed again
for every exchanged read, so the records' dependence on every row shows and is refused, like the same statistics
computed on every read; a per-record cache, a read counter and a decode cache written in place pass; the dataset is
left as it was found."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_checks.read_writes import ReadWrites  # noqa: E402
from lightning_dp.record_checks.records import check_records  # noqa: E402

G = torch.Generator().manual_seed(7)
X = torch.randn(64, 4, generator=G) * 3 + 1
Y = (X[:, 0] > 1).long()
STATS: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class Base(Dataset):
    def __init__(self) -> None:
        self.x, self.y = X.clone(), Y.clone()

    def __len__(self) -> int:
        return 64


class Cached(Base):
    """The whole tensor's mean and deviation computed on the first read, rounded, and kept on the dataset."""

    def __init__(self) -> None:
        super().__init__()
        self._stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __getitem__(self, i: int) -> Any:
        if self._stats is None:
            self._stats = (self.x.mean(0).round(decimals=2), self.x.std(0).round(decimals=2))
        m, s = self._stats
        return (self.x[i] - m) / s, self.y[i]


class Property(Base):
    @functools.cached_property
    def mean(self) -> torch.Tensor:
        return self.x.mean(0)

    def __getitem__(self, i: int) -> Any:
        return self.x[i] - self.mean, self.y[i]


class LruMethod(Base):
    @functools.lru_cache(maxsize=None)  # noqa: B019  (the pattern under test)
    def scale(self) -> float:
        return float(self.x.abs().max())

    def __getitem__(self, i: int) -> Any:
        return self.x[i] / self.scale(), self.y[i]


class Global(Base):
    def __getitem__(self, i: int) -> Any:
        global STATS
        if STATS is None:
            STATS = (self.x.mean(0), self.x.std(0))
        return (self.x[i] - STATS[0]) / STATS[1], self.y[i]


class FitOnFirstUse:
    """A transform of the user's that fits a standardisation on the first call."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.fitted = data, None

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        if self.fitted is None:
            self.fitted = (self.data.mean(0), self.data.std(0))
        return (row - self.fitted[0]) / self.fitted[1]


class Transformed(Base):
    def __init__(self) -> None:
        super().__init__()
        self.transform = FitOnFirstUse(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.x[i]), self.y[i]


class PerRecordCache(Base):
    """A record's own value cached by index, and a read counter: what a read writes is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[int, torch.Tensor] = {}
        self.reads = 0

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        if i not in self.cache:
            self.cache[i] = self.x[i] * 2
        return self.cache[i], self.y[i]


class DecodedInPlace(Base):
    """Records decoded into a preallocated tensor behind a flag: left alone (its flags are not put back)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = torch.zeros(64, 4)
        self.done = [False] * 64

    def __getitem__(self, i: int) -> Any:
        if not self.done[i]:
            self.decoded[i] = self.x[i] * 2
            self.done[i] = True
        return self.decoded[i], self.y[i]


CACHED = {"an attribute": Cached, "a cached_property": Property, "an lru_cache method": LruMethod,
          "a module global": Global, "a transform fitted on first use": Transformed}


@pytest.mark.parametrize("name", sorted(CACHED))
def test_a_statistic_cached_on_the_first_read_is_refused(name: str) -> None:
    global STATS
    STATS = None
    dataset = CACHED[name]()
    with pytest.raises(PrivacyConfigurationError, match="Training records share data.*computed once and cached"):
        check_records(dataset, None, 64)
    assert torch.equal(dataset.x, X)


def test_the_refusal_names_what_the_reads_wrote() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"the reads also write Cached\._stats"):
        check_records(Cached(), None, 64)


def test_a_cached_statistic_is_refused_in_a_fit_before_any_release() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="Training records share data"):
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(Cached(), batch_size=16))
    assert dp.ledger.steps == 0


def test_what_the_reads_write_of_their_own_passes_and_is_put_back() -> None:
    dataset = PerRecordCache()
    check_records(dataset, None, 64)
    assert sorted(dataset.cache) == list(range(64)), "left as the plain reads (all 64 records) left it"
    assert all(torch.equal(v, X[i] * 2) for i, v in dataset.cache.items()), "nothing computed from exchanged data"


def test_a_dataset_decoding_in_place_is_left_alone() -> None:
    dataset = DecodedInPlace()
    check_records(dataset, None, 64)
    done = torch.tensor(dataset.done)
    assert done.any() and torch.equal(dataset.decoded[done], X[done] * 2), "no record decoded from exchanged data"


def test_reset_and_restore() -> None:
    dataset = Cached()
    writes = ReadWrites(dataset)
    dataset[0]
    writes.settle()
    assert writes.active and writes.written == ["Cached._stats"]
    first = dataset._stats
    writes.reset()
    assert dataset._stats is None
    dataset.x.neg_()
    dataset[1]
    dataset.x.neg_()
    writes.restore()
    assert dataset._stats is first, "as the plain reads left it"
