"""Public pretraining, then private fine-tuning: train the model on public data before the private fit
begins, and optionally freeze the layers it learned.

Training on data that holds no private record costs no privacy: the DP guarantee of the private fit
that follows is about its own training set alone, whatever the starting weights (they are a function
of public data). Freezing the pretrained feature layers leaves fewer coordinates to privatise: the
Gaussian noise σC/B per coordinate is the same, its norm over the trainable parameters shrinks with
their number (De et al. 2022, "Unlocking high-accuracy differentially private image classification
through scale", §4; Tramèr & Boneh 2021). On scikit-learn's digits,
:class:`~lightning_dp.data.FontDigits` (typeset numerals, no private data) as the public set lifts
ε = 1 test accuracy from 84–92 % to 93–95 % (docs/results/digits_recipe.md).

The callback runs in ``setup`` of ``fit``, before the strategy builds the optimizer and the private
mechanism, with a plain loop (Adam, the module's forward, ``loss(forward(x), y)``): nothing of it goes
through the DP strategy or its ledger. On resume the pretraining runs again before the checkpoint's
weights replace its result (deterministic for a given ``seed``; only time is spent), and the layers
are frozen again. Under DDP every process pretrains the same way and rank 0's weights are broadcast.

The dataset must be public. A dataset that is the private training set, a subset or wrapper of it, or holds a
clear share of its rows (a copy in a new ``TensorDataset``) is refused before it trains when the training loader is
known at ``setup`` (given to ``fit``, or by a LightningDataModule), and otherwise when the private fit attaches, before
its first release: the inputs the pretraining stepped on are kept, sampled, with the parameters
(:mod:`lightning_dp.record_statistics.public_overlap`). Private records changed on the way (augmented, renormalised)
are not recognised: this callback cannot tell public data from private data in general.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from lightning_dp.record_statistics.public_overlap import check_public_dataset
from lightning_dp.records.outside_steps import public_steps

log = logging.getLogger(__name__)


class PublicPretraining(Callback):
    """Train the LightningModule on ``dataset`` (public data) before the private fit; freeze ``freeze``.

    Args:
        dataset: public ``(input, target)`` pairs, e.g. :class:`~lightning_dp.data.FontDigits`.
        epochs: passes over ``dataset``.
        lr: Adam's learning rate.
        batch_size: minibatch size of the (non-private) pretraining.
        freeze: names of submodules (``model.get_submodule`` paths, e.g. ``"features"``) whose parameters
            stop training after the pretraining: the private fit trains the rest.
        loss: ``loss(model(inputs), targets)`` to minimise (default: cross-entropy).
        seed: seed of the pretraining's shuffling (the model's initial weights are the caller's).
    """

    def __init__(
        self,
        dataset: Dataset,
        epochs: int = 8,
        lr: float = 1e-3,
        batch_size: int = 128,
        freeze: Sequence[str] = (),
        loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
        seed: int = 0,
    ) -> None:
        if epochs < 0 or batch_size <= 0 or lr <= 0:
            raise ValueError(f"need epochs ≥ 0, batch_size > 0 and lr > 0; got {epochs}, {batch_size}, {lr}")
        if isinstance(freeze, str):
            freeze = (freeze,)
        self.dataset, self.epochs, self.lr, self.batch_size = dataset, epochs, lr, batch_size
        self.freeze, self.loss, self.seed = tuple(freeze), loss, seed
        self.losses: list[float] = []  # mean pretraining loss of each epoch

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """At the start of ``fit``: pretrain, then freeze (before the strategy builds the optimizer)."""
        if stage != "fit":
            return
        frozen = _submodules(pl_module, self.freeze)  # bad names fail before a minute of pretraining
        training = _training_dataset(trainer)
        if training is not None:  # the private training set declared public: refused before it trains
            check_public_dataset(self.dataset, training)
        self.losses = pretrain(pl_module, self.dataset, self.epochs, self.lr, self.batch_size, self.loss,
                               self.seed, trainer.strategy.root_device,
                               progress=trainer.progress_bar_callback is not None and trainer.is_global_zero)
        for module in frozen:
            module.requires_grad_(False)
        if frozen:
            log.info("frozen after public pretraining: %s (%d parameters stay trainable)", ", ".join(self.freeze),
                     sum(p.numel() for p in pl_module.parameters() if p.requires_grad))


def pretrain(
    model: nn.Module,
    dataset: Dataset,
    epochs: int,
    lr: float,
    batch_size: int,
    loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> list[float]:
    """Minimise ``loss(model(x), y)`` over ``dataset`` with Adam for ``epochs`` passes (non-private: public
    data only); the model keeps its train/eval mode and returns to its device. The mean loss of each epoch."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)
    home = next(model.parameters()).device
    was_training = model.training
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=epochs * len(loader), desc="public pretraining", disable=not progress, leave=False)
    with torch.enable_grad(), public_steps():  # declared public: not a fit outside the mechanism (outside_steps.py)
        for epoch in range(epochs):
            total, count = 0.0, 0
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                value = loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                value.backward()
                optimizer.step()
                total, count = total + value.item() * len(y), count + len(y)
                bar.update()
            losses.append(total / max(count, 1))
            log.info("public pretraining epoch %d/%d: loss %.4f", epoch + 1, epochs, losses[-1])
    bar.close()
    for p in params:
        p.grad = None
    model.to(home).train(was_training)
    log.info("public pretraining: %d epochs over %d examples in %.1f s", epochs, len(dataset),
             time.perf_counter() - start)
    return losses


def _training_dataset(trainer: "pl.Trainer") -> Optional[Dataset]:
    """The private training dataset when known at the fit's ``setup``: the loader given to ``fit``, or the
    LightningDataModule's (set up by then). ``None`` otherwise (the module's ``train_dataloader`` may need its own
    ``setup``, not run yet: the check at the private fit's attach covers it)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    instance = getattr(source, "instance", None)
    if isinstance(instance, DataLoader):
        return instance.dataset
    if isinstance(instance, pl.LightningDataModule):
        try:
            loader = source.dataloader()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 — only this early check is skipped: the attach-time one still runs
            return None
        return loader.dataset if isinstance(loader, DataLoader) else None
    return None


def _submodules(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """``model.get_submodule(name)`` for each name, or a ValueError listing the names that exist."""
    found = []
    for name in names:
        try:
            found.append(model.get_submodule(name))
        except AttributeError:
            children = ", ".join(n for n, _ in model.named_children())
            raise ValueError(f"PublicPretraining(freeze=...): the model has no submodule {name!r}; "
                             f"its top-level submodules are: {children}") from None
    return found
