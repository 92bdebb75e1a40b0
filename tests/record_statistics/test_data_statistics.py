"""Statistics of the training data kept or trained on (record_statistics/data_statistics.py): a normalisation buffer holding
the training mean, class weights from the training labels, features standardised with their own statistics, a
transform of the datamodule holding them — refused before any release; public constants and the data's own values
are not statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy, refused_before_any_release, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402

X, Y = data(64).tensors


class Normalised(Classifier):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward((x - self.mean) / self.std)


class ClassWeighted(Classifier):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss(weight=weight)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.criterion(self(batch[0]), batch[1])


COUNTS = torch.bincount(Y).double()


@pytest.mark.parametrize("model, what", [
    (lambda: Normalised(X.mean(0), X.std(0)), "buffer mean equals the per-feature mean"),
    (lambda: Normalised(X.mean(0) * 0 + 0.5, X.std(0, correction=0)), "per-feature standard deviation"),
    (lambda: ClassWeighted((COUNTS.sum() / (2 * COUNTS)).float()), "balanced class weights"),
    (lambda: ClassWeighted((1 / COUNTS / (1 / COUNTS).sum()).float()), "inverse class frequencies"),
])
def test_a_statistic_of_the_training_data_held_by_the_model_is_refused_before_any_release(model, what):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{what}"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(m, DataLoader(TensorDataset(X, Y), batch_size=16))
    assert unchanged(before, m)


class PriorBias(Classifier):
    """'Initialise the output bias to the log class prior' (a common recipe), in __init__."""

    def __init__(self, labels: torch.Tensor, odds: bool = False) -> None:
        super().__init__()
        prior = (torch.bincount(labels).double() / len(labels)).log()
        if odds:  # one logit for a binary task: its bias the log-odds
            self.net[2] = nn.Linear(8, 1)
        with torch.no_grad():
            self.net[2].bias.copy_(prior[1:] - prior[:1] if odds else prior)


class PcaInit(Classifier):
    """The first layer's first rows set to the training features' principal directions (an SVD of the centred
    features, as scikit-learn's PCA computes them)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        _, _, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
        with torch.no_grad():
            self.net[0].weight[:3].copy_(vh[:3])


@pytest.mark.parametrize("model, what", [
    (lambda: PriorBias(Y), "parameter net.2.bias equals the log class frequencies"),
    (lambda: PcaInit(X), "rows of parameter net.0.weight are the principal directions"),
])
def test_weights_initialised_from_the_training_data_are_refused(model, what):
    m = model()
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{what}"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(m, DataLoader(TensorDataset(X, Y), batch_size=16))


def test_the_log_odds_and_weights_from_public_values_are_told_apart():
    dataset = TensorDataset(X, Y)
    binary = PriorBias(Y, odds=True)
    assert data_statistics_held([("model", binary)], dataset) == [
        "parameter net.2.bias equals the log-odds of class 1 of the training labels (tensors[1])"]
    uniform = PriorBias(torch.tensor([0, 1]))  # a public prior: log(1/2) for both classes
    assert data_statistics_held([("model", uniform)], dataset) == []
    other = PcaInit(torch.randn(64, 4, generator=torch.Generator().manual_seed(7)))  # PCA of other (public) data
    assert data_statistics_held([("model", other)], dataset) == []
    assert data_statistics_held([("model", Classifier())], dataset) == []  # random initial weights


def test_features_standardised_with_their_own_statistics_are_refused():
    standardised = (X - X.mean(0)) / X.std(0)
    with pytest.raises(PrivacyConfigurationError, match="standardised with its own mean and standard deviation"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(
            Classifier(), DataLoader(TensorDataset(standardised, Y), batch_size=16))


def _robust(x: torch.Tensor) -> torch.Tensor:
    q25, q50, q75 = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75]), dim=0)
    return (x - q50) / (q75 - q25)


def _clip_scaled(x: torch.Tensor) -> torch.Tensor:
    low, high = torch.quantile(x, 0.01, dim=0), torch.quantile(x, 0.99, dim=0)
    return ((x - low) / (high - low)).clamp(0, 1)


