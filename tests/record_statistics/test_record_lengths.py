"""The training records' lengths kept as a setting (record_statistics/record_lengths.py): a Hugging Face configuration's or
generation configuration's length, a hyper-parameter or a collator's tokenizer's ``model_max_length`` set to the
longest record's token count (or a high quantile of the counts) is refused before any release; a public width the
records are truncated to, a round cap and an unrelated number train."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.record_lengths import length_statistics, lengths_held, record_lengths  # noqa: E402

V, W = 40, 24


def token_data(truncate: int = 0, n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (0 pads) of records 3 to 10 tokens long and one of 19 (the longest), their attention mask and
    labels; ``truncate``: every record cut (and most padded) to that many tokens, a public width."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 11, (n,), generator=g)
    lengths[5] = 19
    width = truncate or W
    lengths = lengths.clamp(max=width) if not truncate else torch.full((n,), width).sub(lengths % 2)
    ids = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        ids[i, :lengths[i]] = torch.randint(1, V, (int(lengths[i]),), generator=g)
    return ids, (ids != 0).long(), (ids[:, 0] % 2).long()


class TokenModel(pl.LightningModule):
    """Mean-pooled embeddings and a linear head; ``config`` and ``generation_config`` like a Hugging Face model's."""

    def __init__(self, **lengths: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, 8), nn.Linear(8, 2)
        self.config = SimpleNamespace(model_type="toy", vocab_size=V, max_position_embeddings=W)
        self.generation_config = SimpleNamespace(max_new_tokens=None, max_length=20)
        for key, value in lengths.items():
            owner, _, name = key.rpartition("__")
            setattr(getattr(self, owner) if owner else self, name, value)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, y = batch
        pooled = (self.emb(ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return nn.functional.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: pl.LightningModule, data: tuple, **loader_kwargs: Any) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(model, DataLoader(TensorDataset(*data), batch_size=16,
                                                                   **loader_kwargs))
    return dp


LONGEST = 19


@pytest.mark.parametrize("lengths, what", [
    (dict(generation_config__max_new_tokens=LONGEST), "generation_config.max_new_tokens equals the longest"),
    (dict(config__max_length=LONGEST), "config.max_length equals the longest"),
    (dict(config__max_position_embeddings=LONGEST), "max_position_embeddings equals the longest"),
    (dict(max_len=LONGEST), "attribute max_len equals the longest"),
])
def test_a_length_set_from_the_longest_training_record_is_refused_before_any_release(lengths, what):
    model = TokenModel(**lengths)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{what}.*public value"):
        _fit(model, token_data())
    assert unchanged(before, model)


def test_a_collators_tokenizer_holding_the_longest_length_is_refused():
    class Collate:
        def __init__(self) -> None:
            self.tokenizer = SimpleNamespace(model_max_length=LONGEST, padding_side="right")

        def __call__(self, rows: list) -> list:
            return [torch.stack(column) for column in zip(*rows)]

    with pytest.raises(PrivacyConfigurationError, match=r"loader\.collate_fn\.tokenizer\.model_max_length equals"):
        _fit(TokenModel(), token_data(), collate_fn=Collate())


def test_hyper_parameters_saved_from_the_data_are_refused():
    class Saved(TokenModel):
        def __init__(self, max_len: int) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(PrivacyConfigurationError, match=r"_hparams\['max_len'\] equals the longest"):
        _fit(Saved(LONGEST), token_data())


def test_a_public_width_a_round_cap_and_other_numbers_train():
    """Records truncated to 13 tokens reach that width whatever the data: a length of 13 is a public setting; 128
    and 20 are round; 17 is no statistic of these lengths."""
    truncated = token_data(truncate=13)
    assert _fit(TokenModel(config__max_length=13, max_len=13), truncated).ledger.steps == 2
    model = TokenModel(config__max_length=128, generation_config__max_new_tokens=20, max_len=17)
    assert _fit(model, token_data()).ledger.steps == 2


def test_lengths_are_counted_from_a_mask_and_from_either_padded_end():
    ids, mask, _ = token_data()
    found = record_lengths([("ids", ids), ("mask", mask), ("left", ids.flip(1))])
    assert [p for p, _, _ in found] == ["ids", "mask", "left"]
    assert all(int(lengths.max()) == LONGEST and width == W for _, lengths, width in found)
    assert all(torch.equal(lengths, mask.sum(1)) for _, lengths, _ in found)
    stats = dict((v, w) for w, v in length_statistics(mask.sum(1), W))
    assert stats[LONGEST] == "the longest training record's length" and W not in stats


def test_a_high_quantile_of_the_lengths_is_found():
    lengths = torch.arange(1, 41)  # the 0.95 quantile is 38.05: 38 (floored, rounded, lower) or 39 (ceiled, higher)
    mask = (torch.arange(48)[None] < lengths[:, None]).long()
    for value in (38, 39):
        assert lengths_held([("attribute cfg.max_seq_len", value)], [("mask", mask)]) == [
            "attribute cfg.max_seq_len equals the 0.95 quantile of the training records' lengths (of the training "
            "mask)"]
    assert lengths_held([("attribute cfg.max_seq_len", 33)], [("mask", mask)]) == []


def test_a_declared_length_and_a_length_not_named_so_are_left_alone():
    _, mask, _ = token_data()
    assert lengths_held([("attribute cfg.max_length", LONGEST)], [("mask", mask)], public=["cfg.max_length"]) == []
    assert lengths_held([("attribute cfg.hidden_size", LONGEST)], [("mask", mask)]) == []
    assert lengths_held([("attribute cfg.max_length", LONGEST)], [("mask", mask)]) == [
        "attribute cfg.max_length equals the longest training record's length (of the training mask)"]


def test_the_width_less_room_for_special_tokens_is_a_public_setting():
    """``max_seq_length = 48 - 2`` (room for [CLS] and [SEP] in rows of 48) is the public width's, even where a high
    quantile of the lengths falls on it (qa9 h1); three below the width is still judged."""
    lengths = torch.arange(9, 49)  # the longest is the width; the 0.95 quantile 46 or 47, the 0.9 one 44 or 45
    mask = (torch.arange(48)[None] < lengths[:, None]).long()
    for value in (46, 47):
        assert lengths_held([("dataset TextDS.max_seq_length", value)], [("mask", mask)]) == []
    assert lengths_held([("dataset TextDS.max_seq_length", 45)], [("mask", mask)]) == [
        "dataset TextDS.max_seq_length equals the 0.9 quantile of the training records' lengths (of the training mask)"]
