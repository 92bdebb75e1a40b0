"""AdamVariant swaps the user's optimizer for the DP variant inside a Lightning run."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from lightning_dp.callbacks.adam_variant import AdamVariant
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.optim import DPAdagrad, DPAdam, NotPrivateWarning
from lightning_dp.strategy import DPStrategy

VARIANTS = ["post_processing", "bias_corrected", "independent_moments", "scale_then_privatize", "noiseless"]


class AdamModule(TinyClassifier):
    """The user's module: two param groups, Adam/AdamW/Adagrad and a StepLR scheduler."""

    def __init__(self, kind: str = "adam", scheduler: bool = True) -> None:
        super().__init__()
        self.kind, self.with_scheduler = kind, scheduler

    def configure_optimizers(self):
        groups = [{"params": self.net[0].parameters(), "lr": 0.01},
                  {"params": self.net[2].parameters(), "lr": 0.003, "weight_decay": 0.1}]
        if self.kind == "adagrad":
            opt = torch.optim.Adagrad(groups, lr=0.05)
        else:
            opt = (torch.optim.AdamW if self.kind == "adamw" else torch.optim.Adam)(groups, betas=(0.8, 0.99))
        if not self.with_scheduler:
            return opt
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Probe(Callback):
    """Records, before every batch, which optimizer class the strategy holds."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.kinds.append(type(trainer.strategy.optimizers[0]).__name__)


def _fit(module, callbacks, steps=5, **kw):
    pl.seed_everything(0, verbose=False)
    loader = make_loader(n=64, batch_size=16)
    trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. torch's "optimizer.step() has been overridden"
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*train_dataloader.*")
        trainer.fit(module, loader)
    return trainer


@pytest.mark.parametrize("kind", ["adam", "adamw", "adagrad"])
@pytest.mark.parametrize("start_step", [0, 2])
def test_swap_keeps_groups_scheduler_state_and_trajectory(kind, start_step):
    """Without DPStrategy, post_processing is the user's optimizer: the trajectory must not change."""
    pl.seed_everything(0, verbose=False)
    plain = AdamModule(kind)
    init = {k: v.clone() for k, v in plain.state_dict().items()}
    plain_lrs = [g["lr"] for g in _fit(plain, []).strategy.optimizers[0].param_groups]
    swapped = AdamModule(kind)
    swapped.load_state_dict(init)
    probe = Probe()
    trainer = _fit(swapped, [AdamVariant("post_processing", start_step=start_step), probe])

    opt = trainer.strategy.optimizers[0]
    assert isinstance(opt, DPAdagrad if kind == "adagrad" else DPAdam)
    assert probe.kinds[:start_step] == [probe.kinds[0]] * start_step
    assert all(k == type(opt).__name__ for k in probe.kinds[start_step:])
    if start_step:
        assert probe.kinds[0].startswith(("Adam", "Adagrad")) and not probe.kinds[0].startswith("DP")
    assert trainer.strategy._lightning_optimizers[0]._optimizer is opt
    assert swapped.optimizers()._optimizer is opt
    scheduler = trainer.strategy.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is opt
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01 * 0.25, 0.003 * 0.25])  # 5 steps, StepLR(2)
    assert [g["lr"] for g in opt.param_groups] == plain_lrs
    assert opt.param_groups[1]["weight_decay"] == 0.1
    if kind != "adagrad":
        assert opt.param_groups[0]["betas"] == (0.8, 0.99)
        assert opt.param_groups[0]["decoupled_weight_decay"] is (kind == "adamw")
    assert all(int(s["step"]) == 5 for s in opt.state.values())
    for (name, a), b in zip(plain.state_dict().items(), swapped.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)


def test_refusals_come_before_training():
    with pytest.raises(ValueError, match="unknown DP optimizer variant"):
        AdamVariant("dp_sgd")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        AdamVariant("bias_corrected", eps_s=1e-3)

    class SGDModule(TinyClassifier):
        pass

    with pytest.raises(ValueError, match="torch.optim.Adam"):
        _fit(SGDModule(), [AdamVariant("post_processing")])
    with pytest.raises(ValueError, match="DPStrategy"):
        _fit(AdamModule(), [AdamVariant("bias_corrected")])


