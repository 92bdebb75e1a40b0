"""White-box "Dirac" gradient canaries (Steinke, Nasr & Jagielski 2023, §7 / Alg. 2; docs/algorithms.md §8).

Each canary i is an example whose gradient is exactly C·e_i: norm C (the clipping norm,
so clipping leaves it untouched) along its own coordinate, and nothing else. This is
done without touching the strategy: the model is wrapped in :class:`GradientCanaryModule`,
which adds a zero-initialised table w ∈ R^m (an ``nn.Embedding(m, 1)``, which every
per-example engine supports) and, for a canary example with id i, the per-example loss
C·w_i instead of the classifier's loss. Real examples never touch w; canaries never
touch the classifier. The mechanism sees one more layer and treats it like any other
(clip per example, add σC noise to every coordinate), so the guarantee audited is the
strategy's own.

Score of canary i: -(w_i,T − w_i,0) = -w_i,T, the distance its coordinate moved against
its gradient (higher ⇒ guess "in"). Without noise an included canary moves by
≈ η·C·(times sampled)/B and an excluded one not at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import Dataset

from lightning_dp.audit._wrapped_data import TrainSetWrapper


class GradientCanaryDataset(Dataset):
    """``base`` items as ``(x, y, -1)`` followed by the included canaries as ``(0·x, 0, i)``."""

    def __init__(self, base: Dataset, included: Tensor) -> None:
        self.base = base
        self._ids = torch.nonzero(included).flatten().tolist()
        self._n_base = len(base)  # type: ignore[arg-type]
        x0, y0 = base[0]
        self._blank = (torch.zeros_like(torch.as_tensor(x0)), torch.zeros_like(torch.as_tensor(y0)))

    def __len__(self) -> int:
        return self._n_base + len(self._ids)

    def __getitem__(self, i: int) -> tuple[Any, Any, Tensor]:
        if i < self._n_base:
            x, y = self.base[i]
            return x, y, torch.tensor(-1)
        return self._blank[0], self._blank[1], torch.tensor(self._ids[i - self._n_base])


class GradientCanaryDataModule(TrainSetWrapper):
    """Wraps a LightningDataModule: training items become ``(x, y, canary_id)`` with the included canaries appended."""

    def __init__(self, base: pl.LightningDataModule, included: Tensor) -> None:
        super().__init__(base)
        self.included = included

    def wrap_train_set(self, dataset: Dataset) -> Dataset:
        """The base items tagged ``-1``, then one blank item per included canary."""
        return GradientCanaryDataset(dataset, self.included)


class GradientCanaryModule(pl.LightningModule):
    """A classifier plus m Dirac canary coordinates (see the module doc).

    Args:
        base: a LightningModule whose ``forward(x)`` returns logits and whose
            ``configure_optimizers`` returns one optimizer (or a dict/list holding it)
            and does not need ``self.trainer``. Its own ``training_step`` is replaced by
            mean cross-entropy.
        num_canaries: m.
        norm: the canary gradient norm; set it to the strategy's C.
    """

    def __init__(self, base: pl.LightningModule, num_canaries: int, norm: float) -> None:
        super().__init__()
        if num_canaries < 1 or not norm > 0:
            raise ValueError(f"need num_canaries ≥ 1 and norm > 0, got {num_canaries}, {norm}")
        self.base = base
        self.norm = float(norm)
        self.canary = nn.Embedding(num_canaries, 1)
        nn.init.zeros_(self.canary.weight)

    def forward(self, x: Tensor) -> Tensor:
        """The base classifier's logits."""
        return self.base(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Mean over the batch of CE (real examples) or C·w_i (canary i)."""
        x, y, ids = batch
        real = ids < 0
        ce = nn.functional.cross_entropy(self.base(x), y, reduction="none")
        dirac = self.norm * self.canary(ids.clamp(min=0)).squeeze(-1)
        return torch.where(real, ce, dirac).mean()

    def configure_optimizers(self) -> Any:
        """The base's optimizer with the canary table added as a parameter group (no weight decay)."""
        config = self.base.configure_optimizers()
        _find_optimizer(config).add_param_group({"params": list(self.canary.parameters()), "weight_decay": 0.0})
        return config

    def scores(self) -> np.ndarray:
        """[m] -w_i: how far each canary coordinate moved against its gradient (higher ⇒ "in")."""
        return (-self.canary.weight.detach().double().flatten()).cpu().numpy()


def _find_optimizer(config: Any) -> Optimizer:
    if isinstance(config, Optimizer):
        return config
    if isinstance(config, dict) and isinstance(config.get("optimizer"), Optimizer):
        return config["optimizer"]
    if isinstance(config, (list, tuple)) and config:
        return _find_optimizer(config[0])
    raise ValueError(
        "GradientCanaryModule needs the base module's configure_optimizers to return an optimizer, "
        f"a dict with 'optimizer', or a list starting with one; got {type(config).__name__}"
    )

