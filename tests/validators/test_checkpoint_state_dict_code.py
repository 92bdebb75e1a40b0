"""The code the model's ``state_dict()`` runs while a checkpoint is built, judged as the checkpoint hooks are
(validators/checkpoint_replays.py): a state dict hook of a module (zoo33 L46), a ``state_dict`` the user's module
overrides and a ``get_extra_state`` run again with the training data's copies exchanged; an entry they set apart is
refused before the file is written — for ``ModelCheckpoint``, a ``trainer.save_checkpoint`` in a hook and the end of
the fit's last checkpoint alike. A hook that renames keys or adds a version number, or a norm of the weights, trains."""

from __future__ import annotations

import functools

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.checkpoint_replays import state_dict_code_of_users  # noqa: E402


def _training_mean(module: nn.Module) -> torch.Tensor | None:
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.train_dataloader is None:
        return None
    return trainer.train_dataloader.dataset.tensors[0].mean(0)


class MeanByHook(Classifier):
    """L46: ``_register_state_dict_hook`` adding the training set's feature mean to every state dict."""

    def __init__(self) -> None:
        super().__init__()
        self._register_state_dict_hook(MeanByHook._add)

    @staticmethod
    def _add(module, state, prefix, local_metadata):
        mean = _training_mean(module)
        if mean is not None:
            state[prefix + "feature_mean"] = mean
        return state


class MeanBySubmodulesPostHook(Classifier):
    """A submodule's public ``register_state_dict_post_hook`` writing the mean under its prefix."""

    def __init__(self) -> None:
        super().__init__()
        owner = [self]
        self.net[0].register_state_dict_post_hook(
            lambda m, state, prefix, meta: state.__setitem__(prefix + "mu", _training_mean(owner[0])))


class MeanByOverride(Classifier):
    """A ``state_dict`` of the user's own adding the mean."""

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        mean = _training_mean(self)
        if mean is not None:
            state["mu"] = mean
        return state


class _Extra(nn.Module):
    def __init__(self, owner: list) -> None:
        super().__init__()
        self.owner = owner

    def get_extra_state(self):
        mean = _training_mean(self.owner[0])
        return {} if mean is None else {"mu": mean}

    def set_extra_state(self, state) -> None:
        pass


class MeanByExtraState(Classifier):
    """A submodule's ``get_extra_state`` returning the mean (saved under ``stats._extra_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = _Extra([self])


class SavedAtTheEnd(MeanByHook):
    """The checkpoint written by the user's ``trainer.save_checkpoint`` in ``on_train_end``."""

    def on_train_end(self) -> None:
        self.trainer.save_checkpoint(self.target)


def _fit(model, path: Path, **checkpoint_kwargs) -> list[str]:
    callbacks = [ModelCheckpoint(dirpath=path, **checkpoint_kwargs)] if checkpoint_kwargs else []
    quiet_trainer(strategy=strategy(), max_epochs=2, enable_checkpointing=bool(callbacks),
                  callbacks=callbacks).fit(model, loader(64))
    return sorted(os.listdir(path))


@pytest.mark.parametrize("model, key", [(MeanByHook, "state_dict.feature_mean"),
                                        (MeanBySubmodulesPostHook, "state_dict.net.0.mu"),
                                        (MeanByOverride, "state_dict.mu"),
                                        (MeanByExtraState, "state_dict.stats._extra_state.mu")])
def test_a_training_set_statistic_built_into_the_state_dict_is_refused(model, key, tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigurationError, match=key.replace(".", r"\.")):
        _fit(model(), tmp_path, every_n_epochs=1)
    assert not os.listdir(tmp_path)  # nothing written


def test_the_last_checkpoint_and_one_saved_in_a_hook_are_judged_too(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigurationError, match="feature_mean"):
        _fit(MeanByHook(), tmp_path, every_n_epochs=0, save_last=True)  # only the end of the fit's "last" checkpoint
    assert not os.listdir(tmp_path)
    model = SavedAtTheEnd()
    model.target = str(tmp_path / "end.ckpt")
    with pytest.raises(PrivacyConfigurationError, match="feature_mean"):
        _fit(model, tmp_path)
    assert not os.listdir(tmp_path)


class Renamed(Classifier):
    """Safe twin: a hook renaming keys and adding a format version and the first layer's norm (released weights)."""

    def __init__(self) -> None:
        super().__init__()
        self._register_state_dict_hook(Renamed._rename)
        self.net[0].register_state_dict_post_hook(
            lambda m, state, prefix, meta: state.__setitem__(prefix + "norm", m.weight.detach().norm()))

    @staticmethod
    def _rename(module, state, prefix, local_metadata):
        for key in [k for k in state if k.startswith(prefix + "net.2.")]:
            state[key.replace("net.2.", "head.", 1)] = state.pop(key)
        state[prefix + "format_version"] = torch.tensor(3)
        return state


def test_a_hook_renaming_keys_or_adding_a_version_trains(tmp_path: Path) -> None:
    files = _fit(Renamed(), tmp_path, every_n_epochs=1)
    state = torch.load(tmp_path / files[0], weights_only=False)["state_dict"]
    assert {"head.weight", "format_version", "net.0.norm"} <= set(state)


def test_only_the_users_code_is_counted() -> None:
    assert not state_dict_code_of_users(Classifier())
    assert not state_dict_code_of_users(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert state_dict_code_of_users(MeanByHook()) and state_dict_code_of_users(MeanByExtraState())
    assert state_dict_code_of_users(MeanByOverride()) and state_dict_code_of_users(MeanBySubmodulesPostHook())


class MeanInOptimizerState(Classifier):
    """zoo34 L40: a state dict post-hook on the optimizer adds the training set's mean to the optimizer's state."""

    def __init__(self, added: str = "mean") -> None:
        super().__init__()
        self.added = added

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        module = self

        def post(optimizer, state):
            mean = _training_mean(module)
            if mean is not None:
                state["feature_mean" if module.added == "mean" else "format"] = \
                    mean if module.added == "mean" else 2  # (the safe twin: a version number)
            return state
        opt.register_state_dict_post_hook(post)
        return opt


class RateInSchedulerState(Classifier):
    """zoo34 L41: a scheduler whose own state_dict adds the training labels' rate."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        module = self

        class Warm(torch.optim.lr_scheduler.LambdaLR):
            def state_dict(self):
                state = super().state_dict()
                trainer = getattr(module, "_trainer", None)
                if trainer is not None and trainer.train_dataloader is not None:
                    state["positive_rate"] = float(trainer.train_dataloader.dataset.tensors[1].float().mean())
                return state
        constant = functools.partial(pow, 1.0)  # (a library's function: the schedule's update is not run again)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": Warm(opt, constant), "interval": "step"}}


@pytest.mark.parametrize("model, key", [(MeanInOptimizerState, r"optimizer_states\[0\]\.feature_mean"),
                                        # (or, first, the scheduler configure_optimizers builds again on the exchanged
                                        # data in the replays of the hooks that see no batch: its state read it)
                                        (RateInSchedulerState, r"lr_schedulers\[0\]\.positive_rate|"
                                                               r"configured scheduler 0 positive_rate")])
def test_a_training_set_statistic_in_the_optimizers_or_schedulers_state_dict_is_refused(model, key,
                                                                                       tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigurationError, match=key):
        _fit(model(), tmp_path, every_n_epochs=1)
    assert not os.listdir(tmp_path)


def test_an_optimizer_state_dict_hook_adding_a_version_trains(tmp_path: Path) -> None:
    assert _fit(MeanInOptimizerState(added="version"), tmp_path, every_n_epochs=1)
