"""Top-level (picklable) pieces for tests/test_sharded_strategy.py: models that shard themselves with
FSDP2 in ``configure_model`` (and stay whole under ``DPStrategy``), and a recorder of full parameters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from ddp_helpers import ZeroNoise
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.models.tiny_transformer import Block, TinyTransformerLM


class RankZeroNoise(ZeroNoise):
    """Zero unit noise that may be split per rank (each rank's stream is this same zero stream)."""

    def for_rank(self, rank: int) -> "RankZeroNoise":
        """Itself: zeros are zeros on every rank."""
        return self


def _shard(module: pl.LightningModule, blocks: list[nn.Module]) -> None:
    """``fully_shard`` each block, then the root, over the data-parallel mesh (nothing without a mesh:
    the same class then runs unsharded under DPStrategy)."""
    if module.device_mesh is None:
        return
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


class ShardedTransformer(TinyTransformerLM):
    """The small transformer in float64, SGD, sharded per block (``configure_model``)."""

    def __init__(self, seed: int = 0, lr: float = 0.5, **kwargs: Any) -> None:
        torch.manual_seed(seed)
        defaults = dict(vocab_size=17, max_len=6, d_model=12, n_layers=2, n_heads=2, d_ff=20, optimizer="sgd",
                        momentum=0.0)
        super().__init__(lr=lr, **{**defaults, **kwargs})
        self.double()  # TinyTransformerLM.configure_model shards each block and the root under a device mesh


class TiedLM(pl.LightningModule):
    """An LM whose output layer is an ``nn.Linear`` sharing the token embedding's weight (GPT-2's tying)."""

    def __init__(self, seed: int = 0, vocab: int = 13, d: int = 10, lr: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, d)
        self.block = Block(d, 2, 16)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.lr = lr
        self.double()

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.ln(self.block(self.tok(ids))))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_model(self) -> None:
        _shard(self, [self.block])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LoRALinear(nn.Module):
    """y = W x + b + B A x with W, b frozen and A, B trainable (Hu et al. 2021)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A = nn.Linear(d_in, rank, bias=False)
        self.B = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.1)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.B(self.A(x))


class LoRABlock(nn.Module):
    """A frozen MLP block with LoRA adapters on both projections (a trainable LayerNorm too)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = LoRALinear(d, 2 * d), LoRALinear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class LoRALM(pl.LightningModule):
    """A frozen embedding and head around LoRA blocks: only adapters and LayerNorms train."""

    def __init__(self, seed: int = 0, vocab: int = 11, d: int = 8, lr: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, d).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock(d) for _ in range(2))
        self.head = nn.Linear(d, vocab).requires_grad_(False)
        self.lr = lr
        self.double()

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_model(self) -> None:
        _shard(self, list(self.blocks))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class CheckpointedTransformer(ShardedTransformer):
    """:class:`ShardedTransformer` with activation checkpointing: each block's activations are recomputed in
    backward (``torch.utils.checkpoint``, non-reentrant), so the engine's hooks see every block twice."""

    def forward(self, ids: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


class MetricsFile(Logger):
    """A logger that appends every ``log_metrics`` call (rank 0) to a file the test process reads."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = str(path)
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "metrics_file"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing to keep."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Append (step, metrics) and rewrite the file."""
        self.rows.append((-1 if step is None else int(step), {k: float(v) for k, v in metrics.items()}))
        torch.save(self.rows, self.path)


def token_data(n: int, vocab: int, length: int, seed: int = 0) -> TensorDataset:
    """n random windows of ``length`` token ids and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    """A plain user DataLoader (the strategy replaces its sampling)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def full_params(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter of ``module`` as a full, detached CPU tensor (a sharded one gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone().cpu()
    return out


class FullParamRecorder(Callback):
    """Writes, per rank, the full parameters before and after fit and after every step, the Poisson batch
    sizes, the shapes and kinds of the gradients seen before each optimizer step (and which unsharded leaves
    held an autograd gradient then), and the privacy state."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = str(out_dir)
        self._start: dict[str, Tensor] = {}
        self._steps: list[dict[str, Tensor]] = []
        self._grads: list[dict[str, Any]] = []
        self._leaf_grads: list[list[str]] = []
        self._batch_sizes: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.set_num_threads(1)
        self._start = full_params(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._batch_sizes.append(int(batch[0].shape[0]))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from torch.distributed.tensor import DTensor

        self._grads.append({name: (type(p.grad).__name__, tuple(p.grad.to_local().shape)
                                   if isinstance(p.grad, DTensor) else tuple(p.grad.shape))
                            for name, p in pl_module.named_parameters() if p.grad is not None})
        layout = getattr(trainer.strategy, "layout", None)
        if layout is not None:  # autograd's (non-private) gradients of the unsharded leaves: none may be kept
            named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
            leaves = layout.autograd_params([p for _, p in named])
            self._leaf_grads.append([n for (n, p), u in zip(named, leaves) if u is p or u.grad is not None])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self._steps.append(full_params(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        record = {
            "rank": trainer.global_rank,
            "start": self._start,
            "steps": self._steps,
            "grads": self._grads,
            "leaf_grads": self._leaf_grads,
            "batch_sizes": self._batch_sizes,
            "end": full_params(pl_module),
            "global_step": trainer.global_step,
            "ledger": strategy.ledger.state_dict(),
            "ledger_steps": strategy.ledger.steps,
            "expected_batch_size": strategy.expected_batch_size,
            "noise_std": strategy.last_release.noise_std if strategy.last_release is not None else None,
        }
        torch.save(record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def load_records(out_dir: str | os.PathLike, world_size: int) -> list[dict[str, Any]]:
    """The :class:`FullParamRecorder` files of ranks 0..world_size-1."""
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class LeafShardedLM(ShardedTransformer):
    """``fully_shard`` applied to a leaf layer (the head): refused, the fix named."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.head, mesh=mesh)
        _shard(self, list(self.blocks))


class RootlessLM(ShardedTransformer):
    """Blocks sharded, the root not: the embeddings and the head stay unsharded replicas (refused)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


class Conv1dLM(ShardedTransformer):
    """A Conv1d (no closed-form ghost rule: the per-layer vmap fallback) in front of the head (refused)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mix = nn.Conv1d(12, 12, 1).double()

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids)


class SignLM(ShardedTransformer):
    """DP-SignSGD's majority vote (refused under sharding)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_dp.optim import DPSignSGD

        return DPSignSGD(self.parameters(), lr=0.1)
