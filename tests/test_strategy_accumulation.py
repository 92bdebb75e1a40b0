"""``Trainer(accumulate_grad_batches=k)`` under the private strategy (lightning_dp/_accumulation.py): one private step
draws k × the loader's batch_size, differentiates it in physical batches of the loader's batch_size, clips every
example once and adds the noise once; Lightning's own accumulation is off for the fit and given back after it."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError

N, B, K = 256, 8, 4


class Sizes(pl.LightningModule):
    """A linear classifier noting the size of every batch its training_step sees and the optimizer steps taken."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(len(x))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=B, shuffle=True)


def _fit(strategy: DPStrategy, **trainer_kwargs) -> tuple[pl.Trainer, Sizes]:
    model = Sizes()
    trainer = quiet_trainer(strategy=strategy, **trainer_kwargs)
    trainer.fit(model, _loader())
    return trainer, model


def test_accumulation_is_one_private_step_over_k_loader_batches(console_lines):
    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0, sampler_seed=0, public_state=["seen"])
    trainer, model = _fit(strategy, max_epochs=1, accumulate_grad_batches=K)
    assert strategy.expected_batch_size == K * B and strategy.sample_rate == pytest.approx(K * B / N)
    assert strategy.steps_per_epoch == N // (K * B)
    assert strategy.ledger.steps == trainer.global_step == N // (K * B)  # one release per optimizer step
    assert strategy.last_release.noise_std == pytest.approx(2.0 * 1.0 / (K * B))  # σC once, over the logical batch
    assert model.seen and max(model.seen) <= B  # physical batches of the loader's batch_size
    assert sum(model.seen) > 2 * B * strategy.ledger.steps  # more than the loader's batch per step: k of them
    assert trainer.accumulate_grad_batches == K and strategy.max_physical_batch_size is None  # given back
    assert any("accumulate_grad_batches=4" in r.getMessage() for r in console_lines.records)


def test_a_given_physical_batch_size_is_kept():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, max_physical_batch_size=3,
                          public_state=["seen"])
    _, model = _fit(strategy, max_steps=2, accumulate_grad_batches=K)
    assert max(model.seen) <= 3 and strategy.max_physical_batch_size == 3


def test_a_second_fit_adopts_it_again():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, public_state=["seen"])
    model, trainer = Sizes(), quiet_trainer(strategy=strategy, max_steps=2, accumulate_grad_batches=K)
    trainer.fit(model, _loader())
    trainer.fit_loop.epoch_loop.max_steps = 4  # the same Trainer fits on: 2 more releases
    trainer.fit(model, _loader())
    assert strategy.ledger.steps == 4 and strategy.expected_batch_size == K * B
    assert trainer.accumulate_grad_batches == K and max(model.seen) <= B


def test_fixed_shape_batches_with_accumulation_are_refused():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, fixed_batch_size=16)
    with pytest.raises(PrivacyConfigurationError, match=r"accumulate_grad_batches=4.*fixed_batch_size"):
        _fit(strategy, max_steps=1, accumulate_grad_batches=K)


def _scheduled(scheduling: dict[int, int], **trainer_kwargs) -> tuple[pl.Trainer, DPStrategy, Sizes]:
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0, sampler_seed=0, public_state=["seen"])
    trainer, model = _fit(strategy, callbacks=[GradientAccumulationScheduler(scheduling)], **trainer_kwargs)
    return trainer, strategy, model


def test_a_constant_accumulation_scheduler_is_planned_like_the_trainer_setting():
    """zoo28 l03: GradientAccumulationScheduler({0: K}) is Trainer(accumulate_grad_batches=K): planned at the setup
    (q = KB/N, one release per K loader batches), and Lightning's own accumulation stays off in every epoch although
    the scheduler sets K again at each epoch's start."""
    trainer, strategy, model = _scheduled({0: K, 1: K}, max_epochs=2)
    assert strategy.expected_batch_size == K * B and strategy.sample_rate == pytest.approx(K * B / N)
    assert strategy.ledger.steps == trainer.global_step == 2 * (N // (K * B))
    assert strategy.last_release.noise_std == pytest.approx(2.0 * 1.0 / (K * B))
    assert max(model.seen) <= B and trainer.accumulate_grad_batches == 1  # the Trainer's own, given back


@pytest.mark.parametrize("scheduling", [{0: 2, 1: K}, {0: 1, 1: 2}])
def test_a_scheduler_that_changes_the_value_is_refused_before_it_steers_a_release(scheduling):
    """Not planned from: refused before the first release it would steer (that of the first epoch it sets k > 1)."""
    model = Sizes()
    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0, sampler_seed=0, public_state=["seen"])
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    trainer = quiet_trainer(strategy=strategy, max_epochs=2, callbacks=[GradientAccumulationScheduler(scheduling)])
    with pytest.raises(PrivacyConfigurationError, match=r"was set during the fit \(a GradientAccumulationScheduler "
                                                        r"that changes it\)"):
        trainer.fit(model, _loader())
    assert strategy.ledger.steps == (0 if scheduling[0] > 1 else N // B)


def test_a_change_the_fit_never_reaches_is_planned_like_a_constant():
    """zoo29 a06: {0: K, 5: 2} with max_epochs=2 sets K in every epoch the fit runs (the change at epoch 5 is never
    reached): planned from like {0: K}; unbounded epochs (max_epochs=-1, max_steps) would reach it: refused."""
    trainer, strategy, model = _scheduled({0: K, 5: 2}, max_epochs=2)
    assert strategy.expected_batch_size == K * B
    assert strategy.ledger.steps == trainer.global_step == 2 * (N // (K * B))
    with pytest.raises(PrivacyConfigurationError, match=r"GradientAccumulationScheduler that changes it"):
        _scheduled({0: K, 1: 2}, max_epochs=-1, max_steps=3 * (N // (K * B)))


def test_weight_averagings_batchnorm_pass_is_refused_by_its_name():
    """zoo28 b06: StochasticWeightAveraging over a model with a (frozen) BatchNorm runs an extra epoch that only
    recomputes the running statistics on the training batches (accumulate_grad_batches = the epoch's length): refused,
    and the refusal says so rather than naming a scheduler."""
    from pytorch_lightning.callbacks import StochasticWeightAveraging

    class FrozenNorm(Sizes):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(4).eval()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(self.norm(x)), y)

    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0, sampler_seed=0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2,
                            callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)StochasticWeightAveraging's BatchNorm pass cannot run "
                                                        r"privately.*nn.GroupNorm.*update_bn on a public loader"):
        trainer.fit(FrozenNorm(), _loader())
    assert strategy.ledger.steps == 2 * (N // B)
