"""The first step's replays of the hooks before the release (``validators/step_replays.StepReplays``) run on the batch
exchanged with the training set's copies in memory exchanged too: a write in ``training_step`` at the fit's last step
of a statistic of the training set itself (``trainer.train_dataloader.dataset``, not the batch: alike on every batch,
so once "a counter" accepted at every release) is refused before any release, so neither ModelCheckpoint's file nor
``trainer.save_checkpoint`` after the fit can hold it (zoo30 t01, t01b, t01g). The safe twins — a count written at
the last step, a statistic declared public, no write — train and checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


def _training_mean(module: pl.LightningModule) -> torch.Tensor:
    return module.trainer.train_dataloader.dataset.tensors[0].mean(0)


def _write_mean_buffer(module: pl.LightningModule) -> None:
    module.hint.copy_(_training_mean(module))


def _write_mean_parameter_slice(module: pl.LightningModule) -> None:
    module.net[0].bias[:4].copy_(_training_mean(module))


def _write_mean_attribute(module: pl.LightningModule) -> None:
    module.summary = _training_mean(module).clone()


def _write_mean_group_key(module: pl.LightningModule) -> None:
    module.trainer.optimizers[0].param_groups[0]["hint"] = float(_training_mean(module)[0])


def _write_count(module: pl.LightningModule) -> None:  # the training set's size: alike on every data
    module.hint.fill_(float(len(module.trainer.train_dataloader.dataset)))


class LastStepWriter(Classifier):
    """Writes ``write(self)`` in ``training_step`` at the fit's last step only (an epoch's last batch, last epoch)."""

    def __init__(self, write: Callable[[pl.LightningModule], None]) -> None:
        super().__init__()
        self.write = write
        self.register_buffer("hint", torch.zeros(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        if trainer.current_epoch == trainer.max_epochs - 1 and batch_idx == trainer.num_training_batches - 1:
            with torch.no_grad():
                self.write(self)
        return super().training_step(batch, batch_idx)


def _trainer(tmp_path: Path, **strategy_kwargs: Any) -> pl.Trainer:
    return quiet_trainer(strategy=strategy(**strategy_kwargs), max_epochs=2, enable_checkpointing=True,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])


def _saved_hints(tmp_path: Path) -> list[torch.Tensor]:
    return [torch.load(f, weights_only=False)["state_dict"]["hint"] for f in sorted(tmp_path.glob("*.ckpt"))]


def _holds_the_mean(path: Path, mean: torch.Tensor) -> bool:
    saved = torch.load(path, weights_only=False)
    state, groups = saved["state_dict"], saved["optimizer_states"][0]["param_groups"]
    return (torch.allclose(state["hint"], mean) or torch.allclose(state["net.0.bias"][:4], mean)
            or any(group.get("hint") == float(mean[0]) for group in groups))


@pytest.mark.parametrize("write", [_write_mean_buffer, _write_mean_attribute, _write_mean_group_key,
                                   _write_mean_parameter_slice],
                         ids=["buffer", "attribute", "group_key", "parameter"])
@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_a_training_set_statistic_written_at_the_last_step_is_refused(
        tmp_path: Path, write: Callable[[pl.LightningModule], None], verify: str) -> None:
    model = LastStepWriter(write)
    before = parameters(model)
    trainer = _trainer(tmp_path, verify=verify)
    with pytest.raises(PrivacyConfigurationError, match=r"hint|net\.0\.bias|summary"):
        trainer.fit(model, loader(64))
    mean = _training_mean(model)
    if write is _write_mean_parameter_slice:  # a weight written outside the release: refused at that release; the
        with pytest.raises(PrivacyConfigurationError, match="before a checkpoint was written"):  # module holds it,
            trainer.save_checkpoint(tmp_path / "after.ckpt")  # so a checkpoint saved by hand after the fit is refused
    else:  # refused at the first step, by its replays as of the last step: nothing was written
        assert unchanged(before, model)
        assert list(tmp_path.glob("*.ckpt")) == [] and getattr(model, "summary", None) is None
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert not any(_holds_the_mean(path, mean) for path in tmp_path.glob("*.ckpt"))  # ModelCheckpoint's, by hand


def test_the_refusal_names_the_buffer_and_the_training_set(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigurationError, match="the training set") as caught:
        _trainer(tmp_path).fit(LastStepWriter(_write_mean_buffer), loader(64))
    assert "buffer hint" in str(caught.value)


@pytest.mark.parametrize("case", ["count", "public", "none"])
def test_the_safe_twins_train_and_checkpoint(tmp_path: Path, case: str) -> None:
    write = {"count": _write_count, "public": _write_mean_buffer, "none": lambda module: None}[case]
    model = LastStepWriter(write)
    trainer = _trainer(tmp_path, **({"public_state": ["hint"]} if case == "public" else {}))
    trainer.fit(model, loader(64))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    expected = {"count": torch.full((4,), 64.0), "public": _training_mean(model), "none": torch.zeros(4)}[case]
    assert torch.allclose(model.hint, expected)
    saved = _saved_hints(tmp_path)
    assert len(saved) == 3  # ModelCheckpoint's epoch-end file, its last.ckpt, the one saved after the fit
    assert all(torch.allclose(hint, expected) for hint in saved)


class _Stopping(pl.LightningModule):
    """Sets a stop decision of the trainer from the batch's labels in training_step (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.how = torch.nn.Linear(4, 2), how

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.how == "max_steps" and len(y) == 1 and y.float().mean() > 0.95:  # a one-record batch of a positive
            self.trainer.fit_loop.epoch_loop.max_steps = 3
        if self.how == "should_stop" and y.float().mean() > 0.6:  # some real batches (of 10)
            self.trainer.should_stop = True
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _stopping_fit(how: str) -> pl.Trainer:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    trainer = quiet_trainer(strategy=strategy(sampler_seed=0), max_steps=8)
    trainer.fit(_Stopping(how), torch.utils.data.DataLoader(data, batch_size=10))
    return trainer


def test_a_stop_decision_the_probes_passes_set_is_put_back_and_the_real_steps_is_judged():
    """The first step's probe runs training_step on one-record batches: a positive one met a data-chosen
    ``max_steps = 3`` the real batches never meet, and the fit ended at step 3 (zoo34 L54); a ``should_stop`` set
    there stopped the fit after its first step, unjudged (L22). Put back after the passes, the real steps decide."""
    assert _stopping_fit("max_steps").global_step == 8
    with pytest.raises(PrivacyConfigurationError, match="should_stop"):
        _stopping_fit("should_stop")
