"""The special token ids (document starts, ends, padding) a model's configuration or a tokenizer declares, the
padding id token rows show when none is declared, and where the special ids split a row into pieces.

Hugging Face models carry them on ``model.config`` (and ``model.generation_config``): ``bos_token_id``,
``eos_token_id`` (an id or a list of ids), ``sep_token_id``, ``cls_token_id``, ``pad_token_id``; tokenizers carry
the same attributes. :func:`declared_ids` collects them from the objects a training run holds, :func:`inferred_pad`
finds an undeclared padding id and :func:`split_points` the pieces of a row, for the checks that read token rows
(:mod:`lightning_dp.validators.packed_records`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def declared_ids(holders: list[Any]) -> dict[str, set[int]]:
    """The special ids ("start", "end", "pad") declared by the holders' ``config``, ``generation_config`` or
    ``tokenizer`` (the holders' own and their submodules' first), or by a holder that is a tokenizer."""
    ids: dict[str, set[int]] = {"start": set(), "end": set(), "pad": set()}
    kinds = [("start", "bos"), ("start", "cls"), ("end", "eos"), ("end", "sep"), ("pad", "pad")]
    for holder in holders:
        for obj in [m for _, m in zip(range(64), holder.modules())] if hasattr(holder, "modules") else [holder]:
            for source in (obj, *(getattr(obj, a, None) for a in ("config", "generation_config", "tokenizer"))):
                for kind, name in kinds if source is not None else ():
                    value = getattr(source, f"{name}_token_id", None)
                    values = value if isinstance(value, (list, tuple)) else [value]
                    ids[kind] |= {int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)}
    ids["start"] -= ids["end"] | ids["pad"]  # GPT-2: bos = eos
    return ids


def inferred_pad(rows: list[Tensor], share: float) -> set[int]:
    """The id that ends (or starts) ``share`` of the rows or more as a run of two or more, and is not inside most of
    those rows besides (a text's spaces, an image's background are), if one does."""
    runs: dict[int, list[Tensor]] = {}
    for row in rows:
        for a, b in {(int(row[-1]), int(row[-2])), (int(row[0]), int(row[1]))}:
            if a == b:
                runs.setdefault(a, []).append(row)
    pad, held = max(runs.items(), key=lambda kv: len(kv[1]), default=(0, []))
    if len(held) < max(3, share * len(rows)):
        return set()
    inside = sum(bool((row[(row != pad).nonzero().min():(row != pad).nonzero().max() + 1] == pad).any())
                 for row in held if bool((row != pad).any()))
    return {pad} if inside < len(held) / 2 else set()


def split_points(content: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """The positions in ``content`` (a row without its leading and trailing padding) where a piece begins after a
    run of special ids inside the row: a run holding an end id, or start ids past position 0, followed by more ids
    (``a EOS b`` and ``BOS a EOS BOS b`` split once; ``BOS a EOS`` not)."""
    special = torch.isin(content, start) | torch.isin(content, end)
    after = (special[:-1] & ~special[1:]).nonzero().flatten() + 1  # the first ordinary id after each run
    if len(after) and bool(special[0]) and not bool(torch.isin(content[: int(after[0])], end).any()):
        after = after[1:]  # the row's opening start ids
    return after
