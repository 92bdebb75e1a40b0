"""PydocTextDataModule: next-token windows over pydoc_data's help text."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.data.pydoc_text import PydocTextDataModule, encode, pydoc_text, windows


def test_windows_are_shifted_by_one_token() -> None:
    tokens = torch.arange(23)
    ds = windows(tokens, seq_len=5)
    x, y = ds.tensors
    assert x.shape == (4, 5) and y.shape == (4, 5)  # (23 - 1) // 5 windows
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:-1, -1], x[1:, 0])  # consecutive, non-overlapping windows
    assert torch.equal(x.reshape(-1), tokens[:20])
    with pytest.raises(ValueError, match="shorter than one window"):
        windows(torch.arange(5), seq_len=5)


def test_byte_and_char_encodings_round_trip() -> None:
    text = "if x:\n    return 'é'"
    assert bytes(encode(text, "byte").tolist()).decode("utf-8") == text
    alphabet = "".join(sorted(set(text)))
    ids = encode(text, "char", alphabet)
    assert "".join(alphabet[i] for i in ids) == text
    with pytest.raises(ValueError, match="not in the alphabet"):
        encode("z", "char", "ab")
    with pytest.raises(ValueError, match="'byte' or 'char'"):
        encode(text, "word")  # type: ignore[arg-type]


def test_split_is_contiguous_head_and_tail_of_the_text() -> None:
    dm = PydocTextDataModule(seq_len=32, level="char", val_fraction=0.1)
    dm.setup()
    text = pydoc_text()
    assert dm.vocab_size == len(set(text)) and dm.vocab_size < 256
    cut = int(len(text) * 0.9)
    assert dm.decode(dm.train_set.tensors[0][0]) == text[:32]
    assert dm.decode(dm.val_set.tensors[0][0]) == text[cut : cut + 32]
    assert len(dm.train_set) == (cut - 1) // 32
    assert len(dm.val_set) == (len(text) - cut - 1) // 32
    assert "return" in text and len(text) > 100_000  # real English/Python prose ships with Python


def test_byte_level_loader_and_limits() -> None:
    dm = PydocTextDataModule(seq_len=16, batch_size=8, max_train_windows=40)
    dm.setup()
    assert dm.vocab_size == 256 and len(dm.train_set) == 40
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 16) and y.dtype == torch.long and int(x.max()) < 256
    assert len(next(iter(dm.val_dataloader()))[0]) <= 256


@pytest.mark.parametrize("kwargs, match", [({"level": "word"}, "'byte' or 'char'"), ({"val_fraction": 1.0}, "val_fraction"),
                                           ({"seq_len": 0}, "seq_len"), ({"max_train_windows": 0}, "max_train_windows")])
def test_bad_arguments_name_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PydocTextDataModule(**kwargs)
