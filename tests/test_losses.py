"""lightning_dp.losses.per_example_token_mean: each example's own mean over its non-ignored tokens, for a language
model's [B, T, V] logits and for a segmentation model's [B, C, H, W] logits with [B, H, W] masks (void pixels at
ignore_index): a loss DPStrategy trains, where cross_entropy's batch-wide mean over the valid pixels is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError, per_example_token_mean

VOID = 250


def test_segmentation_logits_average_each_images_own_valid_pixels():
    g = torch.Generator().manual_seed(0)
    logits, mask = torch.randn(3, 4, 5, 6, generator=g), torch.randint(0, 4, (3, 5, 6), generator=g)
    mask[0, :2] = VOID
    mask[2] = VOID  # an image with no valid pixel counts 0
    got = per_example_token_mean(logits, mask, ignore_index=VOID)
    for i in range(2):
        valid = mask[i] != VOID
        expected = F.cross_entropy(logits[i].permute(1, 2, 0)[valid], mask[i][valid])
        torch.testing.assert_close(got[i], expected)
    assert got[2] == 0
    three_d = torch.randn(2, 4, 5, 6, 2, generator=g), torch.randint(0, 4, (2, 5, 6, 2), generator=g)
    assert per_example_token_mean(*three_d).shape == (2,)


def test_token_logits_are_unchanged_and_other_shapes_refused():
    logits, y = torch.randn(2, 3, 5), torch.tensor([[1, 2, -100], [0, -100, -100]])
    torch.testing.assert_close(per_example_token_mean(logits, y)[1], F.cross_entropy(logits[1, :1], y[1, :1]))
    with pytest.raises(ValueError, match=r"\[B, C, H, W, …\]"):
        per_example_token_mean(torch.randn(2, 4, 5, 6), torch.randint(0, 4, (2, 5)))


class Segmenter(__import__("pytorch_lightning").LightningModule):
    """Lightning's semantic-segmentation template, shrunk: per-pixel cross-entropy with void pixels."""

    def __init__(self, per_image: bool) -> None:
        super().__init__()
        self.per_image = per_image
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 3, 1))

    def training_step(self, batch, batch_idx):
        image, mask = batch
        if self.per_image:
            return per_example_token_mean(self.net(image), mask, ignore_index=VOID)
        return F.cross_entropy(self.net(image), mask, ignore_index=VOID)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


def _segmentation_data(seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(64, 1, 8, 8, generator=g)
    mask = (image[:, 0] > 0).long() + (image[:, 0] > 1).long()
    mask[torch.rand(64, 8, 8, generator=g) < torch.rand(64, 1, 1, generator=g) * 0.6] = VOID  # void varies by image
    return DataLoader(TensorDataset(image, mask), batch_size=16)


def test_a_segmentation_model_trains_on_per_image_means_and_the_batch_mean_is_refused_naming_them():
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=3).fit(Segmenter(per_image=True), _segmentation_data())
    assert dp.ledger.steps == 3
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)Examples interact.*segmentation.*\[B, C, H, W\]"):
        quiet_trainer(strategy=dp, max_steps=3).fit(Segmenter(per_image=False), _segmentation_data(seed=1))
    assert dp.ledger.steps == 0
