"""Near-copies of the records compose in the data ledger (record_checks/row_lineage.py's coarse digests, matched by
accounting/data_ledgers.py): a fresh model on ``X + 1e-7·noise``, ``X.half().float()`` or ``X.round(decimals=3)``
continues the releases made on ``X``; unrelated data (a train/test split, an independent draw) share none."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_dp.accounting.data_ledgers import data_use, shares_records


def _near_copies(x: torch.Tensor) -> dict[str, torch.Tensor]:
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    return {"jitter": x + 1e-7 * noise, "half": x.half().to(x.dtype), "round3": x.round(decimals=3)}


def _tables() -> dict[str, torch.Tensor]:
    import sklearn.datasets

    g = torch.Generator().manual_seed(0)
    return {"digits": torch.from_numpy(sklearn.datasets.load_digits().data).float(),
            "breast_cancer": torch.from_numpy(sklearn.datasets.load_breast_cancer().data),
            "normal": torch.randn(1000, 20, generator=g), "small": torch.randn(256, 8, generator=g)}


@pytest.mark.parametrize("name", ["digits", "breast_cancer", "normal", "small"])
def test_near_copies_share_the_records(name):
    x = _tables()[name]
    for what, copy in _near_copies(x).items():
        assert shares_records(data_use(TensorDataset(x)), data_use(TensorDataset(copy))), what


@pytest.mark.parametrize("name", ["digits", "breast_cancer", "normal"])
def test_unrelated_rows_do_not(name):
    x = _tables()[name]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    train, test = x[order[: 3 * len(x) // 4]], x[order[3 * len(x) // 4:]]
    assert not shares_records(data_use(TensorDataset(train)), data_use(TensorDataset(test)))
    assert not shares_records(data_use(TensorDataset(train)), data_use(TensorDataset(test.half().float())))
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype) * x.std(0) + x.mean(0)
    assert not shares_records(data_use(TensorDataset(x)), data_use(TensorDataset(other)))


def test_few_rows_of_few_columns_keep_no_coarse_digest():
    """50 rows of 2 columns: unrelated draws share cells often; the coarse digests are not used, so they do not
    compose (a near-copy of them is not found either: the bound docs/accounting.md states)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 2, generator=g), torch.randn(50, 2, generator=g)
    assert not any(kind[0] == "coarse" for kind in data_use(TensorDataset(a)).digests)
    assert not shares_records(data_use(TensorDataset(a)), data_use(TensorDataset(b)))
    binary = torch.randint(0, 2, (400, 24), generator=g).float()  # distinct rows: their cells are their values
    assert not shares_records(data_use(TensorDataset(binary[:200])), data_use(TensorDataset(binary[200:])))


@pytest.mark.parametrize("what", ["jitter", "half", "round3"])
def test_a_fresh_model_on_a_near_copy_continues_the_releases(what):
    """The red-team's r04/r05/r09: fit A on X, a fresh model B on a near-copy of X; B's ledger holds A's releases."""
    from conftest import TinyClassifier, quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dp import DPStrategy

    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    steps = []
    for features in (x, _near_copies(x)[what]):
        trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=1)
        trainer.fit(TinyClassifier(d_in=8), DataLoader(TensorDataset(features, y), batch_size=20))
        steps.append(trainer.strategy.ledger.steps)
    assert steps == [10, 20]


@pytest.mark.parametrize("what", ["5 rows twice", "2 % of rows twice", "a zero row 10 times", "5 rows twice, jittered",
                                  "none"])
def test_a_near_copy_with_a_few_rows_twice_shares_the_records(what):
    """zoo30 r05: ``X + 1e-4·noise`` with 5 of its 1,000 rows twice was not found (the copies made its rows look
    indistinct, every coarse digest dropped); an independent draw with copies shares none."""
    def with_copies(x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(4)
        near = x + 1e-4 * torch.randn(x.shape, generator=g)
        return {"5 rows twice": torch.cat([near, near[:5]]), "2 % of rows twice": torch.cat([near, near[:20]]),
                "a zero row 10 times": torch.cat([near, torch.zeros(10, x.shape[1])]),
                "5 rows twice, jittered": torch.cat([near, near[:5] + 1e-6 * torch.randn(5, 20, generator=g)]),
                "none": near}[what]

    x = torch.randn(1000, 20, generator=torch.Generator().manual_seed(0))
    assert shares_records(data_use(TensorDataset(x)), data_use(TensorDataset(with_copies(x))))
    other = torch.randn(1000, 20, generator=torch.Generator().manual_seed(1))
    assert not shares_records(data_use(TensorDataset(x)), data_use(TensorDataset(with_copies(other))))


def test_a_fresh_model_on_a_near_copy_with_five_rows_twice_continues_the_releases():
    """zoo30 r05 as a fit: fit A on X, a fresh model B on ``X + 1e-4·noise`` with 5 rows twice: B's ledger holds
    A's releases and its own."""
    from conftest import TinyClassifier, quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dp import DPStrategy

    x = torch.randn(1000, 20, generator=torch.Generator().manual_seed(0))
    near = x + 1e-4 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    steps = []
    for features in (x, torch.cat([near, near[:5]])):
        y = (features[:, 0] > 0).long()
        trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=4)
        trainer.fit(TinyClassifier(d_in=20), DataLoader(TensorDataset(features, y), batch_size=100))
        steps.append(trainer.strategy.ledger.steps)
    assert steps == [4, 8]
