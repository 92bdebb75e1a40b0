"""The Poisson samplers' settings are the mechanism's (privacy/min_sep_sampling.FrozenSampler): once built, only the
step counter moves. zoo16 smp1: a batch-end hook set the sampler's rate from the loss, the loader drew at q = 1 while
the ledger charged the plan's q."""

from __future__ import annotations

import copy
import pickle

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler
from lightning_dp.privacy.sampling import PoissonBatchSampler
from lightning_dp.privacy.user_sampling import UserPoissonBatchSampler


def _samplers():
    return [PoissonBatchSampler(100, 0.2, 5, seed=0), MinSepPoissonBatchSampler(100, 0.4, 6, bands=2, seed=0),
            UserPoissonBatchSampler([torch.tensor([i, i + 50]) for i in range(50)], 0.2, 5, seed=0)]


@pytest.mark.parametrize("name, value", [("sample_rate", 1.0), ("num_samples", 10), ("bands", 1),
                                         ("steps_per_epoch", 50), ("groups", ()), ("limit", 1), ("members", []),
                                         ("_generator", torch.Generator())])
def test_a_sampler_setting_set_after_it_was_built_is_refused(name, value):
    for sampler in _samplers():
        if not hasattr(sampler, name):
            continue
        before = getattr(sampler, name)
        with pytest.raises(PrivacyConfigurationError, match=f"sampler's '{name}' is the mechanism's"):
            setattr(sampler, name, value)
        assert getattr(sampler, name) is before


def test_the_step_counter_still_moves_and_the_samplers_copy_and_pickle():
    for sampler in _samplers():
        sampler.step = 3
        assert sampler.step == 3
        assert len(next(iter(sampler))) >= 0 and sampler.step == 4
        for clone in (copy.deepcopy(sampler), pickle.loads(pickle.dumps(sampler))):
            assert clone.step == 4
            with pytest.raises(PrivacyConfigurationError):
                clone.sample_rate = 1.0


class _RaiseTheRate(pl.Callback):
    """zoo16 smp1: 'draw more when the loss is high', on the sampler the strategy's loader holds."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.train_dataloader.batch_sampler.inner.sample_rate = min(1.0, 2.0 * float(outputs["loss"]))


def test_a_fit_whose_hook_sets_the_samplers_rate_from_the_loss_is_refused():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_steps=4, callbacks=[_RaiseTheRate()])
    with pytest.raises(PrivacyConfigurationError, match="sampler's 'sample_rate' is the mechanism's"):
        trainer.fit(TinyClassifier(), make_loader())
    assert strategy.ledger.steps <= 1  # refused at the first batch's end: nothing drawn at another rate
