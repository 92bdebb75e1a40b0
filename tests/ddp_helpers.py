"""Top-level (picklable) pieces for the multi-process tests of tests/test_ddp.py.

Worker processes started by Lightning's launcher (fork or spawn) cannot return rich
results: :class:`RankRecorder` writes what each rank saw to ``<dir>/rank<r>.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.privacy.noise import NoiseMechanism


class ZeroNoise(NoiseMechanism):
    """Unit noise that is identically zero: the mechanism's deterministic part alone."""

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """Zeros shaped like ``like``."""
        return [torch.zeros_like(t) for t in like]


class ZeroGradModule(pl.LightningModule):
    """Every per-example gradient is zero, so with SGD(lr=1) the update is −(noise)/B."""

    def __init__(self, d_in: int = 100, d_out: int = 100) -> None:
        super().__init__()
        self.layer = nn.Linear(d_in, d_out)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        return (self.layer(x) * 0.0).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


class SeededClassifier(pl.LightningModule):
    """A small MLP with seeded initialisation (same weights in every process)."""

    def __init__(self, d_in: int = 6, n_classes: int = 3, seed: int = 0, lr: float = 0.5, log_sync: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, n_classes))
        self.lr = lr
        self.log_sync = log_sync

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=self.log_sync)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SpectralClassifier(SeededClassifier):
    """:class:`SeededClassifier` with a spectral norm on its hidden layer (u, v advanced by the library once per
    update, on every rank alike: power_iteration.py)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        torch.manual_seed(seed + 100)
        self.net[0] = nn.utils.parametrizations.spectral_norm(self.net[0])


def classification_data(n: int, d_in: int = 6, n_classes: int = 3, seed: int = 0) -> TensorDataset:
    """A fixed random classification set (features N(0, 1), labels from a random linear map)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = (x @ torch.randn(d_in, n_classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def flat_params(module: nn.Module) -> Tensor:
    """All parameters of ``module`` as one detached vector."""
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class DesyncNonZeroRanks(Callback):
    """Perturbs the parameters on ranks > 0 before the strategy's setup (which must re-sync them)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank > 0:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(1.0)


class RankRecorder(Callback):
    """Writes, per rank, the parameters before/after fit, per-step batch sizes and parameter
    updates, and the strategy's public state."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = str(out_dir)
        self._start: Tensor | None = None
        self._batch_sizes: list[int] = []
        self._updates: list[Tensor] = []
        self._before = torch.zeros(0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.set_num_threads(1)
        self._start = flat_params(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._batch_sizes.append(int(batch[0].shape[0]))
        self._before = flat_params(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._updates.append(flat_params(pl_module) - self._before)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "start": self._start,
            "end": flat_params(pl_module),
            "batch_sizes": self._batch_sizes,
            "updates": torch.stack(self._updates) if self._updates else torch.zeros(0),
            "global_step": trainer.global_step,
            "ledger": strategy.ledger.state_dict(),
            "ledger_steps": strategy.ledger.steps,
            "sample_rate": strategy.sample_rate,
            "expected_batch_size": strategy.expected_batch_size,
            "num_samples": strategy.num_samples,
            "noise_multiplier": strategy.noise_multiplier,
            "max_grad_norm": strategy.max_grad_norm,
        }
        torch.save(record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def load_records(out_dir: str | os.PathLike, world_size: int) -> list[dict[str, Any]]:
    """The :class:`RankRecorder` files of ranks 0..world_size-1."""
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    """A plain user DataLoader (the strategy replaces its sampling)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


class ZeroGradSignModule(ZeroGradModule):
    """:class:`ZeroGradModule` trained with DP-SignSGD (the strategy's sign-vote mode)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_dp.optim import DPSignSGD

        return DPSignSGD(self.parameters(), lr=0.5)


class Rank0StampBroadcast(Callback):
    """Rank-0-only wall-clock bookkeeping beside a broadcast of a public step count at batch end (legitimate: the
    first step's replays run the hooks as many times on every rank, so the broadcasts stay paired)."""

    def __init__(self) -> None:
        self.stamp = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        import time

        if trainer.is_global_zero:
            self.stamp = time.time()
        trainer.strategy.broadcast(trainer.global_step, src=0)


class Rank0LossEmaBroadcast(Callback):
    """An EMA of the batch's loss kept on rank 0 only, beside a broadcast at batch end: a write from the batch on one
    rank, refused there; every rank must raise, none left waiting in the broadcast."""

    def __init__(self) -> None:
        self.ema: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = float(outputs["loss"])
        if trainer.is_global_zero:
            self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        trainer.strategy.broadcast(trainer.global_step, src=0)


def errors_recorded(strategy_cls: type, out_dir: str | os.PathLike, wait_s: float = 15.0,
                    methods: tuple[str, ...] = ("training_step",), exact_type: bool = False) -> type:
    """A subclass of ``strategy_cls`` whose ``methods`` write the name of the error they raise to
    ``<out_dir>/rank<r>.err`` (a refusal as ``PrivacyConfigurationError`` unless ``exact_type``: its own class), then
    the message; rank 0 waits (up to ``wait_s``) for the other ranks' files before raising, so the launcher does not
    end a rank that is about to raise too (a rank stuck in a collective never writes one)."""
    import time

    from lightning_dp.errors import PrivacyConfigurationError

    def recording(method: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as err:
                rank = self.global_rank
                refusal = isinstance(err, PrivacyConfigurationError) and not exact_type
                kind = "PrivacyConfigurationError" if refusal else type(err).__name__
                Path(out_dir, f"rank{rank}.err").write_text(f"{kind}\n{err if exact_type else str(err)[:300]}")
                if rank == 0:
                    deadline = time.monotonic() + wait_s
                    while time.monotonic() < deadline and len(list(Path(out_dir).glob("rank*.err"))) < self.world_size:
                        time.sleep(0.1)
                raise

        return run

    return type("Recorded", (strategy_cls,), {name: recording(getattr(strategy_cls, name)) for name in methods})


def _training_features(trainer: pl.Trainer) -> Tensor:
    """The training set's features as the user's code reaches them (the loader's dataset)."""
    return trainer.train_dataloader.dataset.tensors[0]


class Rank0MeansAtFitEnd(Callback):
    """Class-free feature means of the training set kept in ``on_fit_end`` on rank 0 only, beside a broadcast (an OOD
    score's statistics): written after the last update from the data, refused on every rank, none left waiting."""

    def __init__(self) -> None:
        self.means: Tensor | None = None

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.means = _training_features(trainer).mean(0).clone()
        trainer.strategy.broadcast(trainer.global_step, src=0)


class Rank0MeansInCheckpoint(Callback):
    """The training set's feature means put into every checkpoint on rank 0 only, beside a broadcast: a checkpoint
    entry computed from the data (read back by ``on_load_checkpoint`` on a resume), refused on every rank."""

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.is_global_zero:
            checkpoint["feature_means"] = _training_features(trainer).mean(0).clone()
        trainer.strategy.broadcast(trainer.global_step, src=0)
