"""PrivateImputer (data/private_imputer.py): missing values filled with a Gaussian-mechanism mean per column, the
sensitivities reached and never exceeded, the ledger charged two releases; features it fills pass rule 11 where the
exact mean fill is refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import PrivacyConfigurationError
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.data import PrivateImputer
from lightning_dp.data.private_standardizer import centred_sums

LOWER = torch.tensor([-1.0, 0.0, 2.0, -10.0], dtype=torch.float64)
UPPER = torch.tensor([1.0, 4.0, 3.0, 10.0], dtype=torch.float64)


def _features(n: int, seed: int = 0, share: float = 0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = LOWER + (UPPER - LOWER) * torch.rand(n, len(LOWER), generator=g, dtype=torch.float64)
    x[torch.rand(x.shape, generator=g) < share] = math.nan
    return x


def test_the_fill_is_the_observed_mean_up_to_the_noise_and_only_missing_cells_change():
    x = _features(20_000)
    imputer = PrivateImputer(LOWER, UPPER, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    out = imputer.fit_transform(x, PrivacyLedger())
    observed = ~torch.isnan(x)
    exact = torch.nansum(x, 0) / observed.sum(0)
    assert torch.allclose(imputer.fill, exact, atol=0.01 * float((UPPER - LOWER).max()))
    assert not torch.equal(imputer.fill, exact)
    assert torch.equal(out[observed], x[observed]) and not bool(torch.isnan(out).any())
    assert torch.equal(out[~observed], imputer.fill.expand_as(x)[~observed])


def test_one_record_moves_the_sums_and_the_counts_by_at_most_the_square_root_of_d():
    x = _features(50)
    c = (LOWER + UPPER) / 2
    s, _ = centred_sums(torch.where(torch.isnan(x), c, x), LOWER, UPPER)
    for record in (UPPER + 100, LOWER - 100, torch.tensor([math.nan, 1.0, math.nan, -50.0], dtype=torch.float64)):
        y = torch.cat([x, record[None]])
        s2, _ = centred_sums(torch.where(torch.isnan(y), c, y), LOWER, UPPER)
        moved = (~torch.isnan(y)).sum(0) - (~torch.isnan(x)).sum(0)
        assert float((s2 - s).norm()) <= math.sqrt(4) + 1e-9 and float(moved.double().norm()) <= math.sqrt(4)
    y = torch.cat([x, UPPER[None] + 1])
    s2, _ = centred_sums(torch.where(torch.isnan(y), c, y), LOWER, UPPER)
    assert float((s2 - s).norm()) == pytest.approx(2.0)  # reached: every coordinate at its bound


def test_the_ledger_is_charged_two_gaussian_releases_named_by_the_fit():
    ledger = PrivacyLedger()
    imputer = PrivateImputer(0.0, 1.0, noise_multiplier=3.0).fit(_features(100).clamp(0, 1), ledger)
    assert ledger.steps == 2 and ledger.entries[0].noise_multiplier == 3.0 and ledger.entries[0].sample_rate == 1.0
    assert ledger.entries[0].run == imputer.run


@pytest.mark.parametrize("kwargs", [dict(noise_multiplier=0.0), dict(noise_multiplier=math.inf),
                                    dict(lower=1.0, upper=1.0), dict(lower=math.nan)])
def test_bad_settings_are_refused(kwargs):
    settings = {**dict(lower=0.0, upper=1.0, noise_multiplier=1.0), **kwargs}
    with pytest.raises(PrivacyConfigurationError):
        PrivateImputer(**settings).fit(_features(10), PrivacyLedger())


def test_transform_before_fit_and_a_wrong_width_are_errors():
    imputer = PrivateImputer(LOWER, UPPER, 1.0)
    with pytest.raises(RuntimeError):
        imputer.transform(_features(4))
    imputer.fit(_features(40), PrivacyLedger())
    with pytest.raises(ValueError):
        imputer.transform(torch.zeros(3, 2))
    with pytest.raises(PrivacyConfigurationError):
        imputer.fit(_features(40), object())  # no ledger to charge


def test_features_it_fills_train_where_the_exact_mean_fill_is_refused():
    from tests.privacy.boundary.cases import Classifier, strategy  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g, dtype=torch.float64) * 2 + 1
    y = (x[:, 0] > 1).long()
    x[torch.rand(x.shape, generator=g) < 0.1] = math.nan
    dp = strategy()
    filled = PrivateImputer(-10.0, 10.0, noise_multiplier=2.0).fit_transform(x, dp)
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(TensorDataset(filled.float(), y),
                                                                        batch_size=16))
    assert dp.ledger.steps == 2 + 2  # the imputer's two releases and two training steps
    exact = torch.where(torch.isnan(x), x.nanmean(0), x).float()
    with pytest.raises(PrivacyConfigurationError, match="PrivateImputer"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(Classifier(), DataLoader(TensorDataset(exact, y),
                                                                                   batch_size=16))


def test_a_mean_per_group_is_each_groups_observed_mean_up_to_the_noise_at_the_same_cost():
    x = _features(30_000)
    group = torch.arange(len(x)) % 3
    x[group == 1, 0] = (x[group == 1, 0] + 1).clamp(max=1.0)  # a column whose mean differs by group
    ledger = PrivacyLedger()
    imputer = PrivateImputer(LOWER, UPPER, noise_multiplier=1.0, groups=3, generator=torch.Generator().manual_seed(0))
    out = imputer.fit_transform(x, ledger, group)
    assert imputer.fill.shape == (3, 4) and ledger.steps == PrivateImputer.releases == 2
    for k in range(3):
        rows = x[group == k]
        exact = torch.nansum(rows, 0) / (~torch.isnan(rows)).sum(0)
        assert torch.allclose(imputer.fill[k], exact, atol=0.02 * float((UPPER - LOWER).max()))
        gaps = torch.isnan(rows)
        assert torch.equal(out[group == k][gaps], imputer.fill[k].expand_as(rows)[gaps])
    assert not torch.allclose(imputer.fill[0, 0], imputer.fill[1, 0], atol=0.2)


def test_one_record_moves_one_groups_sums_and_counts_by_at_most_the_square_root_of_d():
    """A record is in one group: the sums and counts [G, D] move in its row only (parallel composition)."""
    x, group = _features(50), torch.arange(50) % 2
    c = (LOWER + UPPER) / 2

    def sums(features, groups):
        u = torch.stack([centred_sums(torch.where(torch.isnan(features[groups == k]), c, features[groups == k]),
                                      LOWER, UPPER)[0] for k in range(2)])
        return u, torch.stack([(~torch.isnan(features[groups == k])).sum(0) for k in range(2)]).double()

    s, n = sums(x, group)
    for record in (UPPER + 100, LOWER - 100, torch.tensor([math.nan, 1.0, math.nan, -50.0], dtype=torch.float64)):
        for k in (0, 1):
            s2, n2 = sums(torch.cat([x, record[None]]), torch.cat([group, torch.tensor([k])]))
            assert float((s2 - s).norm()) <= 2.0 + 1e-9 and float((n2 - n).norm()) <= 2.0 + 1e-9
            assert torch.equal(s2[1 - k], s[1 - k])


@pytest.mark.parametrize("groups, group", [(0, None), (2.0, None), (True, None), (2, None), (2, torch.tensor([0, 2])),
                                           (2, torch.tensor([0.0, 1.0])), (None, torch.tensor([0, 1]))])
def test_bad_groups_are_refused(groups, group):
    x = torch.tensor([[1.0, math.nan], [math.nan, 0.5]], dtype=torch.float64)
    with pytest.raises((PrivacyConfigurationError, ValueError)):
        PrivateImputer(0.0, 1.0, 1.0, groups=groups).fit(x, PrivacyLedger(), group)


def test_a_seeded_generator_warns_known_seed_and_the_release_can_be_charged_to_another_ledger():
    from lightning_dp.errors import KnownSeedWarning

    x = _features(200)
    ledger, other = PrivacyLedger(), PrivacyLedger()
    with pytest.warns(KnownSeedWarning, match="secure_mode"):
        imputer = PrivateImputer(LOWER, UPPER, 5.0, generator=torch.Generator().manual_seed(0)).fit(x, ledger)
    imputer.charge(other)
    assert other.steps == ledger.steps == 2 and {e.run for e in other.entries} == {imputer.run}
    with pytest.raises(RuntimeError, match="fit"):
        PrivateImputer(LOWER, UPPER, 5.0).charge(other)
