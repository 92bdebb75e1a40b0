"""run_audit end to end: a broken mechanism (no noise) is caught, the real one is not.

Tiny and fast: a linear classifier on a synthetic 4-class tabular set of 400 rows with
2,048 features (random ±1 canaries are nearly orthogonal to each other and to the data,
so without noise each included one is memorised), q ≈ 0.8, 20 steps, 200 canaries.
σ = 15 makes the accountant claim ε ≈ 1 at δ = 1e-5; m = 200 can certify up to ≈ 3.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.audit import AuditResult, load_config, run_audit
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism
from lightning_dp.strategy import DPStrategy


class ZeroNoise(NoiseMechanism):
    """A deliberately broken mechanism: the 'noise' is always zero."""

    def sample(self, like):
        return [torch.zeros_like(t) for t in like]


class Blobs(pl.LightningDataModule):
    num_classes = 4

    def __init__(self, n: int = 400, d: int = 2048, batch_size: int = 400) -> None:
        super().__init__()
        self.n, self.d, self.batch_size = n, d, batch_size

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        means = 0.3 * torch.randn(4, self.d, generator=g)
        y = torch.randint(0, 4, (self.n,), generator=g)
        self.ds = TensorDataset(means[y] + 0.3 * torch.randn(self.n, self.d, generator=g), y)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=True)


class Linear(pl.LightningModule):
    def __init__(self, d: int = 2048, lr: float = 20.0) -> None:
        super().__init__()
        self.net = nn.Linear(d, 4)
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _audit(kind: str, noise: NoiseMechanism) -> AuditResult:
    pl.seed_everything(0, verbose=False)
    return run_audit(
        model=Linear(), datamodule=Blobs(), canaries=200, kind=kind, max_epochs=20, seed=1, noise=noise,
        strategy_kwargs=dict(noise_multiplier=15.0, max_grad_norm=1.0, sampler_seed=0), delta=1e-5,
    )


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_audit_catches_a_mechanism_without_noise(kind):
    result = _audit(kind, ZeroNoise())
    assert 0.5 < result.claimed_epsilon < 1.5
    assert result.violated
    assert result.epsilon_lower_bound > result.claimed_epsilon + 0.5


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_audit_of_the_real_mechanism_stays_below_the_claim(kind):
    result = _audit(kind, GaussianNoise(seed=0))
    assert 0.5 < result.claimed_epsilon < 1.5
    assert not result.violated
    assert result.epsilon_lower_bound <= result.claimed_epsilon


def test_result_records_the_run():
    result = _audit("gradient", ZeroNoise())
    assert result.canaries == 200 and result.seed == 1 and result.kind == "gradient"
    assert result.included == int(torch.rand(200, generator=torch.Generator().manual_seed(1)).lt(0.5).sum())
    assert result.steps == 20 and result.noise_multiplier == 15.0 and result.max_grad_norm == 1.0
    assert result.sample_rate == pytest.approx(400 / (400 + result.included))
    assert result.correct <= result.guesses <= 200
    text = result.summary()
    assert f"{result.claimed_epsilon:.4f}" in text and f"{result.epsilon_lower_bound:.4f}" in text
    assert "VIOLATED" in text


def test_load_config_builds_the_objects():
    cfg = {
        "privacy_delta": 1e-6,
        "trainer": {"max_epochs": 3, "strategy": {"class_path": "lightning_dp.DPStrategy",
                                                   "init_args": {"target_epsilon": 2.0, "target_delta": 1e-5}}},
        "model": {"class_path": "lightning_dp.models.DigitsCNN", "init_args": {"channels": 4}},
        "data": {"class_path": "lightning_dp.data.DigitsDataModule", "init_args": {"batch_size": 32}},
    }
    model, dm, kwargs, epochs, delta = load_config(cfg)
    assert type(model).__name__ == "DigitsCNN" and dm.batch_size == 32
    assert kwargs == {"target_epsilon": 2.0, "target_delta": 1e-5} and epochs == 3 and delta == 1e-6
    DPStrategy(**kwargs)  # the kwargs are DPStrategy's


@pytest.mark.parametrize("bad", [
    {"model": {"class_path": "lightning_dp.models.DigitsCNN"}},
    {"model": {"class_path": "lightning_dp.models.DigitsCNN"},
     "data": {"class_path": "lightning_dp.data.DigitsDataModule"},
     "trainer": {"strategy": {"class_path": "pytorch_lightning.strategies.DDPStrategy"}}},
])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        load_config(bad)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        run_audit(model=Linear(), datamodule=Blobs(), strategy_kwargs={"noise_multiplier": 1.0}, kind="magic")


def test_each_trial_claims_its_own_epsilon_however_many_trials_ran_on_the_data():
    """Trials on one dataset are runs of the mechanism audited one at a time: the claimed ε is one trial's accountant
    ε (and its σ calibrated for one trial), not the data's record composed over the trials
    (accounting/data_ledgers.py), which would raise the claim with every trial and hide a broken mechanism."""
    from lightning_dp.accounting import epsilon

    class SetUpOnce(Blobs):  # the dataset built once and kept (the trials read the same tensors)
        def setup(self, stage=None):
            if not hasattr(self, "ds"):
                super().setup(stage)

    data = SetUpOnce(n=100, d=64, batch_size=100)
    budgets = [("gradient", dict(target_epsilon=2.0, target_delta=1e-5)), ("input", dict(noise_multiplier=3.0))]
    for kind, kwargs in budgets:
        results = [run_audit(model=Linear(d=64), datamodule=data, canaries=20, kind=kind, max_epochs=5, seed=trial,
                             noise=ZeroNoise(), delta=1e-5, num_classes=4,
                             strategy_kwargs=dict(kwargs, max_grad_norm=1.0, sampler_seed=0)) for trial in range(3)]
        assert [r.steps for r in results] == [5, 5, 5]  # the second trial was refused (its budget spent by the first)
        for r in results:
            one = epsilon(r.noise_multiplier, r.sample_rate, 5, 1e-5)
            assert r.claimed_epsilon == pytest.approx(one)  # was the trials' composition: 3.05, 4.4, 5.5
            assert one <= 2.0 if kind == "gradient" else r.noise_multiplier == 3.0
