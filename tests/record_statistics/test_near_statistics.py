"""Statistics of the training data kept after a transformation that keeps them close (record_statistics/
near_statistics.py, number_tables.py; a rounded standardised target: scaled_targets.py), judged by
record_statistics/data_statistics.py: a Dataset standardising its items with a mean and deviation rounded to 3
decimals, kept in a dict keyed by column or name, as tuples of Python floats or per-column tuples, of a random half
or tenth of the training rows, or of the training and validation rows together, and a regression target
standardised and rounded, are refused before any release (zoo32 d01, d03, d04, d09, d10, t02). Published constants
(ImageNet's, MNIST's), a PrivateStandardizer's release (also rounded), another population's statistics and
hand-written values train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.accounting.ledger import PrivacyLedger  # noqa: E402
from lightning_dp.data import PrivateStandardizer  # noqa: E402
from lightning_dp.record_statistics.near_statistics import closeness_chance, decimal_step  # noqa: E402
from lightning_dp.record_statistics.number_tables import number_columns  # noqa: E402

N, D = 2048, 32
G = torch.Generator().manual_seed(33)
SCALE, SHIFT = torch.linspace(0.5, 3.0, D), torch.linspace(-2.0, 5.0, D)
X = torch.randn(N, D, generator=G) * SCALE + SHIFT
Y = (X[:, 0] > SHIFT[0]).long()
X_VAL = torch.randn(N // 4, D, generator=G) * SCALE + SHIFT  # held-out rows of the same population
HALF = torch.randperm(N, generator=G)[: N // 2]
TENTH = torch.randperm(N, generator=G)[: N // 10]


class Wide(Classifier):
    def __init__(self, width: int = D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 2))


class Standardising(Dataset):
    """Tutorial code: a dataset standardising each item with statistics it keeps (``scale(x)`` reads them)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, **stats: Any) -> None:
        self.x, self.y = x, y
        self.__dict__.update(stats)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] / 4.0, self.y[i]  # the scaling itself does not matter to the check: what is kept does


def _make_scale(stats: dict) -> Any:
    def scale(x: torch.Tensor) -> torch.Tensor:  # a closure over a dict of per-column statistics
        return torch.stack([(x[j] - stats[j][0]) / stats[j][1] for j in range(len(x))])
    return scale


def _columns(x: torch.Tensor) -> list[tuple[float, float]]:
    return [(float(x[:, j].mean()), float(x[:, j].std())) for j in range(x.shape[1])]


ATTACKS = {
    "d01 rounded with torch": (lambda: dict(mean=X.mean(0).round(decimals=3), std=X.std(0).round(decimals=3)),
                               r"dataset Standardising\.mean is approximately the per-feature mean"),
    "d01 round() per column": (lambda: dict(mean=[round(v, 3) for v in X.mean(0).tolist()]),
                               r"\.mean is approximately the per-feature mean"),
    "d01 np.round": (lambda: dict(std=np.round(X.numpy().std(0, ddof=1), 3)),
                     r"\.std is approximately the per-feature standard deviation"),
    "d03 dict by column": (lambda: dict(stats=dict(enumerate(_columns(X)))),
                           r"\.stats\[\*\]\[0\] equals the per-feature mean"),
    "d03 dict by name": (lambda: dict(means={f"f{j}": float(X[:, j].mean()) for j in range(D)}),
                         r"\.means\[\*\] equals the per-feature mean"),
    "d03 list of dicts": (lambda: dict(stats=[{"mean": m, "std": s} for m, s in _columns(X)]),
                          r"\.stats\[\*\]\['std'\] equals the per-feature standard deviation"),
    "d03 rounded, in a closure": (lambda: dict(scale=_make_scale({j: (round(m, 3), round(s, 3))
                                                                  for j, (m, s) in enumerate(_columns(X))})),
                                  r"scale\.stats\[\*\]\[0\] is approximately the per-feature mean"),
    "d09 tuple of floats": (lambda: dict(mean=tuple(X.mean(0).tolist()), std=tuple(X.std(0).tolist())),
                            r"\.mean equals the per-feature mean"),
    "d09 list of per-column tuples": (lambda: dict(stats=_columns(X)), r"\.stats\[\*\]\[1\] equals the per-feature "
                                                                       "standard deviation"),
    "d04 a random half": (lambda: dict(mean=X[HALF].mean(0), std=X[HALF].std(0)),
                          r"\.mean is approximately the per-feature mean.*within a rounding or subsample error"),
    "d04 a random tenth": (lambda: dict(mean=X[TENTH].mean(0)), r"\.mean is approximately the per-feature mean"),
    "d10 training and validation rows": (lambda: dict(mean=torch.cat([X, X_VAL]).mean(0),
                                                      std=torch.cat([X, X_VAL]).std(0)),
                                         r"\.mean is approximately the per-feature mean"),
}


def _fit(dataset: Dataset, model: Any = None, **strategy_kwargs: Any) -> Any:
    dp = strategy(**strategy_kwargs)
    quiet_trainer(strategy=dp, max_steps=2).fit(model or Wide(), DataLoader(dataset, batch_size=64))
    return dp


@pytest.mark.parametrize("case", list(ATTACKS))
def test_a_transformed_statistic_beside_the_records_is_refused_before_any_release(case):
    make, where = ATTACKS[case]
    model = Wide()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{where}.*"
                                                         "PrivateStandardizer"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(Standardising(X, Y, **make()),
                                                                              batch_size=64))
    assert unchanged(before, model)


class Regressor(Wide):
    def __init__(self) -> None:
        super().__init__(4)
        self.net[-1] = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).reshape(y.shape), y)


