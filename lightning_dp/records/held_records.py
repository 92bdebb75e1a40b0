"""Whether a value holds the training records: a 64-bit digest of each of a training tensor's rows, and the match of a
candidate's rows (or of its image under one affine map) against them.

The checks that look for copies of the training data outside a step ask it: the copies exchanged around a step
(:mod:`lightning_dp.record_checks.outside_records`), the validation data that are training records
(:mod:`lightning_dp.validators.monitored`), the records a checkpoint or the model's state keeps
(:mod:`lightning_dp.record_statistics.data_statistics`)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor, nn

ROWS_SAMPLED = 16
"""Rows of a candidate copy looked up in the training tensor's row digests."""

MAX_DIGESTED = 1 << 28
"""Training tensors of more bytes get no row digests (their copies elsewhere are not looked for)."""

DIGESTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                             torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
"""The dtypes whose rows are digested: those whose copies can be exchanged in place
(:mod:`lightning_dp.record_checks.outside_records`)."""


def row_digests(t: Tensor, rounded: Optional[torch.dtype] = None) -> Optional[set[int]]:
    """A 64-bit digest of every row (along dimension 0) of a training tensor of at least two dimensions that occurs
    once in it (a row many records share — a one-hot category — is nobody's), or ``None`` (1-D, empty, too large:
    :data:`MAX_DIGESTED`). ``rounded``: of its rows rounded to that narrower floating-point type (a float16 copy)."""
    if t.dim() < 2 or t.numel() == 0 or t.shape[0] < 2 or t.numel() * t.element_size() > MAX_DIGESTED \
            or t.dtype not in DIGESTED_DTYPES:
        return None
    key = (t._version, tuple(t.shape), t.data_ptr())
    cached = _DIGESTS.get((id(t), rounded))
    if cached is not None and cached[0]() is t and cached[1] == key:
        return cached[2]
    values, counts = np.unique(row_digest_array(t if rounded is None else t.detach().to(rounded)), return_counts=True)
    unique = set(values[counts == 1].tolist())
    if len(_DIGESTS) >= 8:
        _DIGESTS.pop(next(iter(_DIGESTS)))
    _DIGESTS[(id(t), rounded)] = (weakref.ref(t), key, unique)
    return unique


_DIGESTS: dict[tuple[int, Optional[torch.dtype]], tuple[Any, tuple[Any, ...], set[int]]] = {}
"""The last few training tensors' row digests (each checked to be the same tensor, version, shape and memory): the
validation check asks at every release."""


def row_digest_array(t: Tensor) -> np.ndarray:
    """A 64-bit digest of each row (along dimension 0) of ``t``, in order, repeated rows included (unlike
    :func:`row_digests`): the row's bytes as 64-bit words (zero-padded), combined with fixed odd multipliers
    (wrapping). Equal rows of the same dtype and width digest alike, in any tensor and any run."""
    rows = t.detach().to("cpu").contiguous().reshape(t.shape[0], -1)
    if rows.dtype == torch.bfloat16:  # no NumPy type: its bits
        rows = rows.view(torch.int16)
    raw = rows.numpy().view(np.uint8).reshape(rows.shape[0], -1)
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((raw.shape[0], pad), np.uint8)], axis=1)
    words = raw.view(np.uint64)
    multipliers = np.random.default_rng(0x5EED).integers(1, 1 << 62, words.shape[1], dtype=np.uint64) * 2 + 1
    with np.errstate(over="ignore"):
        return (words * multipliers).sum(axis=1, dtype=np.uint64) ^ np.uint64(words.shape[1])


def holds_records(value: Any, data: Tensor, rows: Optional[set[int]]) -> bool:
    """Whether ``value`` holds ``data``'s contents: equal to it (a label tensor; in value, when one holds integers and
    the other floats: labels kept as ``float64``), rows of it (half of the sampled
    rows, at least two, found among ``data``'s row digests — or among those of its rows rounded to the value's
    narrower floating-point type: a float16 copy of float32 data), or — of its shape — its image under one affine
    map a·x + b (:func:`_affine_image`: the raw pixels of data scaled by 1/255, features standardised by constants).
    A matrix wider than ``data``'s holds it if its first or last columns do (features and labels concatenated)."""
    candidate = _as_tensor(value)
    if candidate is None or candidate.dim() != data.dim():
        return False
    if data.dim() == 2 and candidate.shape[1] > data.shape[1] and rows is not None:
        width = data.shape[1]
        return any(holds_records(block, data, rows) for block in (candidate[:, :width], candidate[:, -width:]))
    if tuple(candidate.shape[1:]) != tuple(data.shape[1:]):
        return False
    if candidate.shape == data.shape and data.dim() >= 2 and _affine_image(candidate, data):
        return True
    if candidate.dtype.is_floating_point != data.dtype.is_floating_point:  # labels kept as floats (or the reverse):
        return data.dim() == 1 and candidate.numel() >= 8 and candidate.shape == data.shape \
            and bool(torch.equal(candidate.cpu().double(), data.detach().cpu().double()))  # equal in value
    if rows is not None and candidate.dtype.is_floating_point and candidate.element_size() < data.element_size():
        rows = row_digests(data, candidate.dtype)
    else:
        candidate = candidate.to(data.dtype)
    if rows is None:
        return data.dim() == 1 and candidate.numel() >= 8 and candidate.shape == data.shape \
            and bool(torch.equal(candidate.cpu(), data.detach().cpu()))
    n = candidate.shape[0]
    sample = candidate[np.linspace(0, n - 1, min(n, ROWS_SAMPLED)).round().astype(np.int64)] if n else candidate
    if sample.shape[0] == 0:
        return False
    flat = sample.reshape(sample.shape[0], -1)
    varied = (flat != flat[:, :1]).any(1).tolist()  # a constant row (zeros: an empty queue) says nothing
    hits = sum(v and int(d) in rows for d, v in zip(row_digest_array(sample).tolist(), varied))
    return (hits >= 2 and 2 * hits >= sample.shape[0]) or (n == 1 and hits == 1)


def _affine_image(candidate: Tensor, data: Tensor) -> bool:
    """Whether ``candidate``'s rows are ``data``'s rows, in the same order, under one map y = a·x + b (a ≠ 0), to
    float precision: fitted on :data:`ROWS_SAMPLED` rows spread over both (at least two of them not constant)."""
    n = data.shape[0]
    picked = np.linspace(0, n - 1, min(n, ROWS_SAMPLED)).round().astype(np.int64)
    x = data.detach()[picked].reshape(len(picked), -1).to("cpu", torch.float64)
    y = candidate[picked].reshape(len(picked), -1).to("cpu", torch.float64)
    if int((x != x[:, :1]).any(1).sum()) < 2 or not bool(torch.isfinite(x).all() and torch.isfinite(y).all()):
        return False
    xc, yc = x - x.mean(), y - y.mean()
    spread = float((xc * xc).sum())
    if spread == 0.0:
        return False
    a = float((xc * yc).sum()) / spread
    if a == 0.0:
        return False
    residual = float((yc - a * xc).abs().max())
    return residual <= 1e-5 * max(float(y.abs().max()), 1e-30)


def _as_tensor(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):  # a plain dense tensor (a DTensor shard is compared by no one here)
        return value.detach() if type(value) in (Tensor, nn.Parameter) and value.layout == torch.strided \
            and value.numel() else None
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub" and value.size:
        return torch.from_numpy(np.ascontiguousarray(value))
    return None
