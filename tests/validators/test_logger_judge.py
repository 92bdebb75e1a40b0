"""Media written to a logger by the training hooks handed no batch (validators/logger_judge.py): held back, the hook
run again on the exchanged data; what the released model alone gives (qa11 b2, b3, b6, b7, b8) is written without a
declaration, what the training data or its logged values move is refused and not written."""

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
from cases import Classifier, loader, strategy  # noqa: E402
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
