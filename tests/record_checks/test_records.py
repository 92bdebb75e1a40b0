"""The records the loader really draws (record_checks/records.py, record_sources.py, repeated_records.py): one fixed
record per index, each record once; end to end through the Trainer, and the content check's limits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, SubsetRandomSampler, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.data import DistinctRecords
from lightning_dp.record_checks import repeated_records
from lightning_dp.record_checks.records import check_records

N = 40


def _data(n: int = N, seed: int = 0) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long())


def _fit(dataset: Dataset, **loader_kwargs) -> DPStrategy:
    strategy = DPStrategy(noise_multiplier=1.0, sampler_seed=0)
    loader = DataLoader(dataset, batch_size=loader_kwargs.pop("batch_size", 4), **loader_kwargs)
    quiet_trainer(strategy=strategy, max_steps=2).fit(TinyClassifier(), loader)
    return strategy


def _refused(dataset: Dataset, match: str, **loader_kwargs) -> str:
    """Refused before the first release (the model's parameters untouched); returns the message."""
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(dataset, batch_size=4, **loader_kwargs)
    with pytest.raises(PrivacyConfigurationError, match=match) as err:
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, sampler_seed=0), max_steps=2).fit(model, loader)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"
    return str(err.value)


# ---------------------------------------------------------------- the same record twice, end to end
class Repeating(Dataset):
    """``__len__`` three times the data, ``__getitem__`` reading ``index % n`` (views of one tensor)."""

    def __init__(self, base: TensorDataset, times: int = 3) -> None:
        self.base, self.times = base, times

    def __len__(self) -> int:
        return self.times * len(self.base)

    def __getitem__(self, i):
        return self.base[i % len(self.base)]


class RepeatingCopies(Repeating):
    """The same, each read a fresh copy (as from disk): only the content shows the repetition."""

    def __getitem__(self, i):
        x, y = self.base[i % len(self.base)]
        return x.clone(), int(y)


