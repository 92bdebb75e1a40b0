"""Records that hold several documents: packed or grouped token rows (rule 8 of docs/release_boundary.md).

Token rows built by joining documents — ``run_clm``'s ``group_texts`` (documents joined with EOS, cut into blocks),
bin-packing several short documents into one row, two texts padded and joined — hold pieces of several documents:
removing one document changes many records, so DP per record does not bound one document's (one person's) influence.
:func:`warn_packed_records` reads :data:`SAMPLED` records spread over the dataset (within :data:`MAX_SECONDS`), takes
their 1-D integer fields of :data:`MIN_LENGTH` ids or more (``input_ids`` first; not masks, ids with -100, floats),
strips each row's leading and trailing padding (the ``pad_token_id`` declared, else
:func:`~lightning_dp.records.special_ids.inferred_pad`) and counts the rows holding several documents:

* rows split into pieces by declared ids (:func:`~lightning_dp.records.special_ids.split_points`: an end id —
  ``eos``/``sep_token_id`` — or a start id — ``bos``/``cls_token_id`` — inside the row, followed by more ids), unless
  the pieces are one record's parts: the rows start alike (90 %) and the pieces begin with one or two ids (a chat
  template's ``[INST]``, a role's header: the turns of one conversation), or 90 % of the rows hold as many pieces
  (``prompt EOS response EOS``, ``[CLS] a [SEP] b [SEP]``) and the rows start alike or are not blocks cut from a
  stream (half of them full-length and ending in neither padding nor an end id, as ``group_texts`` leaves them);
* padding inside the row, the content resuming at one offset in most such rows (two texts padded to fixed widths),
  in at most two runs (an image's background, a text's spaces are scattered).

Ids are those the model's (or a submodule's) ``config``/``generation_config``/``tokenizer``, the dataset's or the
collate's ``tokenizer`` declare. :data:`SHARE` of the rows or more: :class:`~lightning_dp.errors.PackedRecordsWarning`
(a refusal when made an error). Not seen: documents joined with no id between them (or with ids not declared), pairs
kept as two fields of a record, conversations under one template or a fixed number of texts per row bin-packed whole.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_dp.errors import PackedRecordsWarning, warn_or_refuse
from lightning_dp.records.fetch import fetch, seeded
from lightning_dp.records.special_ids import declared_ids, inferred_pad, split_points

SAMPLED, MIN_LENGTH, SHARE, MAX_SECONDS = 256, 8, 0.05, 2.0
"""Records read (spread evenly), the fewest ids of a field looked at, the share of rows holding several documents
that warns, the seconds spent reading (the rows read by then are judged)."""


def warn_packed_records(module: Any, dataset: Any, loader: Any = None) -> None:
    """Warn (module docstring), or refuse when :class:`~lightning_dp.errors.PackedRecordsWarning` is an error."""
    found = packed_field(dataset, declared_ids([module, dataset, getattr(loader, "collate_fn", None)]))
    if found is None:
        return
    message = (f"The training records' {found} look packed: several documents, or pieces of them, per record "
               "(texts joined and cut into blocks as group_texts does, short texts bin-packed into one row, two texts "
               "joined). The guarantee is per record: removing one document changes every record holding a piece of "
               "it. To protect documents or people, give each record one document (padded or truncated; a long one "
               "cut into chunks of its own) and train with DPStrategy(privacy_unit=Users(<document or person id of "
               "each record>, users_per_batch=k)) (docs/user_level.md), or do not pack. To refuse such fits: "
               "warnings.simplefilter(\"error\", lightning_dp.errors.PackedRecordsWarning); if each record is one "
               "person's by design, filter the warning out.")
    warn_or_refuse(PackedRecordsWarning, message)


def packed_field(dataset: Any, ids: dict[str, set[int]]) -> Optional[str]:
    """The name of a field whose rows hold several documents (module docstring), or ``None``."""
    rows: dict[str, list[Tensor]] = {}
    for name, row in _sampled_fields(dataset):
        rows.setdefault(name, []).append(row)
    for name, found in sorted(rows.items(), key=lambda kv: kv[0] != "input_ids"):
        if _packed(found, ids):
            return f"token ids ({name})"
    return None


def _sampled_fields(dataset: Any) -> Iterator[tuple[str, Tensor]]:
    """(field name, ids) of the sampled records' token-id fields."""
    try:
        n = len(dataset)
    except TypeError:
        return
    deadline = time.monotonic() + MAX_SECONDS
    count = min(n, SAMPLED)
    for position in sorted({round(k * (n - 1) / max(1, count - 1)) for k in range(count)}):
        if time.monotonic() > deadline:
            return
        try:
            with seeded(0):
                items = fetch(dataset, [position])
        except Exception:  # noqa: BLE001  (a record the other checks judge)
            return
        record = items[0] if isinstance(items, list) and len(items) == 1 else items
        fields = record.items() if isinstance(record, dict) else (
            enumerate(record) if isinstance(record, (tuple, list)) and not _ids(record) else [("", record)])
        for key, value in fields:
            row = torch.as_tensor(value) if _ids(value) else value
            if (isinstance(row, Tensor) and row.dim() == 1 and len(row) >= MIN_LENGTH
                    and row.dtype in (torch.int64, torch.int32, torch.int16) and int(row.min()) >= 0
                    and int(row.max()) > 1):
                yield str(key) if key != "" else "ids", row


