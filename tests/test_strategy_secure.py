"""DPStrategy(secure_mode=True): the update's noise is still N(0, (σC/B)²) per coordinate."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from scipy import stats
from test_strategy import RecordUpdates, ZeroGradModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.privacy.csprng import SecureGaussianNoise


def test_secure_update_noise_std_is_sigma_c_over_expected_b():
    sigma, C, batch_size = 0.8, 2.0, 20
    recorder = RecordUpdates()
    strategy = DPStrategy(noise_multiplier=sigma, max_grad_norm=C, secure_mode=True, public_state=["RecordUpdates"])
    trainer = quiet_trainer(strategy=strategy, max_steps=3, callbacks=[recorder])
    trainer.fit(ZeroGradModule(), DataLoader(TensorDataset(torch.randn(400, 100)), batch_size=batch_size))
    assert isinstance(strategy.private_step.noise, SecureGaussianNoise) and strategy.private_step._batches.inner.secure
    updates = torch.cat(recorder.updates).double()
    ratio = float(updates.pow(2).mean()) / (sigma * C / batch_size) ** 2
    lo, hi = stats.chi2.ppf([5e-8, 1 - 5e-8], updates.numel()) / updates.numel()
    assert lo < ratio < hi
    for wrong in (0.9, 1.1):
        assert not lo < ratio / wrong ** 2 < hi


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampler_seed=0), "sampler_seed"),
    (dict(noise="banded", bands=2), "gaussian"),
])
def test_secure_mode_refuses_what_it_cannot_make_secure(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPStrategy(noise_multiplier=1.0, secure_mode=True, **kwargs)


def test_secure_mode_trains_a_user_module():
    strategy = DPStrategy(noise_multiplier=1.0, secure_mode=True)
    quiet_trainer(strategy=strategy, max_epochs=1).fit(TinyClassifier(), make_loader(n=100, batch_size=10))
    assert strategy.ledger.steps == 10
