"""Packed token rows (validators/packed_records.py): documents joined and cut into blocks (run_clm's group_texts),
bin-packed several to a row, two texts padded and joined are warned of before the first release (PackedRecordsWarning;
refused when it is an error); one document per row — padded right or left, truncated, with pad = EOS —, BERT-style
pairs ``[CLS] a [SEP] b [SEP]``, multi-turn chats under one template, next-token windows of a text and images are
not (zoo20 g1)."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.errors import PackedRecordsWarning  # noqa: E402
from lightning_dp.validators.packed_records import packed_field, warn_packed_records  # noqa: E402

V, L, PAD, BOS, EOS, CLS, SEP = 60, 32, 0, 1, 2, 3, 4


def docs(n: int = 300, low: int = 4, high: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """Texts of ordinary ids (5 … V-1) of random lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, V, (int(torch.randint(low, high, (1,), generator=g)),), generator=g) for _ in range(n)]


def grouped(texts: list[torch.Tensor], eos: int = EOS) -> torch.Tensor:
    """run_clm's group_texts: every text followed by EOS, joined, cut into blocks of L."""
    stream = torch.cat([torch.cat([t, torch.tensor([eos])]) for t in texts])
    return stream[: len(stream) // L * L].view(-1, L)


def padded(texts: list[torch.Tensor], end: Optional[int] = EOS, pad: int = PAD, left: bool = False,
           start: Optional[int] = None) -> torch.Tensor:
    """One text per row: [start] text [end], truncated to L, padded right (or left) with ``pad``."""
    rows = []
    for t in texts:
        row = torch.cat([torch.tensor([start] if start is not None else [], dtype=torch.long), t,
                         torch.tensor([end] if end is not None else [], dtype=torch.long)])[:L]
        rows.append(F.pad(row, (L - len(row), 0) if left else (0, L - len(row)), value=pad))
    return torch.stack(rows)


def binpacked(texts: list[torch.Tensor], bos: Optional[int] = None) -> torch.Tensor:
    """Greedy first-fit packing of [bos] text EOS into rows of L, padded with PAD."""
    pieces = [torch.cat([torch.tensor([bos] if bos is not None else [], dtype=torch.long), t[: L - 2],
                         torch.tensor([EOS])]) for t in texts]
    bins: list[list[torch.Tensor]] = []
    for p in sorted(pieces, key=len, reverse=True):
        for b in bins:
            if sum(map(len, b)) + len(p) <= L:
                b.append(p)
                break
        else:
            bins.append([p])
    return torch.stack([F.pad(torch.cat(b), (0, L - sum(map(len, b))), value=PAD) for b in bins])


def joined_pairs(texts: list[torch.Tensor]) -> torch.Tensor:
    """Siamese pairs of consecutive texts, each padded to L/2, joined into one row (no declared ids)."""
    halves = [F.pad(t[: L // 2], (0, L // 2 - len(t[: L // 2])), value=PAD) for t in texts]
    return torch.stack([torch.cat([halves[2 * i], halves[2 * i + 1]]) for i in range(len(halves) // 2)])


def bert_pairs(texts: list[torch.Tensor]) -> torch.Tensor:
    """[CLS] a [SEP] b [SEP] [PAD]…: one record of two sentences."""
    rows = [torch.cat([torch.tensor([CLS]), texts[2 * i][:12], torch.tensor([SEP]), texts[2 * i + 1][:12],
                       torch.tensor([SEP])]) for i in range(len(texts) // 2)]
    return torch.stack([F.pad(r, (0, L - len(r)), value=PAD) for r in rows])


def chats(texts: list[torch.Tensor]) -> torch.Tensor:
    """Multi-turn conversations under one template: START turn EOS START turn EOS …, one conversation per row."""
    rows = []
    for i in range(0, len(texts) - 2, 3):
        turn_texts = texts[i: i + 1 + (i // 3) % 3]
        turns = [torch.cat([torch.tensor([CLS]), t[:6], torch.tensor([EOS])]) for t in turn_texts]
        rows.append(F.pad(torch.cat(turns)[:L], (0, L - len(torch.cat(turns)[:L])), value=PAD))
    return torch.stack(rows)


def config(**ids: Any) -> dict[str, set[int]]:
    found = {"start": set(), "end": set(), "pad": set()}
    for kind, value in ids.items():
        found[kind] = set(value) if isinstance(value, (set, list)) else {value}
    return found


INST, EINST, HEADER, END_HEADER, EOT = 60, 61, 62, 63, 64  # chat templates' markers (ids past the texts')


def prompt_response(texts: list[torch.Tensor], width: int = 48, trailing: bool = True) -> list[torch.Tensor]:
    """GPT-2 instruction tuning (qa9 c7): ``prompt EOS response EOS``, one example per row (GPT-2's only special id
    is EOS = BOS), unpadded."""
    return [torch.cat([texts[i][:20], torch.tensor([EOS]), texts[i + 1][:20], torch.tensor([EOS] if trailing else [],
                                                                                           dtype=torch.long)])[:width]
            for i in range(0, len(texts) - 1, 2)]


def llama2_chats(texts: list[torch.Tensor], turns: Any = lambda i: 2) -> list[torch.Tensor]:
    """Llama-2 chat (qa9 c3), one conversation per row: ``<s>[INST] q [/INST] a </s><s>[INST] q2 [/INST] a2 </s>``."""
    rows, i = [], 0
    while i + 2 * turns(i) <= len(texts):
        row = []
        for q, a in zip(texts[i: i + 2 * turns(i): 2], texts[i + 1: i + 2 * turns(i): 2]):
            row += [BOS, INST, *q[:6].tolist(), EINST, *a[:6].tolist(), EOS]
        rows.append(torch.tensor(row))
        i += 2 * turns(i)
    return rows


def llama3_chats(texts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Llama-3 chat (qa9 c2): ``<|begin_of_text|>`` then per message ``<|start_header_id|> role <|end_header_id|>
    text <|eot_id|>``; padded with ``<|end_of_text|>`` (= EOS), both EOS and ``<|eot_id|>`` declared ends."""
    rows = []
    for i in range(0, len(texts) - 2, 3):
        row = [BOS]
        for role, t in zip((7, 8, 9), texts[i: i + 3]):
            row += [HEADER, role, END_HEADER, *t[:6].tolist(), EOT]
        rows.append(torch.tensor(row))
    return rows


def rows_of(pieces: list[torch.Tensor], pad: int = PAD, width: int = 48) -> torch.Tensor:
    """The pieces padded right to ``width``."""
    return torch.stack([F.pad(p[:width], (0, width - len(p[:width])), value=pad) for p in pieces])


def stream(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces joined and cut into blocks of L (TRL's ConstantLengthDataset, group_texts over formatted records)."""
    joined = torch.cat(pieces)
    return joined[: len(joined) // L * L].view(-1, L)


PACKED = {
    "group_texts": (lambda: grouped(docs()), dict(end=EOS)),
    "group_texts, pad = eos": (lambda: grouped(docs()), dict(end=EOS, pad=EOS)),
    "binpacked with EOS": (lambda: binpacked(docs(low=3, high=12)), dict(end=EOS, pad=PAD)),
    "binpacked with BOS": (lambda: binpacked(docs(low=3, high=12), bos=BOS), dict(start=BOS, end=EOS, pad=PAD)),
    "padded pairs joined": (lambda: joined_pairs(docs(low=4, high=30)), {}),
    "group_texts, BOS and EOS per text": (lambda: grouped([torch.cat([torch.tensor([BOS]), t]) for t in docs()]),
                                          dict(start=BOS, end=EOS)),
    "prompt/response records cut into blocks": (lambda: stream(prompt_response(docs())), dict(end=EOS)),
    "Llama-2 chats cut into blocks": (lambda: stream(llama2_chats(docs())), dict(start=BOS, end=EOS, pad=PAD)),
    "binpacked, pad = eos": (lambda: binpacked(docs(low=3, high=12)).masked_fill(binpacked(docs(low=3, high=12)) == PAD,
                                                                                  EOS), dict(end=EOS)),
}

ONE_EACH = {
    "padded right": (lambda: padded(docs()), dict(end=EOS, pad=PAD)),
    "padded left": (lambda: padded(docs(), left=True), dict(end=EOS, pad=PAD)),
    "pad = eos, no declared pad": (lambda: padded(docs(), end=EOS, pad=EOS), dict(end=EOS)),
    "BOS … EOS, undeclared pad": (lambda: padded(docs(), start=BOS), dict(start=BOS, end=EOS)),
    "truncated, nothing declared": (lambda: padded(docs(low=L, high=3 * L), end=None), {}),
    "short texts, nothing declared": (lambda: padded(docs(low=3, high=12)), {}),
    "BERT pairs": (lambda: bert_pairs(docs()), dict(start=CLS, end=SEP, pad=PAD)),
    "multi-turn chats": (lambda: chats(docs()), dict(end=EOS, pad=PAD)),
    "next-token windows of one text": (lambda: torch.randint(5, V, (300 * L,)).view(-1, L), {}),
    "GPT-2 prompt EOS response EOS, pad = eos": (lambda: rows_of(prompt_response(docs()), EOS), dict(end=EOS)),
    "the same, pad = eos declared": (lambda: rows_of(prompt_response(docs()), EOS), dict(end=EOS, pad=EOS)),
    "the same, padded with PAD": (lambda: rows_of(prompt_response(docs())), dict(end=EOS, pad=PAD)),
    "the same, left-padded": (lambda: rows_of([r.flip(0) for r in prompt_response(docs())], EOS).flip(1),
                              dict(end=EOS)),
    "Llama-2 two-turn chats": (lambda: rows_of(llama2_chats(docs())), dict(start=BOS, end=EOS, pad=PAD)),
    "Llama-2 chats of 1 to 4 turns": (lambda: rows_of(llama2_chats(docs(), lambda i: 1 + i % 4), width=64),
                                      dict(start=BOS, end=EOS, pad=PAD)),
    "Llama-3 chats": (lambda: rows_of(llama3_chats(docs()), EOS, 64), dict(start=BOS, end=[EOS, EOT], pad=EOS)),
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_rows_are_found(name: str) -> None:
    rows, ids = PACKED[name]
    assert packed_field(TensorDataset(rows()), config(**ids)) is not None


@pytest.mark.parametrize("name", sorted(ONE_EACH))
def test_one_document_per_row_is_not(name: str) -> None:
    rows, ids = ONE_EACH[name]
    assert packed_field(TensorDataset(rows()), config(**ids)) is None


def test_images_and_labels_are_not_token_rows() -> None:
    """Digit-like images as integers (a background of zeros around a stroke over many rows) and labels."""
    g = torch.Generator().manual_seed(0)
    images = torch.zeros(200, 16, 16, dtype=torch.long)
    for k in range(200):
        top, left = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        images[k, top: top + 10, left: left + 4] = torch.randint(50, 255, (10, 4), generator=g)
    labels = torch.randint(0, 10, (200,), generator=g)
    assert packed_field(TensorDataset(images.flatten(1), labels), config()) is None
    assert packed_field(TensorDataset(images.float(), labels), config()) is None


def test_byte_windows_of_english_text_are_not() -> None:
    """Windows of 8 bytes of the pydoc pages: spaces end or start some windows as a run (indentation), but are
    scattered through the text, not at one offset: not padding inside the rows."""
    from lightning_dp.data.pydoc_text import encode, pydoc_text, windows

    assert packed_field(windows(encode(pydoc_text(), "byte"), 8), config()) is None


def test_dict_records_and_id_lists() -> None:
    """Hugging Face-style records: ``input_ids`` as lists of ints beside a mask and -100 labels."""
    class Records(Dataset):
        def __init__(self, rows: torch.Tensor) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            ids = self.rows[i].tolist()
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] + ids[1:]}

    assert packed_field(Records(grouped(docs())), config(end=EOS)) == "token ids (input_ids)"
    assert packed_field(Records(padded(docs())), config(end=EOS, pad=PAD)) is None


def test_unpadded_rows_of_one_record_each() -> None:
    """Rows of their own lengths (a collate pads them): ``prompt EOS response`` without a closing EOS does not end
    with an end id, yet rows of several lengths are not blocks cut from a stream."""
    class Records(Dataset):
        def __init__(self, rows: list[torch.Tensor]) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.rows[i].tolist()}

    assert packed_field(Records(prompt_response(docs(), trailing=False)), config(end=EOS)) is None
    assert packed_field(Records(llama2_chats(docs(), lambda i: 1 + i % 3)), config(start=BOS, end=EOS)) is None
    assert packed_field(Records(list(binpacked(docs(low=3, high=12)))), config(end=EOS)) is not None


def test_ids_are_read_from_a_submodule_config_and_a_collate_tokenizer() -> None:
    rows = TensorDataset(grouped(docs()))
    hf = nn.Module()
    hf.config = types.SimpleNamespace(eos_token_id=[EOS, 99], bos_token_id=EOS, pad_token_id=None)
    holder = nn.Module()
    holder.model = hf
    with pytest.warns(PackedRecordsWarning, match="Users"):
        warn_packed_records(holder, rows)
    collate = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eos_token_id=EOS, sep_token_id=None))
    with pytest.warns(PackedRecordsWarning):
        warn_packed_records(nn.Linear(1, 1), rows, types.SimpleNamespace(collate_fn=collate))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackedRecordsWarning)
        warn_packed_records(nn.Linear(1, 1), rows)  # no declared EOS: the blocks cannot be told from texts


class TinyLM(pl.LightningModule):
    """Next-token prediction over the rows; its config declares EOS (and PAD) as a Hugging Face model's does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(V, 8), nn.Linear(8, V)
        self.config = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return F.cross_entropy(self.out(self.emb(ids[:, :-1])).reshape(-1, V), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rows: torch.Tensor, model: Optional[TinyLM] = None) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(model or TinyLM(), DataLoader(TensorDataset(rows), batch_size=16))
    return dp


def test_a_fit_on_grouped_texts_warns_and_trains() -> None:
    with pytest.warns(PackedRecordsWarning, match="look packed"):
        dp = _fit(grouped(docs()))
    assert dp.ledger.steps == 2


def test_made_an_error_the_fit_is_refused_before_any_release() -> None:
    model = TinyLM()
    before = parameters(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackedRecordsWarning)
        with pytest.raises(PrivacyConfigurationError, match="PackedRecordsWarning is an error"):
            _fit(binpacked(docs(low=3, high=12)), model)
    assert unchanged(before, model)


def test_one_document_per_row_trains_without_the_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackedRecordsWarning)
        dp = _fit(padded(docs()))
    assert dp.ledger.steps == 2