class Oversampled(Dataset):
    """A custom dataset that oversamples a class through an index list (a fresh copy per read)."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base
        minority = [i for i in range(len(base)) if int(base[i][1]) == 1]
        self.order = list(range(len(base))) + minority

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        x, y = self.base[self.order[i]]
        return x.tolist(), int(y)  # lists of floats: no memory to compare


def _collate_lists(batch):
    return torch.tensor([x for x, _ in batch]), torch.tensor([y for _, y in batch])


@pytest.mark.parametrize("make,match", [
    (lambda d: Subset(d, list(range(N)) + [5]), "more than once: positions 5 and 40"),
    (lambda d: Subset(d, list(range(N)) + [-1]), "positions 39 and 40"),  # -1 is record 39
    (lambda d: ConcatDataset([d, d]), "ConcatDataset"),
    (lambda d: ConcatDataset([Subset(d, range(0, 25)), Subset(d, range(20, N))]), "overlapping Subsets"),
    (lambda d: Subset(ConcatDataset([Subset(d, [0, 1, 2]), d]), list(range(3, 43)) + [0]), "record 0"),
    (lambda d: Repeating(d), "same memory"),
    (lambda d: ConcatDataset([d, TensorDataset(*d.tensors)]), "store the same rows"),  # two objects, one set of tensors
    (lambda d: RepeatingCopies(d, times=2), "repeat"),
])
def test_the_same_record_twice_is_refused_naming_the_fix(make, match):
    message = _refused(make(_data()), match)
    assert "Pass each record once" in message and "oversampling" in message


def test_oversampling_inside_a_dataset_is_refused_by_content():
    _refused(Oversampled(_data()), "other exact copies", collate_fn=_collate_lists)


def test_a_split_that_takes_each_record_once_trains():
    """ConcatDataset([d, d]) read only through its first copy (a SubsetRandomSampler): no record twice; N = 40."""
    data = _data()
    strategy = _fit(ConcatDataset([data, data]), sampler=SubsetRandomSampler(range(N)))
    assert strategy.num_samples == N


# ---------------------------------------------------------------- a fixed record per index, end to end
class RandomChunks(Dataset):
    """Random text chunks (#37): ``__getitem__`` ignores its index and draws where to start."""

    def __init__(self, draw: str) -> None:
        self.draw = draw
        self.text = torch.randn(500, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        if self.draw == "python":
            start = random.randint(0, 400)
        elif self.draw == "torch":
            start = int(torch.randint(0, 400, ()))
        else:
            start = int(np.random.default_rng().integers(0, 400))  # its own unseeded generator
        x = self.text[start]
        return x, int(x[0] > 0)


@pytest.mark.parametrize("draw,match", [
    ("python", "ignores its index"),
    ("torch", "ignores its index"),
    ("numpy_own", "different records for the same index"),
])
def test_a_dataset_that_ignores_its_index_is_diagnosed_before_the_probe(draw, match):
    message = _refused(RandomChunks(draw), match)
    assert "fixed record per index" in message and "AugmentedViews" in message
    assert "does not capture" not in message  # not blamed on the model (#37)


class PythonRandomFlip(Dataset):
    """Augmentation drawn from Python's ``random`` (albumentations-style): seeded per index, a fixed record."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return (-x if random.random() < 0.5 else x), y


def test_augmentation_from_python_random_is_a_fixed_record_and_probed_like_with_like(recwarn):
    _fit(PythonRandomFlip(_data()))
    assert not [w for w in recwarn if "draws random numbers" in str(w.message)]


# ---------------------------------------------------------------- the content check: what it lets pass, its cap
class Fresh(Dataset):
    """Records made afresh at every read (as from disk) from rows of a table."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows.tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return torch.tensor(self.rows[i]), 0


def test_a_few_natural_duplicates_pass_and_many_are_refused_unless_declared():
    rows = torch.randn(200, 3)
    rows[7], rows[150] = rows[3], rows[60]  # two people with identical records: 4 of 200 in a pair
    with pytest.warns(repeated_records.RepeatedRecordsWarning, match="4 of the 200"):  # trains, warned
        check_records(Fresh(rows), None, 200)
    check_records(_data(200), None, 200)
    rows[100:] = rows[:100]  # half the table repeated: every record has a copy
    with pytest.raises(PrivacyConfigurationError, match="other exact copies"):
        check_records(Fresh(rows), None, 200)
    check_records(DistinctRecords(Fresh(rows)), None, 200)  # declared: different people's identical records
    check_records(Subset(DistinctRecords(Fresh(rows)), range(200)), None, 200)


def test_declaring_distinct_records_does_not_lift_structural_repetition():
    data = _data()
    with pytest.raises(PrivacyConfigurationError, match="more than once"):
        check_records(DistinctRecords(ConcatDataset([data, data])), None, 2 * N)


def test_a_large_dataset_is_checked_on_a_sample_that_still_sees_wholesale_repetition(monkeypatch):
    monkeypatch.setattr(repeated_records, "CONTENT_CHECK_RECORDS", 300)
    rows = torch.randn(3000, 3)
    read: list[int] = []

    class Counted(Fresh):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    check_records(Counted(rows), None, 3000)
    assert 300 <= len(read) <= 300 + 16  # the sample, plus the fixed-record reads
    doubled = torch.cat([rows[:1500], rows[:1500]])
    with pytest.raises(PrivacyConfigurationError, match="a random sample of 300 of the 3000"):
        check_records(Fresh(doubled), None, 3000)


def test_one_chance_pair_in_a_sample_is_not_repetition(monkeypatch):
    monkeypatch.setattr(repeated_records, "CONTENT_CHECK_RECORDS", 300)
    rows = torch.randn(3000, 3)
    order = repeated_records.checked_positions(3000)
    rows[int(order[1])] = rows[int(order[0])]  # a pair the sample sees: r̂ = 1 · 2999 / 44850 ≈ 0.07, one pair only
    with pytest.warns(repeated_records.RepeatedRecordsWarning):  # trains, warned
        check_records(Fresh(rows), None, 3000)


def test_reading_stops_at_the_byte_cap(monkeypatch):
    monkeypatch.setattr(repeated_records, "CONTENT_CHECK_BYTES", 50 * 16)  # about 50 records of 4 floats + a label
    read: list[int] = []

    class Counted(Fresh):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    check_records(Counted(torch.randn(1000, 4)), None, 1000)
    assert len(read) < 80


def test_records_without_a_fingerprint_are_not_checked():
    class Opaque:
        __slots__ = ("v",)

    class Records(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return Opaque()

    check_records(Records(), None, 10)


def _jittered(share: float, scale: float, n: int = 200, d: int = 8) -> TensorDataset:
    """``n`` records of which the last ``share`` are copies of the first ones with noise of ``scale`` added."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g)
    copies = int(share * n)
    x[n - copies:] = x[:copies] + scale * torch.randn(copies, d, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_copies_with_jitter_added_are_refused_and_distinct_close_records_pass():
    """SMOTE-like oversampling (a fifth of the records are copies with noise of 1e-5 relative to the data's scale) is
    repetition by content on a grid of 1e-3 of the scale; the same records without the copies, and copies moved by
    a tenth of the scale (other records), pass."""
    _refused(_jittered(0.2, 1e-5), "near-identical copies")
    check_records(_jittered(0.0, 0.0), None, 200)
    check_records(_jittered(0.2, 0.1), None, 200)
    check_records(DistinctRecords(_jittered(0.2, 1e-5)), None, 200)


def test_near_digests_follow_the_values_not_their_bytes():
    from lightning_dp.records.record_fingerprint import near_digest

    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    grids = [(near_digest((x, 1), o), near_digest((x + 1e-7, 1), o), near_digest((x + 0.1, 1), o)) for o in (0, .5)]
    assert any(same == jittered for same, jittered, _ in grids)
    assert all(same != moved for same, _, moved in grids)
    assert near_digest((x, 1), 0) != near_digest((x, 0), 0)  # the label is compared exactly


# ---------------------------------------------------------------- unreadable records: None, dropped by the collate
class WithUnreadable(Dataset):
    """The Kaggle recipe for corrupt files (zoo28 d02): ``None`` for every ``every``-th record (those probed, 0 and
    the last, among them), which :func:`_drop_none` filters out of the batch; ``base`` wraps another dataset."""

    def __init__(self, base: Dataset, every: int = 13) -> None:
        self.base, self.every = base, every

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        return None if i % self.every == 0 else self.base[i]


def _drop_none(batch):
    return torch.utils.data.default_collate([b for b in batch if b is not None])


@pytest.mark.parametrize("n,every", [(N, 13), (256, 17), (256, 5)])
def test_unreadable_records_dropped_by_the_collate_are_neither_copies_nor_an_ignored_index(n, every):
    """None records are all alike: not copies of one another (d02), and a probe of fixed records that read only them
    (0, 85, 170, 255 at every 17th of 256: d02b) looks past them. The fit trains, one release per step."""
    strategy = _fit(WithUnreadable(_data(n), every), collate_fn=_drop_none)
    assert strategy.ledger.steps == 2


class RandomWithUnreadable(RandomChunks):
    """The unsafe twin: a random chunk whatever the index (Python's generator), None at every 5th index."""

    def __getitem__(self, i):
        return None if i % 5 == 0 else super().__getitem__(i)


def test_repetition_and_an_ignored_index_are_still_refused_among_unreadable_records():
    _refused(WithUnreadable(RepeatingCopies(_data(), times=2), every=7), "records repeat", collate_fn=_drop_none)
    message = _refused(RandomWithUnreadable("python"), "ignores its index", collate_fn=_drop_none)
    assert "indices [0," not in message  # the records probed are those that hold data
