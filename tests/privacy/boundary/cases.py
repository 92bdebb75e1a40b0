"""Shared pieces of the release-boundary tests: a small classifier, a loader, and how a run is judged."""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy


def data(n: int = 64, d: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def loader(n: int = 64, batch_size: int = 16, seed: int = 0) -> DataLoader:
    return DataLoader(data(n, seed=seed), batch_size=batch_size)


class Classifier(pl.LightningModule):
    """A plain two-layer classifier with SGD(lr=1); subclasses add one habit each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def strategy(**kwargs: Any) -> DPStrategy:
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    kwargs.setdefault("sampler_seed", 0)
    return DPStrategy(**kwargs)


def fit(model: pl.LightningModule, steps: int = 3, callbacks: Optional[list] = None, n: int = 64, seed: int = 0,
        **strategy_kwargs: Any) -> DPStrategy:
    """``steps`` private steps of ``model`` on ``data(n, seed=seed)`` (another seed: other records, so that a test's
    fits one after another do not continue each other's releases on the data); returns the strategy."""
    dp = strategy(**strategy_kwargs)
    quiet_trainer(strategy=dp, max_steps=steps, callbacks=callbacks or []).fit(model, loader(n, seed=seed))
    return dp


def parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(before: list[torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def refused_before_any_release(model: pl.LightningModule, dataset: TensorDataset, match: str) -> None:
    """Two private steps of ``model`` on ``dataset`` are refused with a message matching ``match`` before any
    release: the weights are as they were."""
    import pytest

    from lightning_dp import PrivacyConfigurationError

    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=match):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(dataset, batch_size=16))
    assert unchanged(before, model)


def plain_step(model: nn.Module, **kwargs: Any) -> tuple[Any, torch.optim.Optimizer, Any]:
    """A plain PyTorch loop's private step on 32 examples of 4 features (SGD, lr 0.1), attached and verified:
    (the step, the optimizer, its Poisson loader's batches, drawn without end). Detach the step when done."""
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine="ghost", sampler_seed=0, **kwargs)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(TensorDataset(x, y), batch_size=8))
    step.verify(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
    return step, opt, (batch for _ in iter(int, 1) for batch in loader)