@pytest.mark.parametrize("scale,what", [
    (_robust, "median and interquartile range"),
    (lambda x: (x - x.min(0).values) / (x.max(0).values - x.min(0).values), r"\[0, 1\] by its own minimum"),
    (_clip_scaled, r"\[0, 1\] by its own minimum"),
    (lambda x: 2 * (x - x.min(0).values) / (x.max(0).values - x.min(0).values) - 1, r"\[-1, 1\] by its own minimum"),
])
def test_features_scaled_by_their_own_order_statistics_are_refused(scale, what):
    with pytest.raises(PrivacyConfigurationError, match=what):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(
            Classifier(), DataLoader(TensorDataset(scale(X), Y), batch_size=16))


def _with_blank_columns(scale: Any) -> torch.Tensor:
    """Two of the four features scaled by ``scale`` as scikit-learn's scalers leave them, beside two columns constant
    in the data (digits' blank border pixels), which the scalers leave at 0."""
    return torch.cat([scale(X[:, :2]), torch.zeros(len(X), 2)], 1)


@pytest.mark.parametrize("scale,what", [
    (lambda x: (x - x.mean(0)) / x.std(0, correction=0), "standardised with its own mean"),
    (_robust, "median and interquartile range"),
    (lambda x: (x - x.min(0).values) / (x.max(0).values - x.min(0).values), r"\[0, 1\] by its own minimum"),
])
def test_scaled_features_beside_constant_columns_are_refused(scale, what):
    with pytest.raises(PrivacyConfigurationError, match=what):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(
            Classifier(), DataLoader(TensorDataset(_with_blank_columns(scale), Y), batch_size=16))


def test_binary_features_and_a_known_range_divided_out_train():
    one_hot = (torch.rand(len(X), 16, generator=torch.Generator().manual_seed(1)) > 0.5).float()  # 0/1: two values
    known = (X.clamp(-3, 3) + 3) / 6  # a public range: not every column reaches both ends
    from lightning_dp.data import DistinctRecords

    blank = torch.cat([known[:, :2], torch.zeros(len(X), 2)], 1)  # a public range beside constant columns
    for features in (one_hot[:, :4], known, blank):  # the classifier reads 4 features (4 binary ones repeat: declared)
        dp = strategy()
        records = DistinctRecords(TensorDataset(features, Y.clone()))  # labels in memory of their own: other records
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(records, batch_size=16))
        assert dp.ledger.steps == 2


