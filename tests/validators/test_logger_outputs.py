"""Media and distributions written to a logger by the training hooks (validators/logger_outputs.py): the private
batch's images, texts, histograms or embeddings sent to a logger's experiment from a training hook are refused;
held-out data's media (validation), the released state, the model's graph, scalars and the library's own monitor
train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.loggers.logger import Logger
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.callbacks import SecondMomentMonitor  # noqa: E402

torch.set_num_threads(1)
_OWN = {name: SummaryWriter.__dict__[name] for name in ("add_images", "add_histogram", "add_text", "add_embedding")}


def _fit(model: pl.LightningModule, tmp_path: Path, logger: Any = None, steps: int = 3, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("strategy", strategy())
    trainer = quiet_trainer(max_steps=steps, logger=logger or TensorBoardLogger(tmp_path), **kwargs)
    trainer.fit(model, loader())
    return trainer


def _tags(tmp_path: Path) -> dict[str, set[str]]:
    """What the event files under ``tmp_path`` hold, by kind (images, histograms, scalars, …)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, set[str]] = {}
    for events in tmp_path.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0, "histograms": 0})
        accumulator.Reload()
        for kind, names in accumulator.Tags().items():
            if isinstance(names, list):
                tags.setdefault(kind, set()).update(names)
            elif names is True:  # the graph
                tags.setdefault(kind, set()).add(kind)
    return tags


class BatchImages(Classifier):
    """The QA's i2: the batch's inputs written as images by training_step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.logger.experiment.add_images("train/batch", batch[0][:8].view(-1, 1, 2, 2), self.global_step)
        return super().training_step(batch, batch_idx)


def test_the_batch_written_as_images_by_training_step_is_refused(tmp_path: Path):
    model = BatchImages()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=r"SummaryWriter\.add_images was called in training_step"):
        _fit(model, tmp_path)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # refused before any release
    assert "train/batch" not in _tags(tmp_path).get("images", set())  # nothing was written
    assert all(SummaryWriter.__dict__[name] is own for name, own in _OWN.items())  # the writer as it was


class Writes(pl.Callback):
    """One habit of a user's callback: what it writes, in which training hook."""

    def __init__(self, hook: str, write: Any) -> None:
        self.hook, self.write = hook, write

    def _maybe(self, hook: str, trainer: pl.Trainer, pl_module: Any, batch: Any = None, outputs: Any = None) -> None:
        if hook == self.hook:
            self.write(trainer.logger.experiment, pl_module, batch, outputs)

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001, ANN201
        batch = next(iter(trainer.train_dataloader)) if self.hook == "on_train_start" else None
        self._maybe("on_train_start", trainer, pl_module, batch)  # a grid of training records at train start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
        self._maybe("on_train_batch_start", trainer, pl_module, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
        self._maybe("on_train_batch_end", trainer, pl_module, batch, outputs)

    def on_after_backward(self, trainer, pl_module):  # noqa: ANN001, ANN201
        self._maybe("on_after_backward", trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):  # noqa: ANN001, ANN201
        self._maybe("on_train_epoch_end", trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module):  # noqa: ANN001, ANN201
        self._maybe("on_validation_epoch_end", trainer, pl_module)


def _losses(writer: Any, module: Any, batch: Any, outputs: Any) -> None:
    x, y = batch
    losses = torch.nn.functional.cross_entropy(module(x), y, reduction="none")
    writer.add_histogram("train/per_example_loss", losses.detach(), module.global_step)


def _texts(writer: Any, module: Any, batch: Any, outputs: Any) -> None:
    writer.add_text("train/first_record", str(batch[0][0].tolist()), module.global_step)


def _embedding(writer: Any, module: Any, batch: Any, outputs: Any) -> None:
    writer.add_embedding(batch[0], metadata=batch[1].tolist(), global_step=module.global_step)


def _training_records(writer: Any, module: Any, batch: Any, outputs: Any) -> None:
    x = module.trainer.train_dataloader.dataset.tensors[0][:8]  # a hook handed no batch reads the training set
    writer.add_histogram("train/records", x, module.global_step)


@pytest.mark.parametrize("hook, write, method", [
    ("on_train_start", _texts, "add_text"),
    ("on_train_batch_start", _texts, "add_text"),
    ("on_train_batch_end", _losses, "add_histogram"),
    ("on_train_batch_end", _embedding, "add_embedding"),
    ("on_after_backward", _training_records, "add_histogram"),
    ("on_train_epoch_end", _training_records, "add_histogram"),
])
def test_media_written_by_a_callbacks_training_hook_are_refused(tmp_path: Path, hook: str, write: Any, method: str):
    steps = 4 if hook == "on_train_epoch_end" else 3  # an epoch is 4 steps of 16
    with pytest.raises(PrivacyConfigurationError, match=rf"{method} was called in {hook}.*validation_step"):
        _fit(Classifier(), tmp_path, callbacks=[Writes(hook, write)], steps=steps)
    assert all(SummaryWriter.__dict__[name] is own for name, own in _OWN.items())


class OwnWriter(Classifier):
    """A SummaryWriter of the user's own, not the trainer's logger: the same door."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.writer = SummaryWriter(log_dir)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.writer.add_images("train/batch", batch[0][:4].view(-1, 1, 2, 2), self.global_step)
        return super().training_step(batch, batch_idx)


def test_a_summary_writer_of_the_users_own_is_refused_too(tmp_path: Path):
    with pytest.raises(PrivacyConfigurationError, match="add_images was called in training_step"):
        _fit(OwnWriter(str(tmp_path / "own")), tmp_path, logger=False)


class FakeRun:
    """A wandb-like experiment (duck typing): ``log(dict)`` and ``log_image``."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log(self, values: dict, step: Any = None) -> None:
        self.logged.append(values)

    def log_image(self, key: str, images: Any) -> None:
        self.logged.append({key: images})


class FakeLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self._run = FakeRun()

    @property
    def name(self) -> str:
        return "fake"

    @property
    def version(self) -> int:
        return 0

    @property
    def experiment(self) -> FakeRun:
        return self._run

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: Any = None) -> None:
        self._run.log(dict(metrics), step)


