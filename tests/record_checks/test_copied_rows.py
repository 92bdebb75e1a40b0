"""Copies of a dataset's rows in its other arrays (record_checks/copied_rows.py, through record_checks/shared_records.py):
a record mixed with a partner from a shuffled copy of the data ("offline mixup": a tensor, a float64 or float16 copy),
a bank of negatives copied from the training set, partners drawn with replacement, pairs and triplets stacked from
the training rows are refused before training — one person's row is then in two records; ordinary datasets (labels
and index arrays that repeat values, padded token rows with their labels, constant image rows, a grey image repeated
over its channels, an autoencoder's target copy, a copy nothing reads) are not; the data is left as it was."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError, Users  # noqa: E402
from lightning_dp.record_checks.copied_rows import copied_rows  # noqa: E402
from lightning_dp.record_checks.shared_records import check_shared_records  # noqa: E402

G = torch.Generator().manual_seed(5)
X = torch.randn(64, 4, generator=G)
Y = (X[:, 0] > 0).long()
PERM = torch.randperm(64, generator=G)
DRAWN = torch.randint(0, 64, (64,), generator=G)


class Held(Dataset):
    """Record i is ``make(self, i)``; the arrays given are held as attributes (the dataset's own memory)."""

    def __init__(self, make: Callable[["Held", int], Any], **arrays: Any) -> None:
        self.make = make
        for key, value in arrays.items():
            setattr(self, key, value)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        return self.make(self, i), Y[i]


def check(dataset: Dataset) -> None:
    check_shared_records(dataset, lambda p: p, len(dataset))


def _copying() -> dict[str, Held]:
    x = X.clone()
    return {
        "mixed with a shuffled clone": Held(lambda d, i: 0.7 * d.x[i] + 0.3 * d.px[i], x=x, px=x[PERM].clone()),
        "mixed with a float64 NumPy copy": Held(
            lambda d, i: 0.7 * d.x[i] + 0.3 * torch.from_numpy(d.px[i]).float(), x=x,
            px=x[PERM].numpy().astype("float64")),
        "mixed with a float16 copy": Held(lambda d, i: 0.7 * d.x[i] + 0.3 * d.px[i].float(), x=x,
                                          px=x[PERM].half()),
        "partners drawn with replacement": Held(lambda d, i: d.x[i] - d.nb[i], x=x, nb=x[DRAWN].clone()),
        "a bank of negatives copied from the data": Held(lambda d, i: torch.cat([d.x[i], d.bank[i % 16]]), x=x,
                                                         bank=x[:16].clone()),
        "pairs stacked from the rows": Held(lambda d, i: 0.7 * d.pairs[i, 0] + 0.3 * d.pairs[i, 1],
                                            pairs=torch.stack([x, x[PERM]], 1)),
        "triplets with negatives from the training set": Held(
            lambda d, i: d.triplets[i].reshape(-1), triplets=torch.stack([x, x[PERM], x[DRAWN]], 1)),
    }


@pytest.mark.parametrize("name", sorted(_copying()))
def test_records_reading_copies_of_other_records_rows_are_refused(name: str) -> None:
    dataset = _copying()[name]
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in vars(dataset).items()
              if isinstance(v, (torch.Tensor, np.ndarray))}
    with pytest.raises(PrivacyConfigurationError, match="Training records share data") as err:
        check(dataset)
    assert "privacy_unit=Users" in str(err.value) and "same record" in str(err.value)
    for key, value in before.items():  # every exchange undone, copies included
        now = getattr(dataset, key)
        assert (torch.equal(now, value) if isinstance(value, torch.Tensor) else np.array_equal(now, value)), key


def test_the_refusal_names_the_copy() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"copies in Held\.px"):
        check(_copying()["mixed with a float64 NumPy copy"])


