"""The training records' lengths kept as a setting (rule 11, with :mod:`.data_statistics`): a Hugging Face
``config.max_length``, ``generation_config.max_new_tokens`` or ``max_position_embeddings``, a tokenizer's
``model_max_length`` or a hyper-parameter ``max_len`` set to the longest training record's token count, or to a
high quantile of the counts, before the fit. The longest record's length is that one record's; kept on the model,
it is released with it.

A record's length is its count of tokens that are not padding: the row sums of a 2-D 0/1 tensor (an attention
mask), and for a 2-D integer tensor of ids the width less the run of padding at its right (or left) end, padding
being the most common id in the last (first) column; the end padded is the one with the longer runs. The
statistics are the maximum and the 0.9, 0.95, 0.98 and 0.99 quantiles (lower, higher, and the linear one floored,
ceiled and rounded). A statistic equal to the tensor's width, or to it less one or two, is never matched: records
truncated to a public width reach it whatever the data; ``max_seq_length = 64 - 2`` leaves room for [CLS] and [SEP].
The settings compared are integers held by the model's modules, their configuration objects, the datamodule, the
training datasets and the loader's collator (:func:`~.data_statistics.held_candidates`), named like a length (``len``,
``position``, ``tokens``, ``n_ctx``, ``block_size``, ``context``, ``seq``), unless round (a multiple of 8 or of 10)
or under 8: a person's setting (512, 128, 20) or too small to tell. Not seen: a length rounded up or padded by a
margin of its own (the longest record plus two special tokens), lengths of records held as lists of ids (padded in
the collate), and a longest record of a round length.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Sequence

from torch import Tensor

from lightning_dp.fingerprints.public_names import is_public

_NAME = re.compile(r"len|position|tokens|n_ctx|block_size|context|seq", re.IGNORECASE)
_LEVELS = (0.9, 0.95, 0.98, 0.99)


def record_lengths(tensors: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor, int]]:
    """(path, the records' lengths, the tensor's width) for each 2-D integer tensor of the training data that has a
    padded end (ids) or holds only 0 and 1 (a mask)."""
    out = []
    for path, t in tensors:
        if t.dim() != 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.shape[0] < 2 or t.shape[1] < 2:
            continue
        x = t.detach().cpu().long()
        if bool(((x == 0) | (x == 1)).all()):
            out.append((path, x.sum(1), x.shape[1]))
            continue
        runs = []
        for ids in (x, x.flip(1)):  # padded at the right end, or at the left
            pad = int(ids[:, -1].mode().values)
            runs.append((ids == pad).long().flip(1).cumprod(1).sum(1))  # the run of padding at the end
        padding = max(runs, key=lambda run: int(run.sum()))  # the padded end: the longer runs
        if int((padding > 0).sum()) >= 2:
            out.append((path, x.shape[1] - padding, x.shape[1]))
    return out


def length_statistics(lengths: Tensor, width: int) -> Iterator[tuple[str, int]]:
    """The maximum and high quantiles of ``lengths`` (module docstring), those of ``width`` less 0, 1 or 2 left out."""
    s = lengths.sort().values.double()
    n = len(s)
    found = {int(s[-1]): "the longest training record's length"}
    for p in _LEVELS:
        h = p * (n - 1)
        low, high = s[int(h)], s[min(int(h) + 1, n - 1)]
        linear = float(low + (h - int(h)) * (high - low))
        for v in (float(low), float(high), linear // 1, -(-linear // 1), round(linear)):
            found.setdefault(int(v), f"the {p:g} quantile of the training records' lengths")
    yield from ((what, v) for v, what in found.items() if not 0 <= width - v <= 2)


def lengths_held(candidates: Iterable[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]],
                 public: Sequence[str] = ()) -> list[str]:
    """The length-named integer settings among ``candidates`` ((path, value)) equal to a length statistic of the
    training ``tensors``' records, as findings."""
    stats = [(f"{what} (of the training {path.lstrip('.') or 'tensor'})", v)
             for path, lengths, width in record_lengths(tensors) for what, v in length_statistics(lengths, width)]
    found: list[str] = []
    seen: set[tuple[str, int]] = set()  # a configuration every submodule holds: named once
    if not stats:
        return found
    for path, value in candidates:
        name = re.split(r"[.\[\]' ]+", path.rstrip("]'"))[-1]
        if not isinstance(value, int) or isinstance(value, bool) or not _NAME.search(name) or _round_length(value) \
                or is_public(path.partition(" ")[2] or path, public) or is_public(name, public):
            continue
        line = next((f"{path} equals {what}" for what, v in stats if v == value), None)
        if line is not None and (name, value) not in seen:
            seen.add((name, value))
            found.append(line)
    return found


def _round_length(value: int) -> bool:
    """A length a person sets (512, 128, 20, 100) or too small to tell a record by."""
    return value < 8 or value % 8 == 0 or value % 10 == 0