class LogsToRun(Classifier):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        run = self.logger.experiment
        if self.what == "image":
            run.log_image("train/batch", [batch[0][:2]])
        elif self.what == "table":
            run.log({"train/inputs": batch[0].detach(), "lr": 0.1})
        elif self.what == "rates":  # numbers, one per parameter group (qa11 b4: refused before)
            run.log({"train/loss": loss.detach(), "lrs": [g["lr"] for g in self.trainer.optimizers[0].param_groups]})
        else:  # a scalar of the batch: a report, as self.log's
            run.log({"train/loss": loss.detach(), "lr": 0.1})
        return loss


@pytest.mark.parametrize("what, refused", [("image", "FakeRun.log_image"), ("table", "'train/inputs'"),
                                            ("scalar", None), ("rates", None)])
def test_a_duck_typed_loggers_media_are_refused_and_its_scalars_train(tmp_path: Path, what: str, refused: Any):
    logger = FakeLogger()
    if refused is None:
        _fit(LogsToRun(what), tmp_path, logger=logger)
        assert any("train/loss" in entry for entry in logger.experiment.logged)
    else:
        with pytest.raises(PrivacyConfigurationError, match=refused):
            _fit(LogsToRun(what), tmp_path, logger=logger)
    assert "log" not in vars(FakeRun) or vars(FakeRun)["log"].__name__ == "log"  # restored


