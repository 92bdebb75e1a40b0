"""The special token ids a model's config or a tokenizer declares (records/special_ids.py): read from the holders and
their submodules' ``config``/``generation_config``/``tokenizer``; EOS lists kept whole; a BOS that is also the EOS
(GPT-2) is an end, not a start."""

from __future__ import annotations

import types

from torch import nn

from lightning_dp.records.special_ids import declared_ids


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
