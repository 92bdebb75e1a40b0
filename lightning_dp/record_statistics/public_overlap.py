"""Data declared public that are the private training records: ``PublicPretraining(dataset)`` given the training set
(itself, a ``Subset`` overlapping it, its rows copied into a new ``TensorDataset``), or a loop inside
``lightning_dp.public_steps()`` over the training records.

Steps declared public are not counted by any ledger (:mod:`lightning_dp.records.outside_steps`): on private records
they are releases without noise, and the model is not differentially private whatever σ the DP fit counts. Two
checks compare the declared-public data with the training records, before the first release:

* :func:`check_public_dataset` — ``PublicPretraining`` at the fit's ``setup``, before it trains, when the training
  loader is known then (given to ``fit`` or by a LightningDataModule): its dataset is the training dataset or wraps
  it, or selects indices of the dataset the training ``Subset`` selects from that the training set selects too, or a
  clear share of up to :data:`SAMPLED` of its items' inputs (evenly spaced) are training rows;
* :func:`check_public_steps` — when the private fit attaches: the rows the model's parameters were trained on
  inside ``public_steps()`` (:mod:`lightning_dp.records.public_inputs`; ``PublicPretraining``'s loop included) that
  are training rows.

A row is a training row when its bytes (in the training tensor's dtype; a float16 copy of float32 data in its own)
equal a row of a tensor the training dataset holds (:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_parts`),
through a chain of ``Subset`` s only the rows it selects (the held-out part of one tensor is not its training part).
What it cannot see: rows changed on the way (augmented, normalised by the dataset's ``__getitem__`` on one side
only), training tensors over :data:`~lightning_dp.records.held_records.MAX_DIGESTED` bytes, low-entropy training rows
(:data:`DISTINCT`), a public set of which less than :data:`REFUSED_SHARE` are training rows.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.records.held_records import DIGESTED_DTYPES, MAX_DIGESTED, row_digest_array
from lightning_dp.records.public_inputs import public_rows
from lightning_dp.records.subset_chain import subset_levels

SAMPLED = 256
"""Items of a declared-public dataset compared with the training rows."""

REFUSED_SHARE = 0.1
"""The share of the compared public rows (at least two of them) that are training rows from which the public data
are refused. Not zero: two independent datasets of one domain can share a few identical rows by nature (the same
public image in two scraped collections, a blank or near-blank form, low-resolution rows drawn independently), and
such sets must still train; that is well under a tenth of the rows in practice (FontDigits shares none of its 20,000
rows with scikit-learn's digits). A copy of the training rows, or a wrapper of it, is far above it. Two Subsets of
one dataset are compared by their indices instead (:func:`check_public_dataset`): one shared index is refused."""

DISTINCT = 0.9
"""The share of a training tensor's (selected) rows that must occur once in it for its rows to be compared: rows of
a few categories (binary or one-hot tabular features) recur within one dataset and across independent ones alike,
so a public row equal to one of them says nothing (a copy of such a training set is not recognised by its rows)."""


def check_public_dataset(public: Any, training: Any) -> None:
    """Refuse (:func:`public_overlap_error`) ``public``, a dataset declared public, when it is ``training`` or wraps
    it, or when a clear share of its sampled items' inputs are training rows."""
    if any(d is training for d in dataset_parts(public)[0]):
        raise public_overlap_error("PublicPretraining")
    (base, positions), (training_base, training_positions) = _subset_chain(public), _subset_chain(training)
    if base is training_base:  # two selections of one dataset: a shared index is a training record, not a look-alike
        if positions is None or training_positions is None or np.isin(positions, training_positions).any():
            raise public_overlap_error("PublicPretraining")
        return
    if refused(*training_rows_share(_sampled_inputs(public), training)):
        raise public_overlap_error("PublicPretraining")


def check_public_steps(params: Iterable[Any], training: Any) -> None:
    """Refuse (:func:`public_overlap_error`) when the rows ``params`` were trained on inside ``public_steps()`` are,
    in a clear share, ``training``'s rows."""
    rows = public_rows(params)
    if rows and refused(*training_rows_share(rows, training)):
        raise public_overlap_error("public_steps")


def refused(hits: int, compared: int) -> bool:
    """Whether ``hits`` training rows among ``compared`` public rows are a clear share (:data:`REFUSED_SHARE`)."""
    return hits >= 2 and hits >= REFUSED_SHARE * compared


def training_rows_share(rows: Sequence[Tensor], training: Any) -> tuple[int, int]:
    """How many of ``rows`` (not constant) are rows of the training tensors, and how many were compared."""
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for row in rows:
        groups.setdefault((tuple(row.shape), row.dtype), []).append(row)
    tensors = _training_tensors(training)
    hits = compared = 0
    for (shape, dtype), group in groups.items():
        candidate = torch.stack(group)
        flat = candidate.reshape(len(group), -1)
        varied = (flat != flat[:, :1]).any(1).numpy()  # a constant row (blank, padding) says nothing
        found = np.zeros(len(group), dtype=bool)
        for t, positions in tensors:
            if tuple(t.shape[1:]) != shape or t.dtype.is_floating_point != dtype.is_floating_point:
                continue
            reference = t.detach() if positions is None else t.detach()[torch.from_numpy(positions)]
            if dtype.is_floating_point and candidate.element_size() < t.element_size():
                reference, ours = reference.to(dtype), candidate  # a float16 copy of float32 rows
            else:
                ours = candidate.to(t.dtype)
            values, counts = np.unique(row_digest_array(reference), return_counts=True)
            if (counts == 1).sum() < DISTINCT * len(reference):
                continue  # low-entropy rows (a few categories): independent data share them by nature
            found |= np.isin(row_digest_array(ours), values[counts == 1])
        hits, compared = hits + int((found & varied).sum()), compared + int(varied.sum())
    return hits, compared


def _subset_chain(dataset: Any) -> tuple[Any, Optional[np.ndarray]]:
    """The dataset under a chain of ``Subset`` s and the positions in it they select (``None``: no Subset)."""
    base, positions = subset_levels(dataset)[-1]
    return base, None if positions is None else np.asarray(positions, dtype=np.int64)


def public_overlap_error(where: str) -> PrivacyConfigurationError:
    """The refusal of data declared public (``where``: ``PublicPretraining`` or ``public_steps``) that are training
    records."""
    what = ("PublicPretraining's dataset is the training set, a subset or wrapper of it, or holds a clear share of its "
            "rows." if where == "PublicPretraining" else "a clear share of the inputs the model was trained on inside "
            "lightning_dp.public_steps() are rows of the training set.")
    return PrivacyConfigurationError(
        f"Data declared public are records of the private training set: {what} "
        "Steps on public data are not counted by any ledger, so on "
        "private records they are releases without noise and the model would not be differentially private whatever "
        "σ this fit counts. Nothing was released. Pass public data (records that are not in the training set, e.g. "
        "another dataset of the same task), or train on these records privately (DPStrategy or a PrivateStep: their "
        "steps are then charged).")


def _training_tensors(training: Any) -> list[tuple[Tensor, Optional[np.ndarray]]]:
    """The tensors (at least two dimensions, digestible) the training dataset holds, each with the positions of its
    rows a chain of ``Subset`` s selects (``None``: all rows)."""
    base, positions = _subset_chain(training)
    try:
        size: Optional[int] = len(base)
    except TypeError:
        size = None
    return [(t, positions if positions is not None and t.shape[0] == size else None)
            for _, t in dataset_parts(base)[1]
            if t.dim() >= 2 and t.numel() and t.dtype in DIGESTED_DTYPES and t.layout == torch.strided
            and t.numel() * t.element_size() <= MAX_DIGESTED]


def _sampled_inputs(dataset: Any) -> list[Tensor]:
    """The inputs (first tensor or array of each item) of up to :data:`SAMPLED` items of ``dataset``, evenly spaced;
    none for a dataset without a length."""
    try:
        n = len(dataset)
    except TypeError:
        return []
    rows = []
    for i in np.unique(np.linspace(0, n - 1, min(n, SAMPLED)).round().astype(np.int64)) if n else ():
        item = dataset[int(i)]
        first = item[0] if isinstance(item, (tuple, list)) and item else \
            next(iter(item.values()), None) if isinstance(item, dict) else item
        if isinstance(first, np.ndarray) and first.dtype.kind in "fiub":
            first = torch.from_numpy(np.ascontiguousarray(first))
        if isinstance(first, Tensor) and first.dim() >= 1 and first.dtype in DIGESTED_DTYPES:
            rows.append(first.detach().cpu())
    return rows