class HeldOutImagesAndReports(Classifier):
    """Neighbours that train: the graph at fit start from a public example, the loss by self.log and add_scalar,
    the released weights' histogram and first-layer filters as an image, validation's images of held-out data."""

    def on_fit_start(self) -> None:
        self.logger.experiment.add_graph(self, torch.zeros(1, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.logger.experiment.add_scalar("train/loss_direct", loss.detach(), self.global_step)
        return loss

    def on_train_epoch_end(self) -> None:
        writer = self.logger.experiment
        for name, p in self.named_parameters():
            writer.add_histogram(f"weights/{name}", p, self.global_step)
        writer.add_image("weights/first_layer", self.net[0].weight.detach().cpu(), self.global_step,
                         dataformats="HW")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))
        self.logger.experiment.add_images("val/batch", x[:4].view(-1, 1, 2, 2), self.global_step)
        self.logger.experiment.add_histogram("val/logits", self(x).detach(), self.global_step)


def _held_out_images(writer: Any, module: Any, batch: Any, outputs: Any) -> None:
    writer.add_images("val/samples", torch.rand(4, 1, 2, 2), module.global_step)


def test_held_out_media_the_graph_scalars_and_released_weights_train(tmp_path: Path):
    trainer = quiet_trainer(strategy=strategy(), max_steps=5, logger=TensorBoardLogger(tmp_path),
                            callbacks=[LearningRateMonitor(), Writes("on_validation_epoch_end", _held_out_images)],
                            check_val_every_n_epoch=1, num_sanity_val_steps=1, log_every_n_steps=1)
    trainer.fit(HeldOutImagesAndReports(), loader(), loader(32))
    tags = _tags(tmp_path)
    assert {"val/batch", "val/samples", "weights/first_layer"} <= tags["images"]
    assert {"val/logits", "weights/net.0.weight"} <= tags["histograms"]
    assert {"train_loss", "train/loss_direct", "lr-SGD"} <= tags["scalars"]
    assert tags.get("graph") == {"graph"}


class AdamClassifier(Classifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("diagnostics", [None, "non_private"])
def test_the_second_moment_monitors_histograms_keep_working(tmp_path: Path, diagnostics: Any):
    monitor = SecondMomentMonitor(every_n_steps=1, **({"diagnostics": diagnostics} if diagnostics else {}))
    _fit(AdamClassifier(), tmp_path, steps=3, callbacks=[monitor])
    assert _tags(tmp_path).get("histograms")  # v̂ (and the opt-in diagnostics) written from on_train_batch_end


def test_outside_a_fit_the_writer_is_as_it_was(tmp_path: Path):
    _fit(HeldOutImagesAndReports(), tmp_path, steps=2)
    writer = SummaryWriter(str(tmp_path / "after"))
    writer.add_images("after/batch", torch.rand(2, 1, 2, 2), 0)  # a report after the fit: no fit watches it
    writer.close()
    assert all(SummaryWriter.__dict__[name] is own for name, own in _OWN.items())


class LogsRecords(Classifier):
    """A histogram of the first layer's outputs on the training set's first batch, read at epoch end."""

    def on_train_epoch_end(self) -> None:
        _training_records(self.logger.experiment, self, None, None)


def test_a_method_declared_public_writes_and_the_refusal_names_the_declaration(tmp_path: Path):
    with pytest.raises(PrivacyConfigurationError, match=r"public_state=\['logger\.add_histogram'\]"):
        _fit(LogsRecords(), tmp_path, steps=4)
    _fit(LogsRecords(), tmp_path, steps=4, strategy=strategy(public_state=["logger.add_histogram"]))
    assert "train/records" in _tags(tmp_path).get("histograms", set())  # the user's declaration: written


class _Histogram:
    """A wandb-like media object holding a tensor of its own (a copy of the weights)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values.detach().clone()


def test_digest_of_an_object_holding_a_tensor_is_its_contents_not_its_address():
    from lightning_dp.validators.logger_outputs import digest

    weights = torch.randn(64, 64)
    kept = [_Histogram(weights) for _ in range(4)]  # alive together: their storages have four addresses
    assert len({digest([h]) for h in kept}) == 1
    assert digest([_Histogram(weights)]) != digest([_Histogram(-weights)])
    assert digest([_Histogram(weights[:1])]) != digest([_Histogram(weights[:1].double())])
