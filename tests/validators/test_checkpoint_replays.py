"""A checkpoint carries only what the release boundary verified (validators/checkpoint_replays.py, rule 3 of
docs/release_boundary.md): what the user's ``on_save_checkpoint`` (module or callback), a callback's ``state_dict``
adds that differs when it is run again on the exchanged training data — class means and a covariance of the training
features for OOD scoring — is refused and the checkpoint not written; public things (an epoch count, a config string,
class names), ``ModelCheckpoint``, ``save_hyperparameters`` and the library's own callbacks are written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.callbacks import PrivacyBudget  # noqa: E402


def _features(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = trainer.train_dataloader.dataset.tensors
    with torch.no_grad():
        return module.net[:2](x), y


class OODInCheckpoint(Classifier):
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        h, y = _features(self.trainer, self)
        checkpoint["ood"] = {"means": torch.stack([h[y == c].mean(0) for c in range(2)]), "cov": torch.cov(h.T)}


class OODCallback(pl.Callback):
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        h, y = _features(trainer, pl_module)
        checkpoint["ood_means"] = torch.stack([h[y == c].mean(0) for c in range(2)])


class StatsState(pl.Callback):
    def state_dict(self) -> dict:
        h, _ = _features(self.trainer, self.module)
        return {"feature_mean": h.mean(0)}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer, self.module = trainer, pl_module


def _fit(model: pl.LightningModule, path: Path, callbacks: list | None = None, **kwargs) -> list[str]:
    checkpoints = ModelCheckpoint(dirpath=path, every_n_train_steps=2, save_last=True)
    quiet_trainer(strategy=strategy(**kwargs), max_steps=4, enable_checkpointing=True,
                  callbacks=[*(callbacks or []), checkpoints]).fit(model, loader(64))
    return sorted(os.listdir(path))


@pytest.mark.parametrize("case", ["module", "callback", "state_dict"])
def test_training_set_statistics_added_to_a_checkpoint_are_refused(case: str, tmp_path: Path) -> None:
    model = OODInCheckpoint() if case == "module" else Classifier()
    callbacks = {"module": [], "callback": [OODCallback()], "state_dict": [StatsState()]}[case]
    with pytest.raises(PrivacyConfigurationError, match="checkpoint entries from the training data"):
        _fit(model, tmp_path, callbacks)
    assert not os.listdir(tmp_path)  # nothing written


def test_a_statistic_declared_public_is_written(tmp_path: Path) -> None:
    files = _fit(OODInCheckpoint(), tmp_path, public_state=["ood"])
    assert files and "ood" in torch.load(tmp_path / files[0], weights_only=False)


class Resumable(Classifier):
    """H4: a statistic saved by on_save_checkpoint, read back by on_load_checkpoint into a buffer the forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[:2](x) - self.center)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["center"] = _features(self.trainer, self)[0].mean(0)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "center" in checkpoint:
            checkpoint["state_dict"]["center"] = checkpoint["center"]


def test_a_statistic_fed_back_on_resume_never_reaches_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigurationError, match="center"):
        _fit(Resumable(), tmp_path)
    assert not os.listdir(tmp_path)


class PublicThings(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 8, "name": "clf"})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["epochs_seen"] = self.current_epoch
        checkpoint["config"] = "tanh-8"
        checkpoint["classes"] = ["negative", "positive"]
        checkpoint["weight_norm"] = self.net[0].weight.detach().norm()  # from the released model

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.restored_classes = checkpoint["classes"]


class Counter(pl.Callback):
    def __init__(self) -> None:
        self.saves: list[int] = []

    def state_dict(self) -> dict:
        return {"run": "baseline"}

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.saves.append(trainer.global_step)
        checkpoint["saved_at_step"] = trainer.global_step


def test_public_checkpoint_keys_and_the_librarys_callbacks_are_written_and_resume(tmp_path: Path) -> None:
    counter = Counter()
    files = _fit(PublicThings(), tmp_path, [counter, PrivacyBudget(target_epsilon=100.0)],
                 public_state=["Counter.saves"])  # a list of steps (a write the boundary refuses unless declared)
    assert files and counter.saves == [2, 2, 4, 4]  # the real saves (a step and last.ckpt); no replay left one
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["classes"] == ["negative", "positive"] and saved["hyper_parameters"]["width"] == 8
    model = PublicThings()
    quiet_trainer(strategy=strategy(), max_steps=6).fit(model, loader(64), ckpt_path=str(tmp_path / "last.ckpt"))
    assert model.restored_classes == ["negative", "positive"]
