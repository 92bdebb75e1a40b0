"""A fingerprint of kept state (entry name → token) and how two compare.

:class:`~lightning_dp.validators.kept_state.StateFingerprint` takes them; the replays and the release boundary compare
them here: which entries changed, which a replay on other data set apart (not a clock or a random draw), and a baseline
with some entries accepted as they are now.
"""

from __future__ import annotations

from typing import Hashable, Sequence

Fingerprint = dict[str, Hashable]
"""Entry name (``"buffer stats.count"``, ``"attribute queue"``, ``"callback Memory.bank"``) → token."""


_MISSING = object()


def changed_entries(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Entries that differ, appeared or disappeared, in a stable order."""
    names = list(after) + [n for n in before if n not in after]
    return [n for n in names if before.get(n, _MISSING) != after.get(n, _MISSING)]


def moved_by_data(plain: Fingerprint, again: Fingerprint, other: Fingerprint) -> list[str]:
    """The entries a replay on other data (``other``) set apart from a replay on the data (``plain``), except those
    a second replay on the same data (``again``) already set apart: a wall-clock time, a random draw is not the
    data's."""
    noisy = set(changed_entries(plain, again))
    return [name for name in changed_entries(plain, other) if name not in noisy]


def accepted(baseline: Fingerprint, now: Fingerprint, names: Sequence[str]) -> Fingerprint:
    """``baseline`` with the entries ``names`` (and the norms of their contents, ``"contents of …"``) as they are
    ``now`` (gone where gone)."""
    names = {*names, *(f"contents of {name}" for name in names)}
    kept = {k: v for k, v in baseline.items() if k not in names}
    return {**kept, **{k: now[k] for k in names if k in now}}
