"""Resuming never silently changes the privacy arguments (σ, C, target) of a run; a new target only when asked."""

from __future__ import annotations

import pytest
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import ledger_epsilon


@pytest.fixture
def checkpoint(tmp_path):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    trainer.fit(TinyClassifier(), make_loader(n=100, batch_size=10))
    return str(tmp_path / "last.ckpt")


def _resume(checkpoint, **kwargs):
    strategy = DPStrategy(**kwargs)
    quiet_trainer(strategy=strategy, max_epochs=2).fit(TinyClassifier(), make_loader(n=100, batch_size=10),
                                                       ckpt_path=checkpoint)
    return strategy


@pytest.mark.parametrize("kwargs,names", [
    (dict(noise_multiplier=2.0, max_grad_norm=1.0), "σ"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.5), "max_grad_norm"),
])
def test_a_changed_sigma_or_clip_norm_is_an_error_naming_both_values(checkpoint, kwargs, names):
    with pytest.raises(PrivacyConfigurationError, match=names) as err:
        _resume(checkpoint, **kwargs)
    assert "checkpoint 1.0" in str(err.value) and "resume_privacy='new'" in str(err.value)


def test_the_same_arguments_resume_quietly(checkpoint):
    strategy = _resume(checkpoint, noise_multiplier=1.0, max_grad_norm=1.0)
    assert strategy.ledger.steps == 20 and strategy.noise_multiplier == 1.0


def test_resume_privacy_new_applies_the_new_sigma_and_says_so(checkpoint):
    with pytest.warns(UserWarning, match="resume_privacy='new'"):
        strategy = _resume(checkpoint, noise_multiplier=2.0, max_grad_norm=1.0, resume_privacy="new")
    assert strategy.noise_multiplier == 2.0
    assert [e.noise_multiplier for e in strategy.ledger.entries] == [1.0, 2.0]  # both parts counted


@pytest.fixture
def target_checkpoint(tmp_path):
    strategy = DPStrategy(target_epsilon=3.0, target_delta=1e-5)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    trainer.fit(TinyClassifier(), make_loader(n=100, batch_size=10))
    return str(tmp_path / "last.ckpt")


def test_a_new_target_is_refused_by_default_naming_the_explicit_way(target_checkpoint):
    with pytest.raises(PrivacyConfigurationError, match="target_epsilon") as err:
        _resume(target_checkpoint, target_epsilon=5.0, target_delta=1e-5)
    assert "resume_privacy='new'" in str(err.value)


def test_a_raised_target_with_resume_privacy_new_is_a_ceiling_on_the_whole_ledger(target_checkpoint):
    """The explicit way to extend a finished run (issue 35): the checkpoint's releases count against the new target."""
    with pytest.warns(UserWarning, match="checkpoint's releases count against the new one"):
        strategy = _resume(target_checkpoint, target_epsilon=5.0, target_delta=1e-5, resume_privacy="new")
    assert strategy.ledger.steps == 20
    assert 0.99 * 5.0 < ledger_epsilon(strategy.ledger, 1e-5) <= 5.0
