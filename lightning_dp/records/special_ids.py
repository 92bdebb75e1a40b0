"""The special token ids (document starts, ends, padding) a model's configuration or a tokenizer declares.

Hugging Face models carry them on ``model.config`` (and ``model.generation_config``): ``bos_token_id``,
``eos_token_id`` (an id or a list of ids), ``sep_token_id``, ``cls_token_id``, ``pad_token_id``; tokenizers carry
the same attributes. :func:`declared_ids` collects them from the objects a training run holds, for the checks that
read token rows (:mod:`lightning_dp.validators.packed_records`).
"""

from __future__ import annotations

from typing import Any


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
