"""Bias-corrected DP-Adam (DP-AdamBC) and its floor γ' on two small digits models at ε = 3 (issue 35, item 6).

DP-AdamBC divides by ``sqrt(max(v̂ − Φ̄, γ'))``. Where a coordinate's signal is below the noise (v̂ − Φ̄ ≤ γ', about
half of them early in training) it steps ``lr · m̂ / √γ'``, and m̂ is then mostly noise of size ≈ 0.23 √Φ̄. An
absolute γ' = 1e-8 (the paper's, tuned at Φ ≈ 2.4e-7) is ~1e-5 of the digits job's Φ ≈ 7e-4: such steps are
~2,000× the learning rate. The floor relative to the noise, γ' = gamma_phi · Φ̄ (the default, 0.1), keeps them near it.

For each model (the main job's ``DigitsCNN``; an LSTM reading the 8 rows of each image) the script trains
post-processing Adam and bias correction with absolute and relative floors over a few learning rates, under
``DPStrategy(target_epsilon=3, target_delta=1e-5)``, and prints a markdown table of test accuracy (mean over seeds;
the runs are short, so differences of a few points are noise). Choosing lr on these numbers is tuning on the test
split: they describe the floors' robustness, not a tuned result.

    python examples/bias_correction_floor.py                  # the docs/adam.md table: ≈ 23 min on a loaded 2-core machine
    python examples/bias_correction_floor.py --smoke          # CI: a few steps
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dp.accounting import forget_data_releases
from lightning_dp import AdamVariant, DPStrategy
from lightning_dp._warnings import quiet_lightning
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN

#: (label, variant, hyper-parameters) of the table's rows
ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("post_processing (Adam)", "post_processing", {}),
    ("bias_corrected γ' = 1e-8 (absolute)", "bias_corrected", {"gamma": 1e-8}),
    ("bias_corrected γ' = 1e-6 (absolute)", "bias_corrected", {"gamma": 1e-6}),
    ("bias_corrected γ' = 0.01·Φ̄", "bias_corrected", {"gamma_phi": 0.01}),
    ("bias_corrected γ' = 0.04·Φ̄", "bias_corrected", {"gamma_phi": 0.04}),
    ("bias_corrected γ' = 0.1·Φ̄ (default)", "bias_corrected", {}),
)
LRS = (0.001, 0.003, 0.01, 0.03)


class DigitsLSTM(pl.LightningModule):
    """Each 8×8 image as a sequence of its 8 rows through a one-layer LSTM; the last state classifies."""

    def __init__(self, lr: float = 0.01, hidden: int = 32) -> None:
        super().__init__()
        self.lr = lr
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 1×8×8 images."""
        h, _ = self.lstm(x.reshape(x.shape[0], 8, 8))
        return self.out(h[:, -1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Mean cross-entropy over the batch."""
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain Adam: AdamVariant swaps it."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    """Top-1 accuracy on a whole TensorDataset (eval mode)."""
    model.eval()
    x, y = dataset.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def train_once(model_name: str, variant: str, hparams: dict[str, Any], lr: float, seed: int, epochs: int,
               max_steps: int = -1) -> float:
    """Test accuracy of one private run (ε = 3, δ = 1e-5, C = 1, expected batch 64)."""
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=64, val_fraction=0.1)
    model = DigitsCNN(lr=lr, optimizer="adam", channels=16) if model_name == "cnn" else DigitsLSTM(lr)
    trainer = pl.Trainer(
        strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0), accelerator="cpu", devices=1,
        max_epochs=epochs, max_steps=max_steps, callbacks=[AdamVariant(variant, **hparams)], logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0)
    forget_data_releases()  # runs compared on the same records: each its own ε (docs/accounting.md, 'The data carry')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explosive floors' own warning is the point of two rows
        trainer.fit(model, datamodule=data)
    return accuracy(model, data.test_set)


def table(results: dict[tuple[str, str, float], list[float]], models: Sequence[str], lrs: Sequence[float]) -> str:
    """Markdown: one row per floor, one column per (model, lr): mean test accuracy in %."""
    header = "| variant | " + " | ".join(f"{m} lr {lr:g}" for m in models for lr in lrs) + " |"
    lines = [header, "|---" * (1 + len(models) * len(lrs)) + "|"]
    for label, _, _ in ROWS:
        cells = [f"{100 * statistics.fmean(results[(label, m, lr)]):.1f}" for m in models for lr in lrs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    """Run the sweep and print (and return) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "lstm"], choices=["cnn", "lstm"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="learning rates (columns)")
    parser.add_argument("--smoke", action="store_true", help="3 steps, one seed, one lr (CI)")
    args = parser.parse_args(argv)
    lrs, seeds, steps = ((0.01,), [0], 3) if args.smoke else (tuple(args.lrs), list(range(args.seeds)), -1)
    results: dict[tuple[str, str, float], list[float]] = {}
    with quiet_lightning():
        for label, variant, hparams in ROWS:
            for model_name in args.models:
                for lr in lrs:
                    results[(label, model_name, lr)] = [
                        train_once(model_name, variant, hparams, lr, seed, args.epochs, steps) for seed in seeds]
    text = table(results, args.models, lrs)
    print(text)
    return text


if __name__ == "__main__":
    main()
