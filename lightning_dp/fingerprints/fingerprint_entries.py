"""A fingerprint of kept state (entry name → token) and how two compare.

:class:`~lightning_dp.validators.kept_state.StateFingerprint` takes them; the replays and the release boundary compare
them here: which entries changed, which a replay on other data set apart (the clocks are replayed; not an object made
anew by each run), and a baseline with some entries accepted as they are now.
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


_SCALARS = frozenset({"NoneType", "bool", "int", "float", "str", "bytes"})  # the kinds of a scalar's token


def _scalar(token: Hashable) -> bool:
    """Whether a token is a Python scalar's, ``(type name, value)`` (:func:`~.state_walker.freeze`)."""
    return isinstance(token, tuple) and len(token) == 2 and token[0] in _SCALARS


def moved_by_data(plain: Fingerprint, again: Fingerprint, other: Fingerprint) -> list[str]:
    """The entries a replay on other data (``other``) set apart from a replay on the data (``plain``), except those
    a second replay on the same data (``again``) already set apart — and never a Python number or string.

    The replays read the clock values their first run read (:mod:`lightning_dp.replays.clock`) from the same seeds
    (``records.fetch.seeded``), so a time stamp or a draw of a seeded generator is written alike: what the second
    replay still sets apart has another cause, excused only where it is no value of the data's: an object the
    fingerprint compares by identity made anew by each run (a closure, a ``functools.partial``, a hook's handle
    number), a generator nobody seeds (``np.random.default_rng()`` made in the hook) drawn into a tensor or a
    container, a clock the standard library reads for the user. A scalar (``self.t = time.time() + x.mean()``, zoo30
    k03; ``time.time() * 1e-12 + mean``) is compared by value: set apart by the other data, it is the data's, even
    when the runs on the data already differ (an unreplayed draw beside the data would hide it)."""
    noisy = {name for name in changed_entries(plain, again)
             if not _scalar(plain.get(name)) and not _scalar(again.get(name))}
    return [name for name in changed_entries(plain, other) if name not in noisy]


def accepted(baseline: Fingerprint, now: Fingerprint, names: Sequence[str]) -> Fingerprint:
    """``baseline`` with the entries ``names`` (and the norms of their contents, ``"contents of …"``) as they are
    ``now`` (gone where gone)."""
    names = {*names, *(f"contents of {name}" for name in names)}
    kept = {k: v for k, v in baseline.items() if k not in names}
    return {**kept, **{k: now[k] for k in names if k in now}}
