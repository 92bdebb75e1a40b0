"""Fixed-shape batches: every physical batch has exactly F rows, the Poisson batch's examples then padding.

**Why.** A Poisson batch has a random size (B ± √B), so every step brings new shapes: ``torch.compile`` recompiles
or falls back to dynamic shapes, and a CUDA graph cannot be replayed. With ``fixed_batch_size=F`` every physical
batch is F rows, always.

**The mechanism is unchanged, exactly.** Nothing is truncated and nothing is added to the sample:

* a step whose Poisson sample holds n ≤ F examples runs one physical batch: its n examples, then F − n padding
  rows (:func:`chunks`);
* a step with n > F examples runs ⌈n / F⌉ physical batches of F rows (the last one padded), banked and released
  once, as ``max_physical_batch_size`` does;
* a padding row is a record of the dataset with every number in it set to zero (:func:`zeroed`): no record's
  data. It runs through the forward and the backward like an example, but its clip factor is 0
  (:func:`~lightning_dp.grad_sample.base.clip_from_parts`), so it adds exactly 0 to Σ_i c_i g_i; and
  the first step's probe (example independence, verified before any release) guarantees it changes no example's
  gradient. The engine's norms and count are those of the n examples.

So the release is the same function of the same Poisson sample as without padding, and the ledger's accounting
(the sampled Gaussian mechanism at rate q with noise σ) holds as it is: **no δ is added**. What it costs is
compute: F − n padding rows per step (F = B + 3√B leaves about one step in 700 with an extra physical batch).
Two effects are not private and are the user's to know: the loss Lightning logs is the mean over the F rows
(padding rows included), and the time a step takes shows whether it needed an extra physical batch (n > F) —
the same kind of signal as ``max_physical_batch_size``'s, and a step's duration is not part of the release.

**Why truncation is refused.** Truncated Poisson sampling (Chua et al. 2024, "Scalable DP-SGD: Shuffling vs.
Poisson Subsampling", NeurIPS, arXiv 2411.04205; a tighter analysis in arXiv 2508.15089; ``jax_privacy``'s
``truncated_dpsgd_event``) keeps at most B_max examples and drops the rest. It is another mechanism M' than the
Poisson one M, and the simplest sound account of it adds to δ: couple M' and M on the same randomness; they differ
only on the event E that some step's sample exceeds B_max, and by a union bound over the T steps
P(E) ≤ η_T = T · P[Binomial(N + 1, q) > B_max] (N + 1: the larger of two neighbouring datasets). For neighbours
D, D' and any set S of outputs,

    P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + η_T ≤ e^ε P[M(D') ∈ S] + δ + η_T ≤ e^ε P[M'(D') ∈ S] + δ + (1 + e^ε) η_T,

so M' is (ε, δ + (1 + e^ε) η_T)-DP whenever M is (ε, δ)-DP. The ledger, σ's calibration, ``target_epsilon`` and
``PrivacyBudget`` all state (ε, δ) of the Poisson mechanism; none of them carries that extra term yet, so a
truncated step would be released under a guarantee that does not hold. Until they do, an overflowing step runs one
more padded physical batch (exact) and truncation is not offered.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from lightning_dp.records.fetch import fetch


def check_fixed_batch_size(size: Any) -> int:
    """``size`` as F ≥ 1, or ``ValueError``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError("fixed_batch_size must be a positive integer (the rows of every physical batch), "
                         f"got {size!r}")
    return size


def chunks(indices: Sequence[int], size: int) -> list[tuple[list[int], int]]:
    """The physical batches of one step: (examples, padding rows) with len(examples) + padding = ``size`` each;
    one batch of ``size`` padding rows for an empty sample (the shapes stay fixed)."""
    parts = [list(indices[start:start + size]) for start in range(0, len(indices), size)] or [[]]
    return [(part, size - len(part)) for part in parts]


def zeroed(record: Any) -> Any:
    """``record`` with every number zeroed (tensors, NumPy arrays, ints and floats; nested tuples, lists and dicts):
    a padding row of the dataset's structure that holds no record's data. Strings and other objects stay."""
    if isinstance(record, torch.Tensor):
        return torch.zeros_like(record)
    if isinstance(record, np.ndarray):
        return np.zeros_like(record)
    if isinstance(record, bool):
        return record
    if isinstance(record, (int, float, np.number)):
        return type(record)(0)
    if isinstance(record, dict):
        return {k: zeroed(v) for k, v in record.items()}
    if isinstance(record, tuple) and hasattr(record, "_fields"):
        return type(record)(*(zeroed(v) for v in record))
    if isinstance(record, (list, tuple)):
        return type(record)(zeroed(v) for v in record)
    return record


class PaddedCollate:
    """Wraps a collate function: a batch of n ≤ F records is collated with F − n padding records after them
    (:func:`zeroed` copies of the dataset's record 0, read as the loader reads it); a batch of more than F records
    is collated as it is (the strategy splits it into padded physical batches). Picklable, for loader workers.

    Args:
        dataset: where the padding record's structure is read (record 0, zeroed).
        rows: F.
        collate_fn: the user's collate function (default: torch's).
    """

    def __init__(self, dataset: Dataset, rows: int, collate_fn: Callable[[Sequence[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.rows = check_fixed_batch_size(rows)
        self.collate_fn = collate_fn or default_collate
        self._padding: Any = None

    def padding(self, count: int) -> list[Any]:
        """``count`` padding records."""
        if self._padding is None:
            self._padding = zeroed(fetch(self.dataset, [0])[0])
        return [self._padding] * count

    def __call__(self, records: Sequence[Any]) -> Any:
        records = list(records)
        if len(records) <= self.rows:
            records += self.padding(self.rows - len(records))
        return self.collate_fn(records)
