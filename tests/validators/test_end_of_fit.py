"""The end of a private fit is judged after the user's ``on_fit_end`` and ``teardown`` have run
(``validators/end_of_fit.EndOfFit.judge``, rule 3 of docs/release_boundary.md): a statistic of the training set
written then (class means for Mahalanobis OOD scoring, a nearest-class-mean head) is refused, and what was written is
put back, so the module returned does not hold it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


def _class_means(trainer: pl.Trainer, module: pl.LightningModule) -> torch.Tensor:
    x, y = trainer.train_dataloader.dataset.tensors
    with torch.no_grad():
        h = module.net[:2](x)
        return torch.stack([h[y == c].mean(0) for c in range(2)])


class Prototypes(Classifier):
    """Writes the training features' class means into a buffer in one of the hooks that end a fit."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook
        self.register_buffer("class_means", torch.zeros(2, 8))

    def _fit_means(self) -> None:
        self.class_means.copy_(_class_means(self.trainer, self))

    def on_train_end(self) -> None:
        if self.hook == "on_train_end":
            self._fit_means()

    def on_fit_end(self) -> None:
        if self.hook == "on_fit_end":
            self._fit_means()

    def teardown(self, stage: str) -> None:
        if self.hook == "teardown":
            self._fit_means()


def _fit(model: pl.LightningModule, callbacks: list | None = None, steps: int = 3, **kwargs) -> None:
    quiet_trainer(strategy=strategy(**kwargs), max_steps=steps, callbacks=callbacks or []).fit(model, loader(64))


@pytest.mark.parametrize("hook", ["on_train_end", "on_fit_end", "teardown"])
def test_class_means_written_when_the_fit_ends_are_refused_and_put_back(hook: str) -> None:
    model = Prototypes(hook)
    with pytest.raises(PrivacyConfigurationError, match="class_means") as caught:
        _fit(model)
    assert "put back" in str(caught.value)
    assert torch.equal(model.class_means, torch.zeros(2, 8))  # the module returned does not hold the statistic
    assert "teardown" not in vars(model)  # the end's wrapper is gone


class OODStats(pl.Callback):
    def __init__(self, hook: str) -> None:
        self.hook, self.means = hook, None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook == "module":
            pl_module.ood_means = _class_means(trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.hook == "callback":
            self.means = _class_means(trainer, pl_module)


@pytest.mark.parametrize("where", ["module", "callback"])
def test_a_callback_writing_a_statistic_at_the_end_is_refused(where: str) -> None:
    model, stats = Classifier(), OODStats(where)
    with pytest.raises(PrivacyConfigurationError, match="after training ended"):
        _fit(model, [stats])
    assert not hasattr(model, "ood_means") and stats.means is None


def test_an_end_hook_that_writes_nothing_trains_and_declared_state_is_allowed() -> None:
    class Reports(Classifier):
        def on_fit_end(self) -> None:
            self.final_norm = float(self.net[0].weight.norm())  # declared public below

        def teardown(self, stage: str) -> None:
            torch.save(self.net.state_dict(), str(self.path))  # a file: nothing kept

    model = Reports()
    model.path = Path("/dev/null")
    _fit(model, public_state=["final_norm"])
    assert isinstance(model.final_norm, float) and "teardown" not in vars(model)


def test_a_second_fit_after_a_failed_on_fit_end_is_not_wrapped_twice() -> None:
    class Fails(Classifier):
        calls = 0

        def on_fit_end(self) -> None:
            type(self).calls += 1
            if type(self).calls == 1:
                raise RuntimeError("boom")

    model = Fails()
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model)
    assert "teardown" not in vars(model)
    _fit(model)
    assert "teardown" not in vars(model)


def test_end_hooks_that_keep_what_is_not_the_datas_train() -> None:
    class Tidy(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.outputs: list = [1.0, 2.0]
            self.fits = 0

        def on_fit_end(self) -> None:
            self.fits += 1  # a counter: alike on the exchanged data
            self.finished = True

        def teardown(self, stage: str) -> None:
            self.outputs.clear()  # freeing what the epochs kept

    model = Tidy()
    _fit(model)
    assert model.fits == 1 and model.finished and model.outputs == []


class KeepsFinalLoss(Classifier):
    """Logs its training loss; when the fit ends copies the last logged value, or the epoch count, into its
    hyper-parameters (saved under `hyper_parameters` by every later checkpoint: zoo23 d1)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def on_fit_end(self) -> None:
        self.hparams["final"] = (float(self.trainer.logged_metrics["train_loss"]) if self.what == "loss"
                                 else int(self.current_epoch))


@pytest.mark.parametrize("what", ["loss", "epoch"])
def test_a_logged_training_value_kept_when_the_fit_ends_is_refused_and_a_count_trains(what: str) -> None:
    model = KeepsFinalLoss(what)
    if what == "loss":
        with pytest.raises(PrivacyConfigurationError, match="_hparams"):
            _fit(model)
        assert "final" not in model.hparams  # put back
    else:
        _fit(model)
        assert model.hparams["final"] == model.current_epoch
