"""Dropout inside attention and recurrent kernels, and batches padded to their longest example (the
DataCollatorWithPadding habit): the checks turn every dropout off (validators/probe.py, NoDropout) and compare a
random step's passes on batches of one shape (validators/batch_check.py, _replacement), so a model whose only
dependence on the batch is the layout of its random draws trains; examples that interact are still refused."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.validators.probe import NoDropout

STEPS = 8

_g = torch.Generator().manual_seed(0)
SEQUENCES = [torch.randint(1, 50, (int(torch.randint(3, 20, (1,), generator=_g)),), generator=_g) for _ in range(64)]
LABELS = [int(s.sum() % 2) for s in SEQUENCES]


class Texts(Dataset):
    def __len__(self) -> int:
        return len(SEQUENCES)

    def __getitem__(self, i: int):
        return SEQUENCES[i], LABELS[i]


def pad_to_longest(batch):
    """The batch padded to its own longest sequence, with a mask of the real tokens."""
    length = max(len(s) for s, _ in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.bool)
    for row, (s, _) in enumerate(batch):
        ids[row, :len(s)], mask[row, :len(s)] = s, True
    return ids, mask, torch.tensor([label for _, label in batch])


class Encoder(pl.LightningModule):
    """Embedding, one TransformerEncoderLayer with its default dropout 0.1 and a key padding mask, masked mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(16, 2)

    def features(self, ids, mask):
        h = self.enc(self.emb(ids), src_key_padding_mask=~mask) * mask.unsqueeze(-1)
        return h.sum(1) / mask.sum(1, keepdim=True)

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        return F.cross_entropy(self.fc(self.features(ids, mask)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class TokenDropping(Encoder):
    """Augmentation in training_step: a random tenth of the tokens dropped, drawn on the padded [B, L] layout."""

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        ids = ids.masked_fill(torch.rand(ids.shape) < 0.1, 0)
        return F.cross_entropy(self.fc(self.features(ids, mask)), y)


class CentredFeatures(Encoder):
    """Features centred on the batch's mean: every example's gradient depends on the others."""

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        h = self.features(ids, mask)
        return F.cross_entropy(self.fc(h - h.mean(0)), y)


class BatchNormed(Encoder):
    """A BatchNorm in training mode on the pooled features."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        return F.cross_entropy(self.fc(self.norm(self.features(ids, mask))), y)


class MixedFeatures(TokenDropping):
    """MixUp of the pooled features across the batch, on top of the token dropping."""

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        ids = ids.masked_fill(torch.rand(ids.shape) < 0.1, 0)
        h = self.features(ids, mask)
        perm = torch.randperm(len(h))
        logits = self.fc(0.6 * h + 0.4 * h[perm])
        return 0.6 * F.cross_entropy(logits, y) + 0.4 * F.cross_entropy(logits, y[perm])


def fit(model: pl.LightningModule) -> DPStrategy:
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, verify="every_step")
    loader = DataLoader(Texts(), batch_size=16, collate_fn=pad_to_longest)
    quiet_trainer(strategy=strategy, max_steps=STEPS).fit(model, loader)
    return strategy


def test_no_dropout_reaches_the_dropout_of_attention_and_recurrent_kernels():
    """nn.MultiheadAttention draws its dropout inside multi_head_attention_forward, where a mode handling that
    function is not active; the recurrent layers pass it to their kernel: both are off under NoDropout."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2], batch_first=True)
    layers = {
        "encoder layer": (nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True), lambda m: m(x)),
        "attention": (nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True), lambda m: m(x, x, x)[0]),
        "attention without weights": (nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True),
                                      lambda m: m(x, x, x, need_weights=False)[0]),
        "lstm": (nn.LSTM(16, 16, num_layers=2, dropout=0.5, batch_first=True), lambda m: m(x)[0]),
        "gru": (nn.GRU(16, 16, num_layers=2, dropout=0.5, batch_first=True), lambda m: m(x)[0]),
        "rnn": (nn.RNN(16, 16, num_layers=2, dropout=0.5, batch_first=True), lambda m: m(x)[0]),
        "packed lstm": (nn.LSTM(16, 16, num_layers=2, dropout=0.5, batch_first=True), lambda m: m(packed)[0].data),
    }
    for name, (layer, call) in layers.items():
        with NoDropout():
            torch.manual_seed(0)
            first = call(layer)
            torch.manual_seed(1)
            second = call(layer)
        assert torch.equal(first, second), f"{name}: dropout still on"
        torch.manual_seed(0)
        assert not torch.equal(call(layer), second), f"{name}: its dropout is on outside the mode"


@pytest.mark.parametrize("factory", [Encoder, TokenDropping])
def test_dropout_and_random_draws_laid_out_by_the_padded_length_train(factory):
    """The masks' shape follows the batch's longest example, not the other examples' values: no interaction. Each of
    the 8 steps is checked (the random halves and replacements differ from check to check)."""
    strategy = fit(factory())
    assert strategy.ledger.steps == STEPS and strategy.private_step.schedule.checks == STEPS


@pytest.mark.parametrize("factory", [CentredFeatures, BatchNormed, MixedFeatures])
def test_examples_that_interact_are_refused_with_dropout_and_dynamic_padding(factory):
    model = factory()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match="Examples interact|mixes examples in training mode"):
        fit(model)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"


def test_attention_dropout_does_not_make_the_step_look_random():
    """With its dropout off, the encoder layer draws nothing: the probe compares each example in the batch and alone
    (not only the coarse checks of a random step) and the batch check splits the batch in halves."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = fit(Encoder())
    assert not strategy.private_step._random_step
    assert not [w for w in caught if "draws random numbers" in str(w.message)]