def test_a_target_standardised_then_rounded_is_refused_and_one_in_its_own_units_trains():
    """zoo32 t02: ``((y - y.mean()) / y.std()).round(decimals=2)``; the same target rounded in its own units (2
    decimals) trains."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 4, generator=g)
    y = x @ torch.tensor([1.0, 1.5, 2.0, 0.5]) + 5.0 + 0.1 * torch.randn(512, generator=g)
    model = Regressor()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)standardised with its own mean and standard "
                                                        r"deviation, then rounded to a step of 0\.01"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(
            model, DataLoader(Standardising(x, ((y - y.mean()) / y.std()).round(decimals=2)), batch_size=64))
    assert unchanged(before, model)
    assert _fit(Standardising(x, y.round(decimals=2)), Regressor()).ledger.steps == 2


def test_published_constants_hand_values_and_another_populations_statistics_train():
    g = torch.Generator().manual_seed(5)
    other = torch.randn(N, D, generator=g) * SCALE.flip(0) + SHIFT.flip(0)  # another population of the same width
    kept = dict(mean=other.mean(0).round(decimals=3), std=other.std(0).round(decimals=3),
                stats=dict(enumerate(_columns(other))), guess=[round(v, 0) for v in SHIFT.tolist()],
                zeros=[0.0] * D, ones=(1.0,) * D, mnist=(0.1307, 0.3081))
    assert _fit(Standardising(X, Y, **kept)).ledger.steps == 2
    # images near ImageNet's channel statistics, normalised by its published constants (and MNIST's scalars)
    means = torch.tensor([0.485, 0.456, 0.406])
    images = (torch.randn(2048, 3, 4, 4, generator=g) * 0.2 + means[:, None, None]).clamp(0, 1)
    labels = (images[:, 0, 0, 0] > 0.5).long()
    imagenet = dict(mean=means.tolist(), std=[0.229, 0.224, 0.225], mnist_mean=0.1307, mnist_std=0.3081)
    assert _fit(Standardising(images, labels, **imagenet), Wide(48)).ledger.steps == 2


def test_a_private_standardisers_release_trains_kept_as_it_is_or_rounded():
    scaler = PrivateStandardizer(-20.0, 20.0, 1.0, generator=torch.Generator().manual_seed(7))
    scaler.fit(X, PrivacyLedger())
    dp = strategy()
    scaler.charge(dp)
    kept = dict(mean=scaler.mean.round(decimals=3), std=tuple(scaler.std.tolist()))
    quiet_trainer(strategy=dp, max_steps=2).fit(Wide(), DataLoader(Standardising(X, Y, **kept), batch_size=64))
    assert dp.ledger.steps == 3 + 2  # the release counts three Gaussian mechanisms


def test_tables_of_numbers_are_read_as_their_columns():
    assert [s for s, _ in number_columns({0: (1.0, 2.0), 1: (3.0, 4.0)})] == ["[*][0]", "[*][1]"]
    assert number_columns({"a": 1.0, "b": np.float32(2.5)})[0][1].tolist() == [1.0, 2.5]
    assert [s for s, _ in number_columns([{"m": 1, "s": 2.0}, {"m": 3, "s": torch.tensor(4.0)}])] == \
        ["[*]['m']", "[*]['s']"]
    assert number_columns([1.0, 2.0]) == [] and number_columns({0: "a", 1: "b"}) == []
    assert number_columns([{"m": 1.0}, {"s": 2.0}]) == []  # entries of different fields: no table


class _LongRecord:
    """A 1-D entry far longer than a column's tuple (a recorded update of a whole layer): never iterated."""
    ndim = 1

    def __len__(self) -> int:
        return 10_000

    def __iter__(self):
        raise AssertionError("a long entry was unbound to read its fields")


def test_a_list_of_long_vectors_is_not_read_as_a_table():
    """A callback's list of per-step update vectors (each [d] with d > MAX_FIELDS) is no table of columns: its
    entries are never iterated (unbinding each at every check cost ≈ 60 ms a step on a 100-step fit)."""
    assert number_columns([_LongRecord(), _LongRecord()]) == []
    assert number_columns([torch.zeros(9), torch.zeros(9)]) == []
    assert [s for s, _ in number_columns([torch.zeros(2), torch.ones(2)])] == ["[*][0]", "[*][1]"]


def test_the_chance_is_that_of_the_columns_closeness():
    """A column's closeness is its error (or the candidate's decimal step) over its spread; constants, values near a
    trivial statistic and coarse numbers carry no evidence."""
    assert decimal_step(torch.tensor([0.485, 0.5, 255.0, 0.0], dtype=torch.float64), 2.0 ** -52).tolist() == \
        [1e-3, 0.1, 1.0, 1e6]
    s, w = torch.linspace(2.0, 5.0, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    assert closeness_chance(s.round(decimals=3), s, w) < 1e-9 < closeness_chance(s.round(decimals=1), s, w)
    assert closeness_chance(torch.full((8,), 3.0), s, w) == 1.0
    small = torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e-4
    assert closeness_chance(small, small * 1e-3, w) == 1.0  # an initialisation near a centred column's mean


def test_a_trained_parameter_near_the_mean_is_not_taken_for_it():
    """A second fit of a privately trained autoencoder: its output bias came near the features' mean by training;
    parameters are compared with the exact statistics only (a buffer holding the same vector is refused)."""
    from lightning_dp.record_statistics.training_statistics import TrainingStatistics

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 32, generator=g) * 2 + 3
    near = x.mean(0) + 0.3 * x.std(0) / 2048 ** 0.5 * torch.randn(32, generator=g)
    statistics = TrainingStatistics([], [("[0]", x)])
    assert statistics.held_by("parameter decoder.bias", near) == []
    assert statistics.held_by("buffer decoder_mean", near) != []
    assert statistics.held_by("parameter decoder.bias", x.mean(0)) != []