def _dp_trainer(steps, callbacks, **kw):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=kw.pop("per_sample", "opacus_hooks"),
                          noise=GaussianNoise(seed=0), sampler_seed=0,
                          public_state=["Probe"])  # the test's observer of the optimizer's kind
    return quiet_trainer(strategy=strategy, max_steps=steps, callbacks=callbacks, **kw)


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_runs_under_dp_strategy(variant, kind):
    pl.seed_everything(0, verbose=False)
    module = AdamModule(kind, scheduler=False)
    before = [p.detach().clone() for p in module.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _dp_trainer(3, [AdamVariant(variant)])
        trainer.fit(module, make_loader(n=64, batch_size=16))
    strategy = trainer.strategy
    opt = strategy.optimizers[0]
    assert opt.variant == variant
    assert strategy.ledger.steps == 3
    assert strategy.ledger.is_private is (variant != "noiseless")
    release = strategy.last_release
    assert (release.second_moment is not None) is (variant == "independent_moments")
    assert (release.scale is not None) is (variant == "scale_then_privatize")
    assert (release.clean_mean is not None) is (variant == "noiseless")
    assert release.noise_std == pytest.approx(
        (2**0.5 if variant == "independent_moments" else 1.0) * 1.0 * 1.0 / 16)
    assert all(int(s["step"]) == 3 for s in opt.state.values() if "step" in s)
    if variant == "bias_corrected":  # Φ̄ = (σC/B)² from the strategy's σ = 1, C = 1, B = 16
        phi = (1.0 * 1.0 / 16) ** 2
        for s in opt.state.values():
            phi_bar = s["phi"] / (1 - 0.99**3) if kind == "adam" else s["phi"] / 3
            assert float(phi_bar) == pytest.approx(phi, rel=1e-5)
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_noiseless_warns_loudly_in_a_run():
    with pytest.warns(NotPrivateWarning):
        trainer = _dp_trainer(1, [AdamVariant("noiseless")])
        trainer.fit(AdamModule(scheduler=False), make_loader(n=64, batch_size=16))


class StateAtTrainStart(Callback):
    """Optimizer class and state right after Lightning restored the checkpoint."""

    def on_train_start(self, trainer, pl_module):
        opt = trainer.strategy.optimizers[0]
        self.kind = type(opt)
        self.state = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                      for k, s in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("start_step", [0, 2])
def test_checkpoint_written_after_the_swap_resumes(tmp_path, start_step):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _dp_trainer(3, [AdamVariant("bias_corrected", start_step=start_step, gamma=1e-8), ckpt_cb],
                              enable_checkpointing=True)
        trainer.fit(AdamModule(), make_loader(n=64, batch_size=16))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["dp_variant"]["name"] == "bias_corrected"

    probe = StateAtTrainStart()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", message=".*saved with variant.*")  # the state must load into DPAdam
        resumed = _dp_trainer(5, [AdamVariant("bias_corrected", start_step=start_step, gamma=1e-8), probe])
        resumed.fit(AdamModule(), make_loader(n=64, batch_size=16), ckpt_path=tmp_path / "last.ckpt")
    assert probe.kind is DPAdam
    for k, s in saved["optimizer_states"][0]["state"].items():
        assert int(probe.state[k]["step"]) == int(s["step"]) == 3
        for name in ("exp_avg", "exp_avg_sq", "phi"):
            torch.testing.assert_close(probe.state[k][name], s[name])
    opt = resumed.strategy.optimizers[0]
    assert all(int(s["step"]) == 5 for s in opt.state.values())
    assert resumed.strategy.lr_scheduler_configs[0].scheduler.optimizer is opt
    assert resumed.strategy.ledger.steps == 5


def test_checkpoint_written_before_the_swap_resumes_then_swaps(tmp_path):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _dp_trainer(2, [AdamVariant("bias_corrected", start_step=4), ckpt_cb], enable_checkpointing=True)
        trainer.fit(AdamModule(), make_loader(n=64, batch_size=16))
        assert type(trainer.strategy.optimizers[0]) is torch.optim.Adam
        probe, kinds = StateAtTrainStart(), Probe()
        resumed = _dp_trainer(6, [AdamVariant("bias_corrected", start_step=4), probe, kinds])
        resumed.fit(AdamModule(), make_loader(n=64, batch_size=16), ckpt_path=tmp_path / "last.ckpt")
    assert probe.kind is torch.optim.Adam
    assert kinds.kinds == ["Adam", "Adam", "DPAdam", "DPAdam"]
    assert all(int(s["step"]) == 6 for s in resumed.strategy.optimizers[0].state.values())


@pytest.mark.parametrize("start_step", [0, 2])
def test_the_swap_is_announced_once_with_the_variant_and_its_parameters(caplog, start_step):
    """One INFO line when the variant takes effect (issue 35: nothing said it had): optimizers, variant, floor, step."""
    with caplog.at_level("INFO"):
        _fit(AdamModule(scheduler=False), [AdamVariant("bias_corrected", start_step=start_step)], steps=4,
             strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AdamVariant:")]
    assert lines == [f"AdamVariant: from step {start_step}, Adam → DPAdam(variant='bias_corrected': γ' = 0.1·Φ̄ "
                     "(relative to the noise variance)); lr, betas, moments and schedulers carried over."]
