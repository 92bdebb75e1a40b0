"""A fingerprint of kept state (entry name → token) and how two compare.

:class:`~lightning_dp.validators.kept_state.StateFingerprint` takes them; the replays and the release boundary compare
them here: which entries changed, which a replay on other data set apart (the clocks and the unseeded draws are
replayed; not an object made anew by each run), and a baseline with some entries accepted as they are now.
"""

from __future__ import annotations

import math
import struct
from typing import Hashable, Sequence

Fingerprint = dict[str, Hashable]
"""Entry name (``"buffer stats.count"``, ``"attribute queue"``, ``"callback Memory.bank"``) → token."""


_MISSING = object()


def changed_entries(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Entries that differ, appeared or disappeared, in a stable order. Two equal dicts (the same names, each token
    equal, compared in C as Python's containers compare: an entry holding the very same token in both is equal) have
    none; any other pair is compared entry by entry."""
    if before == after:
        return []
    names = list(after) + [n for n in before if n not in after]
    return [n for n in names if before.get(n, _MISSING) != after.get(n, _MISSING)]


_SCALARS = frozenset({"NoneType", "bool", "int", "float", "str", "bytes"})  # the kinds of a scalar's token


def _scalar(token: Hashable) -> bool:
    """Whether a token is a Python scalar's, ``(type name, value)`` (:func:`~.state_walker.freeze`)."""
    return isinstance(token, tuple) and len(token) == 2 and token[0] in _SCALARS


def moved_by_data(plain: Fingerprint, again: Fingerprint, other: Fingerprint) -> list[str]:
    """The entries a replay on other data (``other``) set apart from a replay on the data (``plain``), except those
    a second replay on the same data (``again``) already set apart — and never a Python number or string.

    The replays read the clock values and the unseeded draws their first run read (:mod:`lightning_dp.replays.clock`,
    :mod:`lightning_dp.replays.draws`: ``np.random.default_rng()``, ``os.urandom``, ``torch.Generator().seed()`` made
    in the hook) from the same seeds (``records.fetch.seeded``), so a time stamp or a draw is written alike: what the
    second replay still sets apart has another cause, excused only where it is no value of the data's: an object the
    fingerprint compares by identity made anew by each run (a closure, a ``functools.partial``, a hook's handle
    number), entropy the draws do not record (a C extension's own read of ``/dev/urandom``) or a kernel whose sums
    are not deterministic drawn into a tensor or a container — unless the other data moved the entry's numbers far
    beyond that difference (:func:`_far_beyond_noise`) —, a clock the standard library reads for the user. A scalar
    (``self.t = time.time() + x.mean()``, zoo30 k03; ``time.time() * 1e-12 + mean``) is compared by value: set apart
    by the other data, it is the data's, even when the runs on the data already differ (an unreplayed draw beside the
    data would hide it)."""
    noisy = {name for name in changed_entries(plain, again)
             if not _scalar(plain.get(name)) and not _scalar(again.get(name))
             and not _far_beyond_noise(plain.get(name), again.get(name), other.get(name))}
    return [name for name in changed_entries(plain, other) if name not in noisy]


NOISE_RATIO = 100.0
"""How much farther than the second run on the data the other data must move an entry's numbers to be the data's
(squared for an entry of one number). Three independent draws kept (no data in them) pass this by chance with
probability about 7e-5 for two numbers, under 1e-6 for four or more, 5e-5 for one at the square (5e-3 at 100,
measured): a draw of its own kept in an epoch hook is not refused by chance. A second line only since the draws are
replayed (:mod:`lightning_dp.replays.draws`: zoo32 e01/e02, a training mean + 0.01 · an unseeded normal, is refused at
any scale because the runs on the data no longer differ): what still sets them apart is entropy the replays do not
record and nondeterministic kernels. The ratio is kept, not tightened: a lower one would refuse such a difference
kept alone by chance more often (about 1/ratio for one number at the first power), and no ratio refuses a draw from
an unrecorded source as large as the data's move, which only recording the source does."""


def _far_beyond_noise(plain: Hashable, again: Hashable, other: Hashable) -> bool:
    """Whether the other data moved the numbers a token holds (a small tensor's values, a tensor's content sums) more
    than :data:`NOISE_RATIO` times as far as the second run on the data did: a draw of 1e-9 from a source the
    replays do not record beside a training-set mean (the lead's e01/e04: ``hint = x.mean(0) + 1e-9 · randn``)
    leaves the runs on the data apart by the draw and the other data's run apart by the mean. Tokens without
    numbers, or whose numbers do not line up (another shape, a list grown apart), stay excused."""
    a, b, c = _numbers(plain), _numbers(again), _numbers(other)
    if not a or len(a) != len(b) or len(a) != len(c):
        return False
    noise = max(abs(x - y) for x, y in zip(a, b))
    moved = max(abs(x - z) for x, z in zip(a, c))
    return moved > (NOISE_RATIO if len(a) > 1 else NOISE_RATIO ** 2) * noise  # (one number: see NOISE_RATIO)


def _numbers(token: Hashable) -> list[float]:
    """The numbers in a token, in order: numbers, strings that spell one (a small tensor's values by ``repr``), and
    the float64 sums of :func:`~.checksums.content_sums` (24 bytes); a NaN or infinity is left out (no distance)."""
    out: list[float] = []
    if isinstance(token, tuple):
        for item in token:
            out += _numbers(item)
    elif isinstance(token, (int, float)) and not isinstance(token, bool):
        out.append(float(token))
    elif isinstance(token, str):
        try:
            out.append(float(token))
        except ValueError:
            pass
    elif isinstance(token, bytes) and len(token) == 24:
        out += [float(v) for v in struct.unpack("=3d", token)]
    return [v for v in out if math.isfinite(v)]


def accepted(baseline: Fingerprint, now: Fingerprint, names: Sequence[str]) -> Fingerprint:
    """``baseline`` with the entries ``names`` (and the norms of their contents, ``"contents of …"``) as they are
    ``now`` (gone where gone)."""
    names = {*names, *(f"contents of {name}" for name in names)}
    kept = {k: v for k, v in baseline.items() if k not in names}
    return {**kept, **{k: now[k] for k in names if k in now}}
