"""Statistics released by a DP mechanism that charged a ledger (record_statistics/released_statistics.py): the check of
rule 11 lets the released mean and standard deviation through, features scaled by them pass by their noise, and the
exact statistics (a user's own mean, scikit-learn's StandardScaler) stay refused next to them — also when laundered
through the standardiser's transform (zoo25 s1)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.data import PrivateStandardizer
from lightning_dp.record_statistics.data_statistics import data_statistics_held
from lightning_dp.record_statistics.released_statistics import is_released

# σ so small that the released statistics are within the check's 1e-4 of the exact ones (noise on the mean
# σ·‖h‖/n = 5e-6): without the notes, the check would take them for the exact statistics.
N, D, SIGMA = 4000, 4, 1e-3


@pytest.fixture(scope="module")
def private():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g) * torch.tensor([1.0, 2.0, 1.5, 1.0]) + torch.tensor([1.0, -2.0, 3.0, 0.5])
    x = x.clamp(-9.0, 9.0)  # inside the public range: the released mean is the features' own, noised
    y = (x[:, 0] > 1).long()
    scaler = PrivateStandardizer(-10.0, 10.0, SIGMA, generator=torch.Generator().manual_seed(4))
    scaled = scaler.fit_transform(x, PrivacyLedger())
    return x, y, scaler, scaled


class Normalised(nn.Module):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.linear = nn.Linear(D, 2)


def _standardised(x: torch.Tensor) -> torch.Tensor:
    from sklearn.preprocessing import StandardScaler

    return torch.tensor(StandardScaler().fit_transform(x.numpy()), dtype=torch.float32)


def test_features_scaled_by_a_release_worth_its_epsilon_pass_and_standard_scaler_is_refused(private):
    x, y, _, _ = private
    scaler = PrivateStandardizer(-10.0, 10.0, 1.0, generator=torch.Generator().manual_seed(5))
    scaled = scaler.fit_transform(x, PrivacyLedger())
    assert data_statistics_held([], TensorDataset(scaled, y)) == []  # off mean 0 / deviation 1 by the noise
    assert data_statistics_held([], TensorDataset(scaled.double(), y)) == []
    found = data_statistics_held([], TensorDataset(_standardised(x), y))
    assert any("standardised with its own mean and standard deviation" in f for f in found)
    own = (scaled - scaled.mean(0)) / scaled.std(0)  # the released scaling standardised again with its own
    assert any("standardised with its own" in f for f in data_statistics_held([], TensorDataset(own, y)))


def test_exact_standardisation_laundered_through_transform_is_refused(private):
    """zoo25 s1: ``transform(x_std · std + mean)`` returns the exactly standardised ``x_std``; the outputs of
    ``transform`` were noted as released and passed."""
    x, y, _, _ = private
    scaler = PrivateStandardizer(-1000.0, 1000.0, 10.0, generator=torch.Generator().manual_seed(6))
    scaler.fit(x, PrivacyLedger())
    exact = _standardised(x).double()
    laundered = scaler.transform(exact * scaler.std + scaler.mean).float()
    assert torch.allclose(laundered, exact.float(), atol=1e-5)
    found = data_statistics_held([], TensorDataset(laundered, y))
    assert any("standardised with its own mean and standard deviation" in f for f in found)


def test_released_buffers_pass_and_a_user_computed_mean_is_refused(private):
    x, y, scaler, _ = private
    dataset = TensorDataset(x, y)
    kept = Normalised(scaler.mean.float(), scaler.std.float())  # cast to float32, as a buffer would be
    assert data_statistics_held([("model", kept)], dataset) == []
    own = Normalised(x.mean(0), x.std(0))
    found = data_statistics_held([("model", own)], dataset)
    assert any("buffer mean equals the per-feature mean" in f for f in found)
    assert any("buffer std equals the per-feature standard deviation" in f for f in found)
    assert not is_released(x.mean(0)) and is_released(scaler.mean.float())


def test_without_the_notes_the_same_release_would_be_refused(private, monkeypatch):
    """The notes are what lets them through (so the tests above would fail without them)."""
    from lightning_dp.record_statistics import released_statistics

    x, y, scaler, scaled = private
    monkeypatch.setattr(released_statistics, "_RELEASED", [])
    assert data_statistics_held([("model", Normalised(scaler.mean.float(), scaler.std.float()))], TensorDataset(x, y))


class NormalisingClassifier(TinyClassifier):
    """Standardises its inputs with buffers it holds (the released statistics, here)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__(d_in=D)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward((x - self.mean) / self.std)


def test_a_fit_passes_only_the_releases_its_own_ledger_was_charged(private):
    """A standardiser charged to a ledger thrown away leaves the fit's ε without its releases: refused; charged to the
    fit's strategy, the same buffers train."""
    x, y, scaler, _ = private
    loader = DataLoader(TensorDataset(x, y), batch_size=400)
    model = lambda: NormalisingClassifier(scaler.mean.float(), scaler.std.float())  # noqa: E731
    uncharged = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)buffer mean equals the per-feature mean.*"
                       r"PrivateStandardizer"):
        quiet_trainer(strategy=uncharged, max_steps=1).fit(model(), loader)
    assert uncharged.ledger.steps == 0
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    scaler.charge(strategy)
    quiet_trainer(strategy=strategy, max_steps=1).fit(model(), loader)
    assert strategy.ledger.entries[0].run == scaler.run and strategy.ledger.steps == 3 + 1


def test_a_direct_call_of_note_released_is_refused_and_launders_nothing(private):
    """note_released is bound to the standardiser's own fit: the user's code noting the exact mean (as it once could,
    ``note_released(run, x.mean(0))`` under a run its ledger charged) is refused, notes nothing, and the exact
    statistics stay refused by rule 11."""
    from lightning_dp.record_statistics.released_statistics import note_released

    x, y, scaler, _ = private
    exact_mean, exact_std = x.mean(0).double(), x.std(0).double()
    with pytest.raises(PrivacyConfigurationError, match=r"note_released is PrivateStandardizer.fit's own"):
        note_released(scaler.run, exact_mean, exact_std)  # the old signature: (run, *values)
    forged = PrivateStandardizer(-10.0, 10.0, SIGMA)
    forged.mean, forged.std, forged.run = exact_mean, exact_std, scaler.run
    with pytest.raises(PrivacyConfigurationError, match=r"note_released is PrivateStandardizer.fit's own"):
        note_released(forged)  # a standardiser object the user filled with the exact statistics
    assert not is_released(exact_mean) and not is_released(exact_std)
    found = data_statistics_held([("model", Normalised(x.mean(0), x.std(0)))], TensorDataset(x, y))
    assert any("buffer mean equals the per-feature mean" in f for f in found)


class Quiet(PrivateStandardizer):
    """A subclass that draws no noise: its fit runs, its releases are not noted."""

    def _noise(self, count: int) -> torch.Tensor:
        return torch.zeros(count, dtype=torch.float64)


def test_a_subclass_fits_but_its_releases_are_not_noted(private):
    x, y, _, _ = private
    quiet = Quiet(-10.0, 10.0, SIGMA).fit(x, PrivacyLedger())
    assert torch.allclose(quiet.mean, x.double().mean(0))  # the exact mean: no noise
    assert not is_released(quiet.mean)
    assert data_statistics_held([("model", Normalised(quiet.mean.float(), quiet.std.float()))], TensorDataset(x, y))
