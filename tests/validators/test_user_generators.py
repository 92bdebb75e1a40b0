"""The ``torch.Generator`` objects a model or a callback holds are treated as the global generators
(lightning_dp/records/user_generators.py).

The checks run the user's step several times on the same examples and fork the generators so that every pass draws
alike: a module drawing augmentation noise from its own generator was refused as "per-example gradients do not add
up" / "Examples interact", each pass drawing other numbers (red-team zoo13 rng1, own generator). Every step also
reseeds the user's generators, so a data-dependent number of draws from them at a batch's end reaches no later step
(neighbouring datasets D, D' differing in a record drawn at step 0 only; lr 0 at step 0, σ tiny: the weights after
step 1 may differ by the noise only)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.records import user_generators

torch.set_num_threads(1)

N, B, SIGMA = 64, 16, 1e-6


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] > 0).long()


class _Noisy(nn.Module):
    """Augmentation noise from the module's own generator (a submodule: found below the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        return x + 0.3 * torch.randn(x.shape, generator=self.gen)


class _OwnGenerator(pl.LightningModule):
    """Noise from a submodule's generator in the forward; at the batch's end a few misclassified examples are picked
    to show with the module's own generator: ``torch.randperm(n_wrong, generator=self.gen)`` (``data_dependent``) or
    ``torch.randperm(B, ...)``."""

    def __init__(self, data_dependent: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.data_dependent = data_dependent
        self.gen = torch.Generator().manual_seed(7)
        self.noise = _Noisy()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.1 * torch.randn(x.shape, generator=self.gen)
        logits = self.net(self.noise(x))
        return {"loss": F.cross_entropy(logits, y), "wrong": (logits.argmax(1) != y).detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        wrong = outputs["wrong"]
        n = int(wrong.sum()) if self.data_dependent else len(wrong)
        shown = torch.randperm(n, generator=self.gen)[:4]
        assert len(shown) <= 4  # shown in the logs by a user; nothing kept

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s == 0 else 1.0)  # step 0 moves nothing
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


class _Rows(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].detach().clone())


def _fit(module: pl.LightningModule, y: torch.Tensor, per_sample: str = "ghost", steps: int = 2):
    x, _ = _data()
    pl.seed_everything(123, verbose=False)
    rows = _Rows()
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=SIGMA, max_grad_norm=1.0, sampler_seed=0,
                                             per_sample=per_sample, public_state=["_Rows.batches"]),
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_steps=steps, callbacks=[rows])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=B))
    return torch.cat([p.detach().flatten() for p in module.parameters()]), rows


def _in(rows: torch.Tensor, record: torch.Tensor) -> bool:
    return bool((rows == record).all(1).any())


@pytest.mark.parametrize("per_sample", ["ghost", "vmap"])
def test_augmentation_noise_from_the_modules_own_generator_trains(per_sample):
    _, y = _data()
    module = _OwnGenerator()
    before = torch.cat([p.detach().flatten() for p in module.parameters()]).clone()
    w, rows = _fit(module, y, per_sample, steps=3)
    assert len(rows.batches) == 3
    assert (w - before).norm() > 0  # it trained (steps 1 and 2 move the weights)


def test_a_data_dependent_draw_count_from_the_modules_own_generator_does_not_reach_the_next_step():
    x, y = _data()
    y2 = y.clone()
    y2[12] = 1 - y[12]  # record 12: drawn at step 0, not at step 1 (sampler_seed=0)
    w, rows = _fit(_OwnGenerator(data_dependent=True), y)
    w2, rows2 = _fit(_OwnGenerator(data_dependent=True), y2)
    for r in (rows, rows2):
        assert len(r.batches) == 2 and _in(r.batches[0], x[12]) and not _in(r.batches[1], x[12])
    assert (w - w2).norm() < 1e-4  # the noise alone (~1e-6); the hook's draws would shift step 1's noise


def test_the_generators_held_are_found_below_the_model_and_the_callbacks_not_the_librarys():
    class Holder:
        def __init__(self) -> None:
            self.gens = {"a": torch.Generator()}

    class Cb(pl.Callback):
        def __init__(self) -> None:
            self.helper = Holder()

    model = _OwnGenerator()
    model.extra = [nn.Linear(2, 2)]  # an unregistered module, holding one too
    model.extra[0].g = torch.Generator()
    model.optim_like = torch.optim.SGD(model.parameters(), lr=0.1)  # a library object: never walked into
    cb = Cb()
    found = dict(user_generators.find([model, cb, pl.callbacks.ModelCheckpoint()]))
    assert set(found) == {"gen", "noise.gen", "extra[0].g", "Cb.helper.gens['a']"}
    assert torch.default_generator not in found.values()


def test_forked_and_reseeded_generators_draw_alike_and_come_back():
    from lightning_dp.validators.rng import forked_rngs

    class Owner:
        pass

    module = _Noisy()
    owner = Owner()
    user_generators.watch(owner, lambda: [module])
    try:
        start = module.gen.get_state()
        with forked_rngs():
            user_generators.reseed(0)
            a = torch.randn(3, generator=module.gen)
            user_generators.reseed(0)
            b = torch.randn(3, generator=module.gen)
            user_generators.reseed(1)
            c = torch.randn(3, generator=module.gen)
        assert torch.equal(a, b) and not torch.equal(a, c)
        assert torch.equal(module.gen.get_state(), start)
        del owner  # held weakly: once the step is gone, no generator is touched
        assert user_generators.held() == []
    finally:
        user_generators.stop()


class _Consistency(pl.LightningModule):
    """A noise-consistency loss CE(f(x)) + MSE(f(x + ε₁), f(x + ε₂)), ε from torch's global generator (QA safezoo6):
    the noise moves the gradients by less than the probe's loose tolerance (1e-3), more than rounding; it was refused as
    "Examples interact" (batch and alone draw other noise) instead of being seen as the step's own randomness."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        x1, x2 = x + 0.05 * torch.randn_like(x), x + 0.05 * torch.randn_like(x)
        return F.cross_entropy(self.net(x), y) + F.mse_loss(self.net(x1).softmax(-1), self.net(x2).softmax(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_consistency_loss_on_two_noisy_views_is_the_steps_own_randomness_not_an_interaction():
    _, y = _data()
    with pytest.warns(UserWarning, match="draws random numbers outside dropout"):
        _, rows = _fit(_Consistency(), y, steps=2)
    assert len(rows.batches) == 2
