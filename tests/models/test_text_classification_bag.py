"""The torchtext text-classification tutorial's model under DPStrategy: ``nn.EmbeddingBag(vocab, 16, mode="mean")``
on every example's tokens packed end to end with ``offsets`` (a collate that concatenates the token lists), then a
Linear head; it trains for a few private steps on CPU with the default engine (grad_sample/embedding_bag_rule.py)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp import DPStrategy

VOCAB, CLASSES = 40, 4


class TokenLists(Dataset):
    """Sentences of 2–12 token ids (some repeated), labelled by whether token 7 or 8 occurs."""

    def __init__(self, n: int = 96, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            tokens = torch.randint(1, VOCAB, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g)
            self.items.append((tokens, int((tokens == 7).any()) + 2 * int((tokens == 8).any())))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.items[i]


def collate_batch(batch: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """The tutorial's collate: the token lists concatenated, each one's start in ``offsets``."""
    tokens, labels = zip(*batch)
    offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
    return torch.cat(tokens), offsets, torch.tensor(labels)


class TextClassificationModel(pl.LightningModule):
    def __init__(self, vocab_size: int = VOCAB, embed_dim: int = 16, num_class: int = CLASSES) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean")
        self.fc = nn.Linear(embed_dim, num_class)

    def forward(self, text: Tensor, offsets: Tensor) -> Tensor:
        return self.fc(self.embedding(text, offsets))

    def training_step(self, batch, batch_idx: int) -> Tensor:
        text, offsets, label = batch
        return F.cross_entropy(self(text, offsets), label)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_the_tutorial_model_trains_privately_on_packed_bags():
    torch.manual_seed(0)
    model = TextClassificationModel()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0)
    loader = DataLoader(TokenLists(), batch_size=16, shuffle=True, collate_fn=collate_batch)
    quiet_trainer(strategy=strategy, max_steps=4).fit(model, loader)
    assert strategy.engine_name == "ghost"
    for b, p in zip(before, model.parameters()):
        assert torch.isfinite(p).all() and not torch.equal(b, p.detach())
