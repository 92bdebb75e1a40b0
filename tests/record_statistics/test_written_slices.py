"""A statistic of the training data written into one row or column of a larger tensor
(record_statistics/training_statistics.TrainingStatistics.slices_held, written_statistics.py): a per-feature mean the
script saved before the fit, read back at a batch's end into the first row of a memory bank, the first column of a
buffer or one row of an embedding's weight (through ``.data``, which moves no version counter), is refused before the
next release, as in a buffer of its own size; an EMA of a weight matrix, a bank of public constants and a row reset
to zeros train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.training_statistics import TrainingStatistics  # noqa: E402

torch.set_num_threads(1)


def _saved_mean(tmp_path: Path) -> Callable[[], torch.Tensor]:
    path = tmp_path / "mean.pt"
    torch.save(data(64).tensors[0].mean(0), path)
    return lambda: torch.load(path)


class Banked(Classifier):
    """A [6, 4] buffer ``bank`` (a [4, 6] one for columns) and an [10, 4] embedding the forward reads; at each batch's
    end ``write(self)``."""

    def __init__(self, write: Callable[["Banked"], None], columns: bool = False) -> None:
        super().__init__()
        self.register_buffer("bank", torch.zeros(4, 6) if columns else torch.zeros(6, 4))
        self.emb = nn.Embedding(10, 4)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + 0.01 * self.bank.sum() + 0.01 * self.emb.weight[0])

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.write(self)


def _fit(model: nn.Module, steps: int = 4) -> None:
    trainer = quiet_trainer(strategy=strategy(), max_steps=steps, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data(64), batch_size=16))


@pytest.mark.parametrize("where", ["bank row", "bank column", "embedding row"])
def test_a_training_mean_written_into_one_slice_is_refused(tmp_path: Path, where: str) -> None:
    read = _saved_mean(tmp_path)

    def write(m: Banked) -> None:
        if where == "bank row":
            m.bank[2] = read()
        elif where == "bank column":
            m.bank[:, 3] = read()
        else:
            m.emb.weight.data[7] = read()

    model = Banked(write, columns=where == "bank column")
    expected = {"bank row": "row 2 of buffer bank", "bank column": "column 3 of buffer bank",
                "embedding row": "row 7 of parameter emb.weight"}[where]
    with pytest.raises(PrivacyConfigurationError, match="statistic of the training data") as refusal:
        _fit(model)
    assert f"{expected} equals the per-feature mean" in str(refusal.value)


@pytest.mark.parametrize("write", ["ema of a weight", "public constants", "row reset"])
def test_slices_written_from_the_weights_or_constants_train(write: str) -> None:
    def written(m: Banked) -> None:
        if write == "ema of a weight":
            m.bank.mul_(0.9).add_(0.1 * m.net[0].weight[:6, :4])
        elif write == "public constants":
            m.bank[0] = torch.linspace(-1.0, 1.0, 4)
        else:
            m.emb.weight.data[3] = 0.0

    _fit(Banked(written), steps=6)


def test_slices_held_compares_the_rows_and_columns_named_or_all_of_them():
    x = data(64).tensors[0]
    stats = TrainingStatistics([], [("x", x)])
    bank = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    assert stats.slices_held("buffer bank", bank) == []
    bank[3] = x.mean(0)
    assert stats.slices_held("buffer bank", bank) == [
        "row 3 of buffer bank equals the per-feature mean of the training x"]
    assert stats.slices_held("buffer bank", bank, rows=torch.tensor([0, 1]), columns=torch.tensor([])) == []
    assert stats.slices_held("buffer bank", bank, rows=torch.tensor([3]))[0].startswith("row 3 of buffer bank")
    assert stats.slices_held("buffer bank", bank.t().contiguous())[0].startswith("column 3 of buffer bank")
    stats.public = ("bank",)
    assert stats.slices_held("buffer bank", bank) == []
