"""A small CNN for 8×8 digits, as a LightningModule a user might have written."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy


class DigitsCNN(pl.LightningModule):
    """Two conv layers + one or two linear layers, GroupNorm (private-friendly), tanh activations.

    Tanh ("tempered sigmoid", Papernot et al. 2021) keeps activations, hence per-example
    gradient norms, bounded: less is lost to clipping than with ReLU.

    Args:
        lr: learning rate.
        optimizer: "sgd" (with ``momentum``) or "adam"/"adamw"/"adagrad".
        momentum: SGD momentum.
        channels: width of the first conv layer (the second has twice as many).
        hidden: width of a hidden linear layer before the output (0: none).
        num_classes: output classes.
    """

    def __init__(
        self,
        lr: float = 2.0,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        channels: int = 16,
        hidden: int = 0,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, got {optimizer!r}")
        self.save_hyperparameters()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.GroupNorm(min(4, c), c),
            nn.Tanh(),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.GroupNorm(min(4, 2 * c), 2 * c),
            nn.Tanh(),
            nn.AvgPool2d(2),
        )
        head: list[nn.Module] = [nn.Flatten()]
        width = 2 * c * 16
        if hidden:
            head += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        self.head = nn.Sequential(*head, nn.Linear(width, num_classes))
        # one public, data-free image: Lightning's model summary runs it to show each layer's sizes and FLOPs
        self.example_input_array = torch.zeros(1, 1, 8, 8)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 1×8×8 images."""
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        """Mean cross-entropy over the batch."""
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        """Accuracy and mean cross-entropy on the validation split (the dashboard draws val/loss beside train/loss)."""
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))

    def test_step(self, batch, batch_idx):
        """Accuracy on the test split."""
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        """The optimizer named in the hyper-parameters."""
        hp = self.hparams
        kwargs = {"lr": hp.lr, "weight_decay": hp.weight_decay}
        if hp.optimizer == "sgd":
            kwargs["momentum"] = hp.momentum
        return _OPTIMIZERS[hp.optimizer](self.parameters(), **kwargs)


_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
}
