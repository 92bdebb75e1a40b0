"""Exact copies below the mean-copies rule (record_checks/repeated_records.py): one record repeated many times is
refused when chance does not explain it (r̂, a mean, hides one person ×5 among 500); any other exact copy is warned,
with counts only; lightning_dp.data.DistinctRecords silences both; natural data with a pair (iris) trains."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.data import DistinctRecords
from lightning_dp.record_checks import repeated_records
from lightning_dp.record_checks.records import check_records
from lightning_dp.record_checks.repeated_records import RepeatedRecordsWarning


def _rows(n: int = 500, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] > 0).long()


def _with_copies(rows: list[int], times: int) -> TensorDataset:
    """The table with ``rows`` appended ``times`` − 1 more times (torch.cat: copies, no shared memory)."""
    x, y = _rows()
    return TensorDataset(torch.cat([x] + [x[rows]] * (times - 1)), torch.cat([y] + [y[rows]] * (times - 1)))


def _fit(dataset: TensorDataset) -> None:
    loader = DataLoader(dataset, batch_size=16)
    model = TinyClassifier(lr=0.07)  # not 0.1: iris's smallest petal width (a data statistic, rule 11)
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, sampler_seed=0), max_steps=2).fit(model, loader)


def test_one_record_repeated_five_times_is_refused_though_the_mean_number_of_copies_is_small():
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(_with_copies([0], 5), batch_size=16)  # r̂ = 10 · 503 / C(504, 2) ≈ 0.04 < 0.05
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)occurs 5 times \(in all of the 504 records.*DistinctRe"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, sampler_seed=0), max_steps=2).fit(model, loader)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"


def test_a_few_oversampled_rows_are_warned_with_counts_only_and_train():
    dataset = _with_copies(list(range(12)), 2)  # 12 minority rows twice: r̂ ≈ 0.047, below the refusal
    with pytest.warns(RepeatedRecordsWarning, match=r"24 of the 512 training records.*largest group: 2 ") as caught:
        _fit(dataset)
    message = str(next(w.message for w in caught if w.category is RepeatedRecordsWarning))
    assert "DistinctRecords" in message and "deduplicate" in message and "Users" in message
    assert f"{float(dataset.tensors[0][0, 0]):.3}" not in message  # counts, never content


@pytest.mark.parametrize("dataset", [_with_copies([0], 5), _with_copies(list(range(12)), 2)])
def test_declaring_distinct_records_silences_the_refusal_and_the_warning(dataset):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RepeatedRecordsWarning)
        check_records(DistinctRecords(dataset), None, len(dataset))


def test_a_triple_that_chance_explains_is_warned_and_five_copies_are_refused():
    """2,000 records with 30 chance pairs (collision probability p ≈ 1.5e-5): a value three times is expected about
    (1/p) · P(Poisson(0.03) ≥ 3) ≈ 0.3 times, five times about 1e-5 times (r̂ ≈ 0.04: below the mean rule)."""
    x = torch.randn(2000, 4, generator=torch.Generator().manual_seed(1))
    x[1000:1030] = x[:30]
    x[1500] = x[1501] = x[500]
    with pytest.warns(RepeatedRecordsWarning, match="largest group: 3 "):
        check_records(TensorDataset(x.clone()), None, 2000)
    x[1502] = x[1503] = x[500]
    with pytest.raises(PrivacyConfigurationError, match="occurs 5 times"):
        check_records(TensorDataset(x.clone()), None, 2000)


def test_a_sample_says_what_it_cannot_show(monkeypatch):
    monkeypatch.setattr(repeated_records, "CONTENT_CHECK_RECORDS", 300)
    rows = torch.randn(3000, 3)
    order = repeated_records.checked_positions(3000)
    rows[int(order[1])] = rows[int(order[0])]  # one pair the sample sees: too few to refuse
    with pytest.warns(RepeatedRecordsWarning, match=r"sample of 300 of the 3000.*probability about 0\.01.*30 copies"):
        check_records(TensorDataset(rows), None, 3000)


def test_iris_with_its_one_natural_pair_is_warned_and_trains():
    datasets = pytest.importorskip("sklearn.datasets")
    iris = datasets.load_iris()
    dataset = TensorDataset(torch.tensor(iris.data, dtype=torch.float32), torch.tensor(iris.target) % 2)
    with pytest.warns(RepeatedRecordsWarning, match="2 of the 150 training records"):
        _fit(dataset)
