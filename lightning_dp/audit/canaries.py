"""Input-space canaries for the one-run audit (Steinke, Nasr & Jagielski 2023, Alg. 1; docs/algorithms.md §8).

m canaries are out-of-distribution inputs with random labels (random ±a pixels for
images, random ±a features for tables): examples a model only fits by memorising them.
Each is included in the training set independently with probability ½, by a public coin
drawn from a recorded seed that nothing else in training depends on. After training,
each canary is scored by its loss (lower loss ⇒ more likely "in"); optionally by the
drop of its loss from a reference model (the initial weights), which removes the
canary-to-canary spread of the starting loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.audit._wrapped_data import TrainSetWrapper
from lightning_dp.privacy.sampling import secure_seed


@dataclass(frozen=True)
class InputCanaries:
    """m canary examples and their inclusion coins.

    Attributes:
        inputs: [m, *input_shape] canary inputs.
        labels: [m] canary labels (long).
        included: [m] bool, the coins: ``True`` means S_i = +1 (in the training set).
        seed: the seed the canaries and coins were drawn from (recorded for scoring).
    """

    inputs: Tensor
    labels: Tensor
    included: Tensor
    seed: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_included(self) -> int:
        """How many canaries are in the training set."""
        return int(self.included.sum())


def draw_coins(m: int, seed: int) -> Tensor:
    """[m] bool: each canary in with probability ½ (S_i = +1), from its own generator seeded by ``seed``."""
    if m < 1:
        raise ValueError(f"need at least one canary, got m={m}")
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(m, generator=gen) < 0.5


def make_input_canaries(
    m: int,
    input_shape: Sequence[int],
    num_classes: int,
    seed: Optional[int] = None,
    amplitude: float = 1.0,
) -> InputCanaries:
    """m random ±``amplitude`` inputs with uniformly random labels, and their coins.

    Args:
        m: number of canaries.
        input_shape: shape of one input (e.g. ``(1, 8, 8)`` for digits, ``(d,)`` for tables).
        num_classes: labels are drawn uniformly from ``range(num_classes)``.
        seed: recorded seed; ``None`` draws one from the OS.
        amplitude: pixel/feature magnitude (1.0 = the edge of digits' [-1, 1] range).
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be ≥ 2, got {num_classes}")
    if not amplitude > 0:
        raise ValueError(f"amplitude must be > 0, got {amplitude}")
    seed = secure_seed() if seed is None else int(seed)
    included = draw_coins(m, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # a stream separate from the coins
    signs = torch.randint(0, 2, (m, *input_shape), generator=gen).float() * 2 - 1
    labels = torch.randint(0, num_classes, (m,), generator=gen)
    return InputCanaries(amplitude * signs, labels, included, seed)


class CanaryDataset(Dataset):
    """``base`` followed by the included canaries, as ``(x, y)`` items.

    Note: the training-set size becomes N + (#included), so q = B/N moves by at most
    m/N relative between neighbouring coin draws; keep m ≪ N.
    """

    def __init__(self, base: Dataset, canaries: InputCanaries) -> None:
        self.base = base
        self.canaries = canaries
        self._index = torch.nonzero(canaries.included).flatten().tolist()
        self._n_base = len(base)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._n_base + len(self._index)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if i < self._n_base:
            return self.base[i]
        j = self._index[i - self._n_base]
        return self.canaries.inputs[j], self.canaries.labels[j]


class CanaryDataModule(TrainSetWrapper):
    """Wraps a LightningDataModule: its training set gets the included canaries; other splits unchanged."""

    def __init__(self, base: pl.LightningDataModule, canaries: InputCanaries) -> None:
        super().__init__(base)
        self.canaries = canaries

    def wrap_train_set(self, dataset: Dataset) -> Dataset:
        """The base training set followed by the included canaries."""
        return CanaryDataset(dataset, self.canaries)

    @property
    def val_dataloader(self) -> Any:  # type: ignore[override]
        """The wrapped module's validation hook, or ``None`` when it defines none (Lightning then
        skips validation instead of warning about an empty loader)."""
        return self.base.val_dataloader if is_overridden("val_dataloader", self.base) else None

    def test_dataloader(self) -> Any:
        """The wrapped module's test loader."""
        return self.base.test_dataloader()


@torch.no_grad()
def canary_losses(model: nn.Module, canaries: InputCanaries, batch_size: int = 512) -> Tensor:
    """[m] cross-entropy of each canary under ``model`` (``model(x)`` must return logits), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out = []
        for start in range(0, len(canaries), batch_size):
            x = canaries.inputs[start:start + batch_size].to(device)
            y = canaries.labels[start:start + batch_size].to(device)
            out.append(nn.functional.cross_entropy(model(x), y, reduction="none").cpu())
        return torch.cat(out)
    finally:
        model.train(was_training)


def loss_scores(final_losses: Tensor, reference_losses: Optional[Tensor] = None) -> np.ndarray:
    """Scores for :func:`~lightning_dp.audit.bound.audit_from_scores` (higher ⇒ guess "in").

    ``-loss``, or ``reference_loss - loss`` (the loss drop) when the losses under a
    data-independent reference model (e.g. the initial weights) are given.
    """
    scores = -final_losses.double()
    if reference_losses is not None:
        if reference_losses.shape != final_losses.shape:
            raise ValueError("reference_losses must have one entry per canary, like final_losses")
        scores = scores + reference_losses.double()
    return scores.numpy()