class Standardise:
    """A transform object of the user's (as torchvision's Normalize keeps them)."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean, self.std = mean, std


class WithTransform(pl.LightningDataModule):
    def __init__(self, transform: Standardise) -> None:
        super().__init__()
        self.transform = transform

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(X, Y), batch_size=16)


def test_a_transform_of_the_datamodule_holding_the_training_mean_is_refused():
    transform = Standardise(X.mean(0).tolist(), [1.0] * 4)
    with pytest.raises(PrivacyConfigurationError, match=r"datamodule\.transform\.mean equals the per-feature mean"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(Classifier(), datamodule=WithTransform(transform))


def test_public_constants_a_declared_name_and_numpy_statistics_are_told_apart():
    dataset = TensorDataset(X, Y)
    public = Normalised(torch.full((4,), 0.5), torch.full((4,), 2.0))
    assert data_statistics_held([("model", public)], dataset) == []
    private = Normalised(X.mean(0), torch.full((4,), 2.0))
    assert data_statistics_held([("model", private)], dataset, public=["mean"]) == []
    holder = nn.Module()
    holder.counts = np.bincount(Y.numpy())  # an attribute, as NumPy
    assert data_statistics_held([("model", holder)], dataset) == ["attribute counts equals the class counts of the "
                                                                   "training labels (tensors[1])"]


def test_ordinary_fits_pass():
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=3).fit(Classifier(), DataLoader(TensorDataset(X / 3.0, Y), batch_size=16))
    assert dp.ledger.steps == 3


class Centre(nn.Module):
    def __init__(self, mean: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.mean


def test_a_plain_loop_is_checked_when_it_verifies():
    from cases import plain_step

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)  # plain_step's data
    model = nn.Sequential(Centre(x.mean(0)), nn.Linear(4, 2))
    with pytest.raises(PrivacyConfigurationError, match=r"buffer 0\.mean equals the per-feature mean"):
        plain_step(model)


def test_missing_values_in_the_features_do_not_stop_the_checks():
    """NaN and ±inf entries (missing values imputed in the forward) leave the statistics checks standing: rows with one
    are left out of the principal directions (torch.linalg.eigh failed to converge on them)."""

    class Imputing(Classifier):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))

    features = X.clone()
    features[3, 1], features[7, 2] = float("nan"), float("inf")
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Imputing(), DataLoader(TensorDataset(features, Y), batch_size=16))
    assert dp.ledger.steps == 2


class Waveform(pl.LightningModule):
    """A one-channel Conv1d classifier (padding (0,), dilation (1,)), on waveforms normalised per utterance as Hugging
    Face's Wav2Vec2FeatureExtractor does (each to mean 0 and variance 1: the data's global mean is then 0 and its
    standard deviation 1, to within the matching tolerance); ``held``: buffers of the data's global mean and standard
    deviation as well."""

    def __init__(self, held: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 4, 9, stride=4), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                                 nn.Flatten(), nn.Linear(4, 2))
        if held is not None:
            self.register_buffer("mean", held[0])
            self.register_buffer("std", held[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0] if not hasattr(self, "mean") else (batch[0] - self.mean) / self.std
        return nn.functional.cross_entropy(self.net(x), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _waveforms(per_utterance: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    wav = torch.randn(64, 1, 200, generator=g) * (1 + 3 * torch.rand(64, 1, 1, generator=g))
    wav = wav + torch.rand(64, 1, 1, generator=g)
    if per_utterance:
        wav = (wav - wav.mean(-1, keepdim=True)) / torch.sqrt(wav.var(-1, keepdim=True) + 1e-7)
    return TensorDataset(wav, torch.randint(0, 2, (64,), generator=g))


def test_data_normalised_per_record_is_not_taken_for_a_layers_zeros_and_ones():
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Waveform(), DataLoader(_waveforms(per_utterance=True), batch_size=16))
    assert dp.ledger.steps == 2
    data = _waveforms(per_utterance=False)
    held = (data.tensors[0].mean(), data.tensors[0].std())  # the training data's global mean and deviation: kept
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)buffer mean equals the .*mean.*buffer std equals the .*standard deviation"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(Waveform(held), DataLoader(data, batch_size=16))


_T = X @ torch.tensor([1.0, -0.5, 0.25, 2.0]) + 3.0  # a float target (a regression's y)


@pytest.mark.parametrize("value, what", [
    (lambda: _T.mean(), "mean"),
    (lambda: _T.std(), "standard deviation"),
    (lambda: _T.median(), "median"),  # the lower median
    (lambda: _T.quantile(0.5), "median"),
    (lambda: _T.min(), "minimum"),
    (lambda: _T.max(), "maximum"),
])
def test_a_head_bias_set_to_a_statistic_of_the_float_target_is_found(value, what):
    head = nn.Linear(4, 1)
    with torch.no_grad():
        head.bias.fill_(float(value()))
    assert data_statistics_held([("model", head)], TensorDataset(X, _T)) == [
        f"parameter bias equals the {what} of the training tensors[1]"]
    column = TensorDataset(X, _T[:, None])  # y as [N, 1]
    assert data_statistics_held([("model", head)], column) == [f"parameter bias equals the {what} of the training "
                                                               "tensors[1]".replace("the mean", "the per-feature mean")
                                                               .replace("the standard", "the per-feature standard")]


def test_per_output_order_statistics_of_a_multi_output_target_and_the_features_extremes_are_found():
    targets = torch.stack([_T, -_T / 2 + 1, _T ** 2 / 10], 1)
    head = nn.Linear(4, 3)
    with torch.no_grad():
        head.bias.copy_(targets.median(0).values)
    assert data_statistics_held([("model", head)], TensorDataset(X, targets)) == [
        "parameter bias holds the per-feature median of the training tensors[1]"]
    holder = nn.Module()
    holder.top = float(X.max())  # a global maximum to divide by
    assert data_statistics_held([("model", holder)], TensorDataset(X, Y)) == [
        "attribute top equals the maximum of the training tensors[0]"]


def test_the_end_of_a_public_range_is_not_taken_for_the_datas_extreme():
    """Features scaled publicly to [-1, 1] (digits / 8 - 1) reach -1 and 1: an augmentation's fill of -1.0 (the
    background) equals their minimum but is the range's end, a round number, not a record's value."""
    digits = torch.randint(1, 16, (64, 6)).double() / 8 - 1
    digits[0, 0], digits[1, 1] = -1.0, 1.0  # the range's ends, met by one pixel each
    holder = nn.Module()
    holder.fill, holder.top = -1.0, 1.0
    assert data_statistics_held([("model", holder)], TensorDataset(digits, Y[:64])) == []
    iris_like = torch.randint(1, 25, (64, 4)).double() / 10  # recorded to one decimal: a learning rate of 0.1
    holder.lr = 0.1                                          # equals the smallest value of a column
    iris_like[0, 3] = 0.1
    assert data_statistics_held([("model", holder)], TensorDataset(iris_like, Y[:64])) == []
    del holder.lr
    holder.fill = float(X.min())  # a continuous record's value is still found
    assert data_statistics_held([("model", holder)], TensorDataset(X, Y)) == [
        "attribute fill equals the minimum of the training tensors[0]"]


def test_a_binary_tasks_weight_from_its_label_counts_is_found_as_one_number():
    """BCEWithLogitsLoss(pos_weight=neg / pos) keeps the ratio as a buffer; a focal loss keeps alpha = neg / N as
    a float: both give the label counts away (zoo19 w1). A round one (0.25, 3.0) is a choice, not the data's."""
    labels = torch.cat([torch.zeros(219), torch.ones(37)]).long()
    features = torch.randn(256, 4, dtype=torch.float64)
    loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([219 / 37]))
    holder = nn.Module()
    holder.alpha = 219 / 256
    found = data_statistics_held([("model", nn.ModuleDict({"loss": loss})), ("focal", holder)],
                                 TensorDataset(features, labels))
    assert found == ["buffer loss.pos_weight equals the ratio of the class counts (0 to 1) of the training labels "
                     "(tensors[1])",
                     "attribute alpha equals the fraction of class 0 of the training labels (tensors[1])"]
    holder.alpha, chosen = 0.25, nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0]))
    balanced = torch.cat([torch.zeros(192), torch.ones(64)]).long()  # its fraction of class 1 is 0.25, its ratio 3
    assert data_statistics_held([("model", nn.ModuleDict({"loss": chosen})), ("focal", holder)],
                                TensorDataset(features, balanced)) == []


