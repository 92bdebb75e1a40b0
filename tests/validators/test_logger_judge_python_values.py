"""Python numbers and strings derived from the data and held in the user's state, written to a logger by a judged hook
(validators/logger_judge.py, fingerprints/held_numbers.py): given other values in the run again, so a text of them is
refused and not written; configuration text of public values (the hyper-parameters, the optimizer's settings, σ, a
step counter, names declared public) is still written."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Classifier, data, loader, strategy  # noqa: E402
from test_logger_outputs import _tags  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def _fit(model: pl.LightningModule, tmp_path: Path, **kwargs: Any) -> None:
    quiet_trainer(max_steps=4, logger=TensorBoardLogger(tmp_path), strategy=strategy(**kwargs)).fit(model, loader())


def _texts(tmp_path: Path) -> set[str]:
    return {t.partition("/")[0] for t in _tags(tmp_path).get("tensors", set())}


class WritesText(Classifier):
    """``add_text("held", self.text())`` at epoch end; ``text`` formats what the model holds."""

    def text(self) -> str:
        raise NotImplementedError

    def on_train_epoch_end(self) -> None:
        self.logger.experiment.add_text("held", self.text(), self.current_epoch)


class FloatInInit(WritesText):
    def __init__(self) -> None:
        super().__init__()
        self.stat = float(data().tensors[0].norm())

    def text(self) -> str:
        return f"{self.stat}"


class IntInSetup(WritesText):
    def setup(self, stage: str) -> None:
        self.positives = int(data().tensors[1].sum())

    def text(self) -> str:
        return f"positives: {self.positives}"


class StringOfRecords(WritesText):
    def __init__(self) -> None:
        super().__init__()
        self.first = ", ".join(f"{v:.3f}" for v in data().tensors[0][:3, 0].tolist())

    def text(self) -> str:
        return self.first


class ClassCounts(WritesText):
    def __init__(self) -> None:
        super().__init__()
        self.counts = torch.bincount((data().tensors[0][:, 1] > 0.5).long()).tolist()  # not the labels' (rule 11)

    def text(self) -> str:
        return f"counts: {self.counts}"


class StatisticsDict(WritesText):
    def __init__(self) -> None:
        super().__init__()
        x = data().tensors[0]
        self.stats = {"energy": float((x ** 2).sum()), "n_large": int((x[:, 1] > 0.5).sum()), "name": "train"}

    def text(self) -> str:
        return f"{self.stats}"


class OnTheDatamodule(WritesText):
    """A tuple of floats the callback holds."""

    def text(self) -> str:
        return str(self.trainer.callbacks[-1].extent)


class Extent(pl.Callback):
    def __init__(self) -> None:
        x = data().tensors[0]
        self.extent = (float(x.min()), float(x.max()))


@pytest.mark.parametrize("model", [FloatInInit, IntInSetup, StringOfRecords, ClassCounts, StatisticsDict])
def test_a_python_value_derived_from_the_data_is_refused_and_not_written(tmp_path: Path, model: type):
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)add_text was called in on_train_epoch_end.*"
                                                        r"save_hyperparameters.*public_state"):
        _fit(model(), tmp_path)
    assert "held" not in _texts(tmp_path)


def test_a_tuple_of_floats_a_callback_holds_is_refused(tmp_path: Path):
    with pytest.raises(PrivacyConfigurationError, match=r"add_text was called in on_train_epoch_end"):
        quiet_trainer(max_steps=4, logger=TensorBoardLogger(tmp_path), strategy=strategy(),
                      callbacks=[Extent()]).fit(OnTheDatamodule(), loader())
    assert "held" not in _texts(tmp_path)


class Configured(WritesText):
    """Configuration text: the hyper-parameters (saved, or not), the optimizer's learning rate, σ and C, the
    trainer's counters, a step counter the model keeps, a name declared public."""

    def __init__(self, lr: float = 0.5, hidden: int = 8, name: str = "mlp", layers: tuple = (8, 4),
                 options: Any = None, save: bool = True) -> None:
        super().__init__()
        options = options or {"activation": "tanh", "dropout": 0.1}
        if save:
            self.save_hyperparameters()
        self.lr, self.hidden, self.name, self.layers, self.options = lr, hidden, name, list(layers), options
        self.learning_rate = lr  # the same object as the saved hyper-parameter, under another name
        self.my_steps = 0
        self.declared = "kept public"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.my_steps += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def text(self) -> str:
        dp = self.trainer.strategy
        group = self.optimizers().optimizer.param_groups[0]
        return (f"lr={self.lr} ({self.learning_rate}) hidden={self.hidden} name={self.name} "
                f"group lr={group['lr']} sigma={dp.noise_multiplier} C={dp.max_grad_norm} "
                f"epoch={self.current_epoch} step={self.global_step} steps={self.my_steps} {self.declared} "
                f"layers={self.layers} options={self.options}")


def test_configuration_text_of_public_values_is_written(tmp_path: Path):
    _fit(Configured(), tmp_path, public_state=["declared"])
    assert "held" in _texts(tmp_path)


def test_configuration_text_of_values_not_saved_is_refused_naming_the_fix_and_written_when_declared(tmp_path: Path):
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)Python values.*\b(lr|hidden|name)\b.*"
                                                        r"save_hyperparameters.*public_state"):
        _fit(Configured(save=False), tmp_path / "refused", public_state=["declared"])
    assert "held" not in _texts(tmp_path / "refused")
    _fit(Configured(save=False), tmp_path / "declared",
         public_state=["declared", "hidden", "name", "layers", "options"])
    assert "held" in _texts(tmp_path / "declared")


class NormsHistogram(Classifier):
    """The tensors the judge covered already: a histogram of a tensor of the records' norms (refused), next to a
    histogram of the weights' change (written)."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.leak = leak
        self.norms = data().tensors[0].norm(dim=1)

    def on_train_epoch_start(self) -> None:
        self.previous = self.net[0].weight.detach().clone()

    def on_train_epoch_end(self) -> None:
        delta = self.net[0].weight.detach() - self.previous
        self.logger.experiment.add_histogram("delta", delta, self.current_epoch)
        if self.leak:
            self.logger.experiment.add_histogram("norms", self.norms, self.current_epoch)


def test_tensors_are_judged_as_before(tmp_path: Path):
    _fit(NormsHistogram(leak=False), tmp_path / "written")
    assert "delta" in _tags(tmp_path / "written").get("histograms", set())
    with pytest.raises(PrivacyConfigurationError, match=r"add_histogram was called in on_train_epoch_end") as error:
        _fit(NormsHistogram(leak=True), tmp_path / "refused")
    assert "Python values" not in str(error.value)  # a tensor's refusal, not the Python values'
    assert not _tags(tmp_path / "refused").get("histograms")
