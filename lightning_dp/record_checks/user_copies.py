"""Copies of a record held by different users: one person counted as several users (user-level DP).

Under ``privacy_unit=Users(...)`` a user's own records may repeat (the same message sent twice: the user is
sampled once per step however many records it holds), so :mod:`.repeated_records` is not run. Copies in *different*
users are another matter: data concatenated with itself and re-numbered (``pd.concat([df, df])`` then
``user = row // 4``), or one person's rows appended again under a second id (a merge bug), make one person two
users, each Poisson-sampled with its own chance per step. That person's data then moves two clipped user terms (2C)
while the accountant counts one.

The evidence is the records', counted as :mod:`.repeated_records` counts exact copies, on the records checked there
(:func:`~lightning_dp.record_checks.repeated_records.checked_positions`: all of them up to
:data:`~lightning_dp.record_checks.repeated_records.CONTENT_CHECK_RECORDS`, else a public random sample). A user's
repeats of one record are first counted once (a prolific user's "ok" repeated ten times and one other user's "ok" are
one coincidence, not ten); among what is left, with P pairs of equal records (necessarily of different users) among
m', r̂ = P · (N' − 1) / (m'(m' − 1)/2) estimates how many other users' copies a record has (1 when every person is
two users), N' the population scaled alike. Refused when r̂ ≥ :data:`~.repeated_records.REPEATED_COPIES` (and, for a
sample, at least :data:`~.repeated_records.MIN_PAIRS` pairs): a share of the population, not one pair, so two users
who share an identical short record or two (the same "ok") train. The same count runs on the near-copy grids
(:func:`~lightning_dp.records.record_fingerprint.near_digest`: copies with jitter added).

Refused rather than merged: the ids are the user's declaration of who is whom, and records that coincide across
users are either a bug in the data or the ids (fixed where they are made) or different people's identical records
(declared with :class:`~lightning_dp.data.DistinctRecords`, which skips this check); merging the users would guess
between the two and silently change N.

What it cannot see: copies altered beyond the near grid, one record shared by a few users (below the share), a
person split over several ids whose records differ (ids read before a shuffle, ids in two spellings: see
docs/user_level.md), and records without a fingerprint.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Hashable

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.repeated_records import MIN_PAIRS, REPEATED_COPIES, _fingerprints


def check_copies_across_users(dataset: Any, at: Callable[[int], int], n: int,
                              user_of: Callable[[int], Hashable]) -> None:
    """Refuse a population of ``n`` records (position k is dataset index ``at(k)``; ``user_of(index)``: the user of
    a dataset index) whose records are copied across users beyond what coincidence explains (module docstring).

    Raises:
        PrivacyConfigurationError: naming two indices of different users that hold identical records, and the fix.
    """
    found = _fingerprints(dataset, at, n)
    if found is None or len(found[0]) < 2:
        return
    prints, near, read = found
    n = round(n * len(prints) / read)  # the records that hold data (empty ones, None, are no one's copies)
    try:
        users = {index: user_of(index) for index in prints}
    except (IndexError, KeyError):  # a record without a user id: refused by name where the users are counted
        return
    for digests, what in (({i: f.digest for i, f in prints.items()}, "identical"), (near[0], "near-identical"),
                          (near[1], "near-identical")):
        _refuse_shared(digests, users, n, what)


def _refuse_shared(digests: dict[int, bytes], users: dict[int, Hashable], n: int, what: str) -> None:
    kept: dict[tuple[Hashable, bytes], int] = {}  # a user's repeats of one record counted once
    for index, digest in digests.items():
        kept.setdefault((users[index], digest), index)
    m, distinct = len(digests), len(kept)
    if distinct < 2:
        return
    holders: defaultdict[bytes, list[int]] = defaultdict(list)
    for (_, digest), index in kept.items():
        holders[digest].append(index)
    pairs = sum(len(v) * (len(v) - 1) // 2 for v in holders.values())
    population = n * distinct / m
    copies = pairs * (population - 1) / (distinct * (distinct - 1) / 2)
    if pairs == 0 or copies < REPEATED_COPIES or (m < n and pairs < MIN_PAIRS):
        return
    first, second = sorted(min((v for v in holders.values() if len(v) > 1), key=min))[:2]
    checked = "all" if m == n else f"a random sample of {m}"
    raise PrivacyConfigurationError(
        f"Records of different users are {what}: the records have on average {copies:.2g} copies each held by other "
        f"users (estimated from {checked} of the {n} records; e.g. indices {first} and {second}, of two different "
        "users). "
        "That is what data concatenated with itself and re-numbered (user = row // k after pd.concat([df, df])), or "
        "one person's rows appended again under a second id, looks like: that person is several users, each "
        "sampled with its own chance per step, so their data moves several clipped user terms while the accountant "
        "counts one. Deduplicate the data before assigning user ids (df.drop_duplicates()), or give each person "
        "one id (the same id for the users whose records coincide). If these are different people's records that "
        "happen to be identical, declare it: lightning_dp.data.DistinctRecords(dataset).")
