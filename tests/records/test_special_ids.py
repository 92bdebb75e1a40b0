"""The special token ids a model's config or a tokenizer declares (records/special_ids.py): read from the holders and
their submodules' ``config``/``generation_config``/``tokenizer``; EOS lists kept whole; a BOS that is also the EOS
(GPT-2) is an end, not a start; an undeclared padding id inferred from the rows' ends; the points where special ids
split a row into pieces."""

from __future__ import annotations

import types

import torch
from torch import nn

from lightning_dp.records.special_ids import declared_ids, inferred_pad, split_points


def test_a_submodule_config_and_generation_config() -> None:
    inner = nn.Linear(2, 2)
    inner.config = types.SimpleNamespace(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=None, sep_token_id=True)
    inner.generation_config = types.SimpleNamespace(eos_token_id=9)
    outer = nn.Sequential(inner)
    assert declared_ids([outer]) == {"start": {1}, "end": {2, 7, 9}, "pad": set()}


def test_a_tokenizer_held_by_a_collate_and_gpt2s_shared_bos() -> None:
    collate = types.SimpleNamespace(tokenizer=types.SimpleNamespace(bos_token_id=50256, eos_token_id=50256,
                                                                     pad_token_id=50256, cls_token_id=None))
    assert declared_ids([nn.Linear(1, 1), None, collate]) == {"start": set(), "end": {50256}, "pad": {50256}}


def test_nothing_declared() -> None:
    assert declared_ids([nn.Linear(1, 1), object()]) == {"start": set(), "end": set(), "pad": set()}


def _points(row: list[int], start: list[int], end: list[int]) -> list[int]:
    return split_points(torch.tensor(row), torch.tensor(start, dtype=torch.long),
                        torch.tensor(end, dtype=torch.long)).tolist()


def test_split_points() -> None:
    bos, eos = 1, 2
    assert _points([bos, 7, 8, eos], [bos], [eos]) == []  # one text, opened and closed
    assert _points([7, 8, eos, 9, 10, eos], [], [eos]) == [3]  # prompt EOS response EOS
    assert _points([bos, 5, 7, eos, bos, 5, 9, eos], [bos], [eos]) == [5]  # </s><s> between turns: one split
    assert _points([eos, 7, 8, bos, 9], [bos], [eos]) == [1, 4]  # a block cut from a stream
    assert _points([7, 8, 9], [bos], []) == []


def test_inferred_pad() -> None:
    padded = [torch.tensor([5 + k, 6, 7] + [0] * (3 + k % 3)) for k in range(20)]
    assert inferred_pad(padded, 0.05) == {0}
    gpt2 = [torch.tensor([5 + k, 9, 2, 6, 7, 2] + [2] * (3 + k % 3)) for k in range(20)]
    assert inferred_pad(gpt2, 0.05) == set()  # the padding id is inside every row too: not only padding
    assert inferred_pad([torch.tensor([5 + k, 6, 7, 8]) for k in range(20)], 0.05) == set()
