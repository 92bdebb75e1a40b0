"""Rows computed by the library's DP preprocessing, and the releases a fit training on them must be charged.

:class:`~lightning_dp.data.PrivateStandardizer` and :class:`~lightning_dp.data.PrivateImputer` release statistics of
the data they are fitted on (Gaussian mechanism) and charge them to the ledger they are given. Features they
transform depend on those releases: a fit that trains on them spends their ε too, so its ledger must hold their
entries (by :attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`). A ledger of their own (``.fit(X,
PrivacyLedger())``, the docstring's form) or another ``DPStrategy``'s (a notebook's strategy re-created in the Trainer
cell) leaves the fit's reported ε short of what the trained model spent.

Their ``transform`` calls :func:`note_transformed`: each output row the transform changed is noted, by a digest of its
values as float32 (so a cast, ``.numpy()`` or ``.double()``, keeps it), with the digest of the row it came from, the
releaser's run and whether its noise followed a generator the caller gave; the same digests note the rows' lineage
for :mod:`.row_lineage` (one pass over the rows for both). :func:`uncharged_transforms` reads, before
a fit's first release, the float items its training datasets store (:func:`~.stored_records.stored_items`): a row
found among the notes is traced back through chained transforms (an imputer's output standardised), and every release
on its way whose run the fit's ledger lacks is a finding. Under ``secure_mode`` a release drawn from a seeded
generator is one too.

The digest is :mod:`.row_lineage`'s value digest (the data ledgers' provenance of the same transforms, which maps a
row to the records it came from, not to the releases it depends on). The notes live in this process,
:data:`MAX_NOTED` rows at most (the oldest transform calls are dropped first). Not seen: rows changed after the
transform (``Z * 2``: new bytes), and transforms run at fetch time (in ``__getitem__`` or a collate: the stored items
hold the raw features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional

import numpy as np
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.row_lineage import float32_rows, note_derived, own_rows
from lightning_dp.record_checks.stored_records import row_digests, stored_items

MAX_NOTED = 1 << 22
"""The most output rows kept noted, process-wide (16 bytes each)."""

DEPTH = 8
"""The longest chain of transforms traced back."""


@dataclass(frozen=True)
class Transform:
    """One transform call's releaser: its class name, its run and whether its noise was seeded by the caller."""

    name: str
    run: str
    seeded: bool


_NOTED: list[tuple[Transform, np.ndarray, np.ndarray]] = []  # (releaser, output digests, input digests)
_LOOKUP: dict[str, Any] = {"built": None}


def float_rows(value: Any) -> Optional[np.ndarray]:
    """A digest per row (dimension 0) of a float tensor or array's values as float32 (−0 as 0): :mod:`.row_lineage`'s
    value digest; ``None`` for other values and for a single number."""
    t = float32_rows(value) if _floats(value) else None
    return None if t is None else row_digests(t)


def _floats(value: Any) -> bool:
    return (isinstance(value, np.ndarray) and value.dtype.kind == "f") \
        or (isinstance(value, Tensor) and value.dtype.is_floating_point)


def note_transformed(releaser: Any, inputs: Any, outputs: Any) -> None:
    """Note that each changed row of ``outputs`` was computed by ``releaser`` (a fitted DP preprocessor with a
    ``run`` and a ``generator``) from the same row of ``inputs`` (module docstring), and, for the data ledgers, that
    its records are the input row's (:func:`~.row_lineage.note_derived`): one digest pass of each feeds both notes."""
    came_own, made_own = own_rows(inputs), own_rows(outputs)
    note_derived(inputs, outputs, (came_own, made_own))
    made = made_own[0] if made_own is not None and _floats(outputs) else None
    came = came_own[0] if came_own is not None and _floats(inputs) else None
    if made is None or getattr(releaser, "run", None) is None:
        return
    if came is None or len(came) != len(made):
        came = np.zeros_like(made)
    new = made != came  # a row it left as it was (no missing cell) does not depend on the release
    if new.any():
        seeded = getattr(releaser, "generator", None) is not None
        _NOTED.append((Transform(type(releaser).__name__, releaser.run, seeded), made[new], came[new]))
        total = sum(len(m) for _, m, _ in _NOTED)
        while len(_NOTED) > 1 and total > MAX_NOTED:
            total -= len(_NOTED.pop(0)[1])
        _LOOKUP["built"] = None


def _lookup() -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(output digests sorted, their input digests, their note's index), ``None`` when nothing is noted. Among equal
    output digests the newest note comes first (two releasers drawing the same seeded noise on the same rows make the
    same rows: the one called last is taken)."""
    if not _NOTED:
        return None
    if _LOOKUP["built"] is None:
        newest = list(reversed(range(len(_NOTED))))
        outs = np.concatenate([_NOTED[k][1] for k in newest])
        ins = np.concatenate([_NOTED[k][2] for k in newest])
        which = np.concatenate([np.full(len(_NOTED[k][1]), k) for k in newest])
        order = np.argsort(outs, kind="stable")
        _LOOKUP["built"] = (outs[order], ins[order], which[order])
    return _LOOKUP["built"]


def transforms_of(value: Any) -> list[Transform]:
    """The noted transforms ``value``'s rows were computed by, through chains of them (module docstring)."""
    lookup, digests = _lookup(), float_rows(value)
    if lookup is None or digests is None:
        return []
    outs, ins, which = lookup
    found: set[int] = set()
    for _ in range(DEPTH):
        at = np.clip(np.searchsorted(outs, digests), 0, len(outs) - 1)
        hit = outs[at] == digests
        if not hit.any():
            break
        found.update(int(k) for k in np.unique(which[at[hit]]))
        digests = np.unique(ins[at[hit]])
    return [_NOTED[k][0] for k in sorted(found)]


def uncharged_transforms(dataset: Any, charged: Collection[str], secure: bool = False) -> list[str]:
    """The items ``dataset`` stores whose rows a noted transform computed from a release that ``charged`` (the runs of
    the fit's ledger) lacks, or, when ``secure``, whose noise was seeded, as findings."""
    if not _NOTED:
        return []
    found = []
    for path, value in stored_items(dataset):
        for t in dict.fromkeys(transforms_of(value)):
            if t.run not in charged:
                found.append(f"{path} was transformed by a {t.name} whose release this fit's ledger was not charged")
            elif secure and t.seeded:
                found.append(f"{path} was transformed by a {t.name} whose noise followed a generator given to it "
                             "(secure_mode)")
    return list(dict.fromkeys(found))


def uncharged_transforms_error(found: list[str]) -> PrivacyConfigurationError:
    """The refusal of :func:`uncharged_transforms`' findings."""
    seeded = " Under secure_mode, fit the preprocessor without a generator (its noise from the OS's CSPRNG): a " \
        "seeded one's noise can be re-drawn." if any(f.endswith("(secure_mode)") for f in found) else ""
    return PrivacyConfigurationError(
        "The training features were computed by the library's DP preprocessing from releases this fit does not "
        "account for:\n" + "\n".join(f"- {f}" for f in found[:6]) + "\nTheir ε is spent on the records this fit "
        "trains on, so the fit's ledger must count it (a ledger of its own, PrivacyLedger(), or another DPStrategy's "
        "leaves the reported ε short). Nothing was released. Fix: fit the preprocessor with the DPStrategy given to "
        "this Trainer (scaler.fit(x, strategy)), or charge it there too before trainer.fit (scaler.charge(strategy))."
        + seeded)


def forget_transforms() -> None:
    """Drop every note (the test suite: each test stands for a process of its own)."""
    _NOTED.clear()
    _LOOKUP["built"] = None