PAD = torch.zeros(64, 8, dtype=torch.long)
PAD[:, :3] = torch.randint(1, 50, (64, 3), generator=G)
PAD[::4] = 0  # every fourth row all padding: repeated rows, nobody's
PAD[1::8, :3] = PAD[3::8, :3]  # and rows repeated exactly: not copies (natural duplicates)
IMAGES = torch.randn(64, 1, 8, 8, generator=G)
IMAGES[:, :, :2] = 0.0  # constant rows at the top of every image
GREY = IMAGES.expand(-1, 3, -1, -1).clone()  # a grey image repeated over three channels
TABLE = torch.randn(2, 4, generator=G)  # one row per class: public, no person's

ORDINARY = {
    "a TensorDataset": TensorDataset(X, Y),
    "a public lookup table": Held(lambda d, i: d.x[i] + d.table[Y[i]], x=X, table=TABLE),
    "labels repeating values, and a shuffled copy of them": Held(
        lambda d, i: torch.cat([d.x[i], d.y[i:i + 1].float(), d.py[i:i + 1].float()]), x=X, y=Y, py=Y[PERM].clone()),
    "an index array and a permutation of it": Held(lambda d, i: d.x[d.index[i]] + d.order[i], x=X,
                                                   index=torch.arange(64), order=PERM.clone()),
    "padded token rows with their labels": Held(lambda d, i: torch.cat([d.ids[i], d.labels[i]]).float(),
                                                ids=PAD, labels=PAD.clone()),
    "images with constant rows": Held(lambda d, i: d.images[i], images=IMAGES),
    "a grey image repeated over its channels": Held(lambda d, i: d.images[i], images=GREY),
    "an autoencoder's target copy": Held(lambda d, i: torch.cat([d.x[i], d.target[i]]), x=X, target=X.clone()),
    "a shuffled copy nothing reads": Held(lambda d, i: d.x[i], x=X, px=X[PERM].clone()),
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_datasets_pass_and_are_untouched(name: str) -> None:
    dataset = ORDINARY[name]
    before = {k: v.clone() for k, v in vars(dataset).items() if isinstance(v, torch.Tensor)}
    check(dataset)
    assert all(torch.equal(getattr(dataset, k), v) for k, v in before.items())


def test_copies_are_found_by_content_and_ordinary_arrays_are_not() -> None:
    x = X.clone()
    arrays = [("px", x[PERM].numpy().astype("float64")), ("y", Y), ("table", TABLE), ("bank", x[:16].clone()),
              ("view", x[2:]), ("wide", torch.cat([x, x[PERM]], 1))]
    found = {c.name: c for c in copied_rows(x, arrays)}
    assert set(found) == {"px", "bank", "wide"}, "a view of the source is exchanged with it, not as a copy"
    assert sorted(found["px"].source_rows.tolist()) == list(range(64))
    assert found["px"].rows[found["px"].source_rows == int(PERM[0])].tolist() == [0]
    assert found["wide"].columns.tolist().count(1) == 64 and found["wide"].columns.tolist().count(0) == 64
    shuffled = [c.source_rows.tolist() for c in copied_rows(PAD, [("labels", PAD[PERM].clone())])]
    assert len(shuffled) == 1 and not set(shuffled[0]) & {*range(0, 64, 4), *range(1, 64, 8), *range(3, 64, 8)}, \
        "padding rows and rows repeated in the source are nobody's: never copies"


def test_offline_mixup_is_refused_in_a_fit_before_any_release() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"copies in the dataset.s tensor\.px"):
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(
            _copying()["mixed with a shuffled clone"], batch_size=16))
    assert dp.ledger.steps == 0


def test_user_level_units_may_mix_a_users_records() -> None:
    """Records mixed with a partner of the same user: the user is the unit (sampled whole), not refused."""
    pairs = torch.arange(64) ^ 1  # partner: the other record of the same user
    dp = strategy(privacy_unit=Users([i // 2 for i in range(64)], users_per_batch=8))
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(
        Held(lambda d, i: 0.7 * d.x[i] + 0.3 * d.px[i], x=X, px=X[pairs].clone()), batch_size=16))
    assert dp.ledger.steps == 2