class Regression(Classifier):
    """'Initialise the output bias to the mean target' (a common recipe), in __init__."""

    def __init__(self, target: torch.Tensor | None) -> None:
        super().__init__()
        self.net[2] = nn.Linear(8, 1)
        if target is not None:
            with torch.no_grad():
                self.net[2].bias.fill_(float(target.mean()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]).squeeze(-1), batch[1])


def test_a_regression_bias_set_to_the_mean_target_is_refused_and_a_public_one_trains():
    model = Regression(_T)
    refused_before_any_release(model, TensorDataset(X, _T), r"(?s)parameter net\.2\.bias equals the mean.*public_state")
    ratings = (_T.round().clamp(1, 5))  # integer-valued float targets: a known scale's ends and middle are public
    head = nn.Linear(4, 1)
    for value in (5.0, 3.0, 1.0):
        with torch.no_grad():
            head.bias.fill_(value)
        assert data_statistics_held([("model", head)], TensorDataset(X, ratings)) == []
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Regression(None), DataLoader(TensorDataset(X, _T), batch_size=16))
    assert dp.ledger.steps == 2


def test_features_clipped_at_public_bounds_are_not_taken_for_min_max_scaled():
    """zoo32 t08: ``(0.3 x + 0.5).clamp(0, 1)`` reaches 0 and 1 in every column like a MinMaxScaler, but with as many
    records at each end as that column's tails hold (counts differing between columns); a scaler by the columns' own
    statistics leaves one or two records there, or the same number in every column (one quantile level)."""
    draw = torch.randn(256, 8, generator=torch.Generator().manual_seed(2))
    labels = (draw[:, 0] > 0).long()
    assert data_statistics_held([], TensorDataset((0.3 * draw + 0.5).clamp(0, 1), labels)) == []
    low, high = torch.quantile(draw, 0.05, dim=0), torch.quantile(draw, 0.95, dim=0)
    assert data_statistics_held([], TensorDataset(((draw - low) / (high - low)).clamp(0, 1), labels)) == [
        "the training tensors[0] is scaled to [0, 1] by its own minimum and maximum (or quantiles)"]
