"""The data ledger's row digests at a fit's start against a one-epoch fit: ``python benchmarks/data_digests.py``.

50,000 tabular rows, then 10,000 images as a TensorDataset and as a custom Dataset (one thread). Figures go in
docs/results/performance_log.md, "The data ledger's row digests at a fit's start".
"""

from __future__ import annotations

import time
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.accounting import data_ledgers
from lightning_dp.validators.evaluated_records import note_training


class MLP(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Items(Dataset):
    """A map-style dataset indexing tensors it holds (not a TensorDataset)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def case(name: str, dataset: Dataset, width: int) -> None:
    loader = DataLoader(dataset, batch_size=256)
    start = time.perf_counter()
    population = note_training(loader)
    identifying = time.perf_counter() - start
    start = time.perf_counter()
    data_ledgers.data_use(*population)
    digests = time.perf_counter() - start
    data_ledgers._clear()
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu")
    start = time.perf_counter()
    trainer.fit(MLP(width), loader)
    fit = time.perf_counter() - start
    data_ledgers._clear()
    total = identifying + digests
    print(f"{name}: identifying rows {identifying:.3f} s, float32/sorted digests {digests:.3f} s, together "
          f"{total:.3f} s = {100 * total / fit:.1f} % of a one-epoch fit ({fit:.1f} s, {trainer.global_step} steps)",
          flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, 20, generator=g)
    case("tabular 50k x 20, TensorDataset", TensorDataset(x, (x[:, 0] > 0).long()), 20)
    images, labels = torch.randn(10_000, 3, 32, 32, generator=g), torch.randint(0, 2, (10_000,), generator=g)
    case("images 10k x 3x32x32, TensorDataset", TensorDataset(images, labels), 3 * 32 * 32)
    case("images 10k x 3x32x32, custom Dataset", Items(images, labels), 3 * 32 * 32)


if __name__ == "__main__":
    main()
