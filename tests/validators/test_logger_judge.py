"""Media written to a logger by the training hooks handed no batch (validators/logger_judge.py): held back, the hook
run again on the exchanged data; what the released model alone gives (qa11 b2, b3, b6, b7, b8) is written without a
declaration, what the training data or its logged values move is refused and not written."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Classifier, data, loader, strategy  # noqa: E402
from test_logger_outputs import _tags  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def _fit(model: pl.LightningModule, tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(max_steps=4, logger=TensorBoardLogger(tmp_path), strategy=strategy(), **kwargs)
    trainer.fit(model, loader())  # one epoch: 4 steps of 16
    return trainer


class GradientNorms(pl.Callback):
    """qa11 b2: the per-parameter norms of ĝ, as one histogram, before each optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001, ANN201
        norms = torch.stack([p.grad.norm() for p in pl_module.parameters() if p.grad is not None])
        trainer.logger.experiment.add_histogram("grad_norms", norms, trainer.global_step)


class FromTheReleasedModel(Classifier):
    """qa11 b3, b6, b7, b8: samples from the model on random inputs, the epoch's weight change, configuration text."""

    def on_train_start(self) -> None:
        self.logger.experiment.add_text("config", "lr: 1.0, sigma: 1.0")

    def on_train_epoch_start(self) -> None:
        self.previous = [p.detach().clone() for p in self.parameters()]

    def on_train_epoch_end(self) -> None:
        writer = self.logger.experiment
        with torch.no_grad():
            samples = torch.sigmoid(self(torch.randn(8, 4)))  # a prior's samples, drawn afresh
        writer.add_images("samples", samples.view(8, 1, 1, 2), self.current_epoch)
        delta = torch.cat([(p.detach() - q).flatten() for p, q in zip(self.parameters(), self.previous)])
        writer.add_histogram("delta", delta, self.current_epoch)

    def on_train_end(self) -> None:
        self.logger.experiment.add_text("summary", f"epochs={self.current_epoch}")


def test_what_the_released_model_alone_gives_is_written_without_a_declaration(tmp_path: Path):
    _fit(FromTheReleasedModel(), tmp_path, callbacks=[GradientNorms()])
    assert not any(hasattr(hook, "__wrapped__") for cls in (FromTheReleasedModel, GradientNorms)
                   for hook in vars(cls).values())  # the hooks as they were after the fit
    tags = _tags(tmp_path)
    assert {"grad_norms", "delta"} <= tags.get("histograms", set())
    assert "samples" in tags.get("images", set())
    assert {"config/text_summary", "summary/text_summary"} <= tags.get("tensors", set())


class MixesTheLoss(Classifier):
    """The weights with the training loop's logged loss in one histogram, at epoch end."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics["train_loss"].view(1)
        self.logger.experiment.add_histogram("mixed", torch.cat([self.net[0].weight.flatten().detach(), loss]))


class MixesABatchStatistic(Classifier):
    """The weights with the batch's loss in one histogram, at the batch's end."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        values = torch.cat([self.net[0].weight.flatten().detach(), outputs["loss"].detach().view(1)])
        self.logger.experiment.add_histogram("mixed", values, self.global_step)


class PerExampleLosses(Classifier):
    """A histogram of the batch's per-example losses, in training_step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = torch.nn.functional.cross_entropy(self(batch[0]), batch[1], reduction="none")
        self.logger.experiment.add_histogram("mixed", losses.detach(), self.global_step)
        return losses.mean()


class KeptOutputs(Classifier):
    """The batch's inputs kept by training_step, written as images at epoch end."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.kept = [*getattr(self, "kept", []), batch[0].detach()]
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.logger.experiment.add_images("mixed", torch.cat(self.kept).view(-1, 1, 2, 2), self.current_epoch)


class CallsTheHookInAStep(Classifier):
    """training_step keeps its batch and calls the epoch-end hook itself: not judged (Lightning's current hook is
    training_step), refused, by the first check that sees it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.kept = batch[0].detach()
        self.on_train_epoch_end()
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.logger.experiment.add_images("mixed", self.kept.view(-1, 1, 2, 2), self.current_epoch)


@pytest.mark.parametrize("model, refusal", [
    (MixesTheLoss, r"add_histogram was called in on_train_epoch_end"),
    (MixesABatchStatistic, r"add_histogram was called in on_train_batch_end"),
    (PerExampleLosses, r"add_histogram was called in training_step"),
    (KeptOutputs, r"kept"),  # the kept-state checks refuse the list at the first release
    (CallsTheHookInAStep, r"add_images was called in on_train_epoch_end|Kept state written outside the release"),
])
def test_what_the_data_moves_is_refused_and_not_written(tmp_path: Path, model: type, refusal: str):
    with pytest.raises(PrivacyConfigurationError, match=refusal):
        _fit(model(), tmp_path)
    tags = _tags(tmp_path)
    assert "mixed" not in tags.get("histograms", set()) | tags.get("images", set())
    assert not any(hasattr(hook, "__wrapped__") for hook in vars(model).values())  # the hooks as they were


class Figures(Classifier):
    """A figure of the first layer's weights at epoch end; ``data``: of the training set's first records too."""

    data = False

    def on_train_epoch_end(self) -> None:
        import matplotlib.pyplot as plt

        figure = plt.figure()
        plt.imshow(self.net[0].weight.detach().numpy())
        self.logger.experiment.add_figure("filters", figure, self.current_epoch)  # drawn as an image, when written
        if self.data:
            figure = plt.figure()
            plt.imshow(self.trainer.train_dataloader.dataset.tensors[0][:8].numpy())
            self.logger.experiment.add_figure("records", figure, self.current_epoch)


def test_a_figure_of_the_weights_is_written_and_one_of_the_training_set_refused(tmp_path: Path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    _fit(Figures(), tmp_path / "weights")
    assert _tags(tmp_path / "weights").get("images") == {"filters"}
    model = Figures()
    model.data = True
    with pytest.raises(PrivacyConfigurationError, match=r"add_figure was called in on_train_epoch_end"):
        _fit(model, tmp_path / "records")
    assert not _tags(tmp_path / "records").get("images")  # nothing of the hook's calls written


# ---------------------------------------------------------------------------- copies derived from the data (zoo25)
class LogsAHeldValue(Classifier):
    """A histogram at epoch end of a value the hook reads from the user's state (``held``), not of the batch."""

    def held(self) -> Any:
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_train_epoch_end(self) -> None:
        values = torch.as_tensor(self.held()).float().flatten()
        self.logger.experiment.add_histogram("derived", values, self.current_epoch)


