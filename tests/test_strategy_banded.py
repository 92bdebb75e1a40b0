"""DPStrategy(noise="banded"): correlated DP-MF noise wired into sampling, the ledger and Φ_t."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import ledger_epsilon
from lightning_dp.accounting.banded import banded_epsilon
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise


class _Releases(Callback):
    def __init__(self):
        self.stds, self.batches = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.stds.append(trainer.strategy.last_release.noise_std)


def test_banded_run_samples_groups_charges_rounds_and_reports_phi_t():
    n, batch_size, bands, steps = 200, 10, 4, 10
    recorder = _Releases()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, noise="banded", bands=bands, sampler_seed=0,
                          public_state=["_Releases"])  # the test's observer of the batches
    quiet_trainer(strategy=strategy, max_steps=steps, callbacks=[recorder]).fit(TinyClassifier(), make_loader(n, batch_size=batch_size))
    q_g = bands * batch_size / n
    assert strategy.sample_rate == pytest.approx(q_g)
    assert strategy.ledger.steps == math.ceil(steps / bands)  # one sampled-Gaussian round per cycle
    assert ledger_epsilon(strategy.ledger, 1e-5) == pytest.approx(banded_epsilon(1.0, q_g, steps, bands, 1e-5))
    noise = strategy.private_step.noise
    assert isinstance(noise, BandedToeplitzNoise)
    for t, std in enumerate(recorder.stds):  # Φ_t = (σC/B)² · phi_factor(t)
        assert std**2 == pytest.approx((1.0 / batch_size) ** 2 * noise.phi_factor(t))
    assert recorder.stds[-1] > recorder.stds[0]


def test_banded_calibration_meets_the_target():
    strategy = DPStrategy(target_epsilon=2.0, target_delta=1e-5, max_grad_norm=1.0, noise="banded", bands=2)
    quiet_trainer(strategy=strategy, max_epochs=1).fit(TinyClassifier(), make_loader(200, batch_size=10))
    steps = strategy.steps_per_epoch
    eps = banded_epsilon(strategy.noise_multiplier, strategy.sample_rate, steps, 2, 1e-5)
    assert eps <= 2.0 and eps > 1.95


def test_banded_resume_continues_rounds(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=5)
    strategy = DPStrategy(noise_multiplier=1.0, noise="banded", bands=3)
    quiet_trainer(strategy=strategy, max_steps=5, enable_checkpointing=True, callbacks=[ckpt]).fit(
        TinyClassifier(), make_loader(120, batch_size=10)
    )
    assert strategy.ledger.steps == 2  # rounds opened at steps 0 and 3
    resumed = DPStrategy(noise_multiplier=1.0, noise="banded", bands=3)
    quiet_trainer(strategy=resumed, max_steps=11).fit(TinyClassifier(), make_loader(120, batch_size=10), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.ledger.steps == 4  # steps 0, 3, 6, 9
    assert resumed.private_step.noise.steps == 11  # 5 restored rows + 6 new: the stream continued from the checkpoint


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(bands=4), "noise='banded'"), (dict(noise="nope"), "noise must be"), (dict(noise="banded", bands=0), "band")],
)
def test_bad_noise_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPStrategy(noise_multiplier=1.0, **kwargs)


def test_banded_refuses_independent_moments_and_oversized_groups():
    from lightning_dp import AdamVariant

    class AdamModule(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, noise="banded", bands=2), max_steps=2,
                            callbacks=[AdamVariant("independent_moments")])
    with pytest.raises(PrivacyConfigurationError, match="independent_moments"):
        trainer.fit(AdamModule(), make_loader(100, batch_size=10))
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, noise="banded", bands=8), max_steps=2)
    with pytest.raises(PrivacyConfigurationError, match="bands"):
        trainer.fit(TinyClassifier(), make_loader(40, batch_size=10))


@pytest.mark.parametrize("rounds", [1, 3])
def test_privacy_budget_takes_every_step_of_the_last_affordable_cycle(rounds):
    from lightning_dp import PrivacyBudget
    from lightning_dp.accounting import epsilon

    n, batch_size, bands, delta = 200, 10, 4, 1e-5
    q_g = bands * batch_size / n  # each group holds n / b examples
    target = 0.5 * (epsilon(1.0, q_g, rounds, delta) + epsilon(1.0, q_g, rounds + 1, delta))
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, noise="banded", bands=bands, sampler_seed=0)
    budget = PrivacyBudget(target_epsilon=target, delta=delta)
    trainer = quiet_trainer(strategy=strategy, max_steps=100, callbacks=[budget])
    trainer.fit(TinyClassifier(), make_loader(n, batch_size=batch_size))
    assert trainer.global_step == rounds * bands  # not (rounds − 1)·b + 1: a cycle's later steps are free
    assert strategy.ledger.steps == rounds
    assert budget.epsilon <= target