def _ids(value: Any) -> bool:  # a list of token ids (a Hugging Face dataset's rows unformatted)
    return isinstance(value, list) and len(value) >= MIN_LENGTH and all(type(v) is int for v in value[:MIN_LENGTH])


def _packed(rows: list[Tensor], ids: dict[str, set[int]]) -> bool:
    """Whether :data:`SHARE` of the ``rows`` hold several documents (module docstring)."""
    pad, start, end = (torch.tensor(sorted(ids_), dtype=torch.int64)
                       for ids_ in (ids["pad"] or inferred_pad(rows, SHARE), ids["start"], ids["end"]))
    firsts, resumes, pieces, followers = Counter(), Counter(), Counter(), Counter()
    longest, cut, scattered = max(len(row) for row in rows), 0, 0
    for row in rows:
        gaps = torch.isin(row.long(), pad)
        where = (~gaps).nonzero().flatten()
        if not len(where):
            continue
        content, gaps = row[int(where[0]): int(where[-1]) + 1].long(), gaps[int(where[0]): int(where[-1]) + 1]
        firsts[int(content[0])] += 1
        after = split_points(content, start, end)
        pieces[len(after)] += 1
        followers.update(content[after].tolist())
        cut += len(row) == longest and not bool(torch.isin(row[-1:].long(), torch.cat([pad, end])).any())
        back = (gaps[:-1] & ~gaps[1:]).nonzero().flatten()  # where the content resumes after padding inside
        if 0 < len(back) <= 2:
            resumes[int(where[0] + back[0]) + 1] += 1  # two texts padded to fixed widths: at one offset
        scattered += len(back) > 2
    counted = sum(firsts.values())
    if not counted:
        return False
    alike = firsts.most_common(1)[0][1] >= 0.9 * counted  # a [CLS], a chat template's first token
    marked = sum(n for _, n in followers.most_common(2)) >= 0.9 * sum(followers.values())  # [INST], a role's id
    count, same = pieces.most_common(1)[0]  # prompt EOS response, [CLS] a [SEP] b [SEP]: as many pieces in all rows
    fixed = count > 0 and same >= 0.9 * counted and (alike or 2 * cut < counted)  # not blocks cut from a stream
    one_each = bool(followers) and ((alike and marked) or fixed)
    split = 0 if one_each else counted - pieces[0]
    padded = resumes.most_common(1)[0][1] if resumes and not one_each else 0  # pad = EOS: the pieces' EOS
    if scattered >= sum(resumes.values()) or 2 * padded < sum(resumes.values()):
        padded = 0  # not at one offset, or scattered through the rows: an image's background, a text's spaces
    return max(split, padded) >= max(2, SHARE * counted)