class RecordNorms(LogsAHeldValue):
    """l1: the model keeps the records' norms, computed before the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = data().tensors[0].norm(dim=1)

    def held(self) -> Any:
        return self.norms


class NormsAsFloats(RecordNorms):
    """The records' norms as a list of Python floats."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = self.norms.tolist()


class Standardised(pl.LightningDataModule):
    """l1: the datamodule keeps its own standardised copy of the features besides the training data."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = data().tensors
        self.x_std = (self.x - self.x.mean(0)) / self.x.std(0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)


class FromTheDatamodule(LogsAHeldValue):
    def held(self) -> Any:
        return self.trainer.datamodule.x_std[:, 0]


class Cached(torch.utils.data.Dataset):
    """l2: a dataset filling a cache of a derived value as records are fetched."""

    def __init__(self) -> None:
        self.x, self.y = data(1024).tensors  # more records than a walk of the training data's containers reads
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        self.cache.setdefault(int(i), (self.x[i] ** 2).sum())
        return self.x[i], self.y[i]


class FromTheCache(LogsAHeldValue):
    """The cache read through the dataset the model holds (as zoo25 l2 did)."""

    def __init__(self) -> None:
        super().__init__()
        self.dataset = Cached()

    def held(self) -> Any:
        return torch.stack(list(self.dataset.cache.values()))


class FromTheTrainer(LogsAHeldValue):
    """l3: a copy of the features put on the trainer before the fit."""

    def held(self) -> Any:
        return self.trainer.stash


class FromTheValidationSet(LogsAHeldValue):
    """l5: the validation set is the training set in float64."""

    def held(self) -> Any:
        return self.trainer.val_dataloaders.dataset.tensors[0][:, 0]


def _derived_fit(case: str, tmp_path: Path) -> None:
    x, y = data().tensors
    trainer = quiet_trainer(max_steps=4, logger=TensorBoardLogger(tmp_path), strategy=strategy(),
                            limit_val_batches=0 if case != "validation set" else 1.0)
    if case == "model":
        trainer.fit(RecordNorms(), loader())
    elif case == "list of floats":
        trainer.fit(NormsAsFloats(), loader())
    elif case == "datamodule":
        trainer.fit(FromTheDatamodule(), datamodule=Standardised())
    elif case == "cache":
        model = FromTheCache()
        trainer.fit(model, DataLoader(model.dataset, batch_size=16))
    elif case == "trainer":
        trainer.stash = x.clone()
        trainer.fit(FromTheTrainer(), loader())
    else:
        trainer.fit(FromTheValidationSet(), loader(), DataLoader(TensorDataset(x.double(), y), batch_size=64))


@pytest.mark.parametrize("case", ["model", "list of floats", "datamodule", "cache", "trainer", "validation set"])
def test_a_value_derived_from_the_data_held_anywhere_is_refused_and_not_written(tmp_path: Path, case: str):
    """zoo25 l1, l2, l3, l5: a copy derived from the training data (not a copy of its records) held by the model, the
    datamodule, a dataset's cache, the trainer or the validation loader is given other values in the run again."""
    with pytest.raises(PrivacyConfigurationError, match=r"add_histogram was called in on_train_epoch_end"):
        _derived_fit(case, tmp_path)
    assert "derived" not in _tags(tmp_path).get("histograms", set())


class HeldGenerators(Classifier):
    """zoo25 l3 FALSEREF: samples of the model on prior inputs drawn from generators the module holds."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)
        self.rng = np.random.default_rng(0)

    def on_train_epoch_end(self) -> None:
        z = torch.cat([torch.randn(8, 4, generator=self.gen),
                       torch.as_tensor(self.rng.standard_normal((8, 4)), dtype=torch.float32)])
        with torch.no_grad():
            samples = self(z)
        self.logger.experiment.add_histogram("prior", samples, self.current_epoch)


def test_prior_samples_from_a_generator_the_module_holds_are_written(tmp_path: Path):
    _fit(HeldGenerators(), tmp_path)
    assert "prior" in _tags(tmp_path).get("histograms", set())


def test_a_decision_beside_a_metric_reset_in_a_judged_hook_is_still_refused_with_a_logger(tmp_path: Path):
    """A callback stops from the module's training metrics at epoch end and resets them: the reset (a library
    module's tensors written) does not make the judge run the hook again, which would take the decision outside the
    decision checks' window; the stop is refused as without a logger."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_metric_values import Decides, Tracks

    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"changed at the end of an epoch \(on_train_epoch_end"):
        quiet_trainer(strategy=dp, max_steps=12, callbacks=[Decides("stop below")],
                      logger=TensorBoardLogger(tmp_path)).fit(Tracks(), loader())
