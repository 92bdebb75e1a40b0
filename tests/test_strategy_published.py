"""Published Lightning projects train as published (issue 37): a template's checkpointing, TensorBoard's graph."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError


class Template(pl.LightningModule):
    """The Hydra template's pattern: the network is a constructor argument kept in the hyperparameters."""

    def __init__(self, net: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Net(nn.Module):
    """A container reading its own parameter (its class is intercepted during a step) around plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.a, self.norm, self.b = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x)) * self.scale))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=10)


def _net(engine: str) -> nn.Module:
    """:class:`Net`; for Opacus (whose torch.func fallback cannot run a container of hooked layers) plain layers."""
    if engine == "opacus_hooks":
        return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
    return Net()


def _checkpoint_keys(tmp_path, strategy, engine: str) -> tuple[list[str], object]:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(strategy=strategy, max_steps=2, enable_checkpointing=True, callbacks=[checkpoint])
    torch.manual_seed(0)
    trainer.fit(Template(_net(engine)), _loader())
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == 2  # one per step, both written while the engine was attached
    saved = torch.load(files[-1], weights_only=False)
    return sorted(saved["state_dict"]), saved["hyper_parameters"]["net"]


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
def test_a_template_keeping_its_network_in_hparams_checkpoints_every_step(tmp_path, engine):
    """ModelCheckpoint pickles the hyperparameters, the network among them, in the middle of the fit: it once failed
    with "Can't pickle local object 'ActivationCapture._hook.<locals>.hook'". The checkpoint holds what a non-private
    run's holds, and its network is the user's, without the engine."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    keys, net = _checkpoint_keys(tmp_path / "private", strategy, engine)
    plain_keys, _ = _checkpoint_keys(tmp_path / "plain", "auto", engine)
    assert keys == plain_keys
    assert type(net) is type(_net(engine)) and "_dp_root_reader" not in vars(net)
    net(torch.randn(3, 4))  # the loaded network runs; its dropped hooks remove themselves
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._forward_hooks_with_kwargs
                   or m._forward_pre_hooks_with_kwargs or m._forward_hooks_always_called for m in net.modules())


class TimeMajorGraph(pl.LightningModule):
    """A model TensorBoard traces: time-major attention, an LSTM, a norm and a head, with ``example_input_array``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.attn = nn.Linear(4, 8), nn.MultiheadAttention(8, 2)
        self.rnn, self.head = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 2)
        self.example_input_array = torch.randn(3, 5, 4)

    def forward(self, x):
        h = self.proj(x).transpose(0, 1)
        h = (h + self.attn(h, h, h)[0]).transpose(0, 1)
        return self.head(self.rnn(h)[0][:, -1])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_tensorboard_traces_the_graph_of_an_attached_model(tmp_path, engine):
    """TensorBoardLogger(log_graph=True) traces the model twice and compares: the engine's hooks and replaced forwards
    stay out of the trace ("Graphs differed across invocations" before)."""
    pytest.importorskip("tensorboard")
    from pytorch_lightning.loggers import TensorBoardLogger

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 5, 4, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0, 0] > 0).long()), batch_size=8)
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    trainer = quiet_trainer(strategy=strategy, max_steps=1, logger=logger)
    trainer.fit(TimeMajorGraph(), loader)
    assert strategy.ledger.steps == 1
    assert list(tmp_path.rglob("events.out.tfevents.*"))


# ---------------------------------------------------------------- Trainer(gradient_clip_val=...)
class ClipWatch(pl.Callback):
    """The norm of each applied update (SGD, lr = 1: the gradient the optimizer used) and the Trainer's
    gradient_clip_val during the fit."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.during: list[object] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().clone() for p in pl_module.parameters()]
        self.during.append(trainer.gradient_clip_val)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        delta = [p.detach() - b for p, b in zip(pl_module.parameters(), self._before)]
        self.norms.append(float(torch.sqrt(sum(d.pow(2).sum() for d in delta))))


class UnitStep(Template):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _fit_with_clip(strategy, **trainer_kwargs) -> tuple[pl.Trainer, ClipWatch]:
    watch = ClipWatch()
    trainer = quiet_trainer(strategy=strategy, max_steps=2, callbacks=[watch], **trainer_kwargs)
    torch.manual_seed(0)
    trainer.fit(UnitStep(Net()), _loader())
    return trainer, watch


def test_a_published_gradient_clip_val_becomes_the_per_example_bound(console_lines):
    """Not given max_grad_norm: C = gradient_clip_val, said once, and Lightning's clipping of the released (noised)
    gradient is off during the fit: the noised updates are larger than C (σ = 10), which Lightning would have cut to C;
    the Trainer gets its value back afterwards."""
    strategy = DPStrategy(noise_multiplier=10.0, sampler_seed=0, public_state=["ClipWatch"])
    trainer, watch = _fit_with_clip(strategy, gradient_clip_val=0.5)
    assert strategy.max_grad_norm == 0.5
    assert strategy.last_release.noise_std == pytest.approx(10.0 * 0.5 / 10)
    assert [r.getMessage() for r in console_lines.records if "gradient_clip_val" in r.getMessage()] == [
        "DPStrategy: per-example clipping bound C = 0.5, from Trainer(gradient_clip_val=0.5); Lightning's own clipping "
        "of the batch gradient is off for this fit"]
    assert watch.during == [None, None] and min(watch.norms) > 0.5
    assert trainer.gradient_clip_val == 0.5


def test_the_registered_strategy_takes_gradient_clip_val_as_its_bound_too():
    trainer = quiet_trainer(strategy="dp", max_steps=1, gradient_clip_val=0.25)
    trainer.fit(UnitStep(Net()), _loader())
    assert trainer.strategy.max_grad_norm == 0.25


def test_the_same_bound_given_twice_trains_and_a_different_one_is_refused():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, public_state=["ClipWatch"])
    trainer, watch = _fit_with_clip(strategy, gradient_clip_val=0.5)
    assert strategy.max_grad_norm == 0.5 and watch.during == [None, None] and trainer.gradient_clip_val == 0.5
    model = UnitStep(Net())
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=1,
                            gradient_clip_val=0.5)
    with pytest.raises(PrivacyConfigurationError,
                       match=r"gradient_clip_val=0.5\) and DPStrategy\(max_grad_norm=1.0\) give two different"):
        trainer.fit(model, _loader())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class Owned(UnitStep):
    """The template with its network built inside (a checkpoint of plain tensors: weights-only loadable)."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.net = Net()


def test_a_resumed_fit_with_the_same_published_config_keeps_its_bound(tmp_path):
    """C adopted from gradient_clip_val is the checkpoint's C: a resumed fit with the same config is not refused as
    a change of C (the adoption happens before the checkpoint's privacy arguments are compared)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1, gradient_clip_val=0.5,
                            enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(Owned(), _loader())
    strategy = DPStrategy(noise_multiplier=1.0)
    resumed = quiet_trainer(strategy=strategy, max_steps=2, gradient_clip_val=0.5)
    resumed.fit(Owned(), _loader(), ckpt_path=str(next(tmp_path.glob("*.ckpt"))))
    assert strategy.max_grad_norm == 0.5 and strategy.ledger.steps == 2
