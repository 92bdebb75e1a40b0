"""Runs again from a starting state under variants, compared with the real run by a comparison given as a parameter.

docs/release_boundary.md, rule 3 ("Your hooks run more than once", the judged writes, the end of a fit, the
checkpoint hooks) and rule 8 (a fetch's write): what user code wrote is accepted only when runs again on other data
write it alike. :func:`run_once` is one run (the variant: the contexts it runs in; a run that fails judges nothing),
:func:`plain_exchanged_again` the usual three (on the data, on its exchanged copy, on the data again when those two
differ), :func:`set_apart` what the exchanged run set apart that the second plain run did not (the comparison, e.g.
``fingerprint_entries.moved_by_data``, a parameter), :func:`bit_exact` the comparison of a tensor written.
"""

from __future__ import annotations

import operator
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["bit_exact", "plain_exchanged_again", "run_once", "set_apart"]

T = TypeVar("T")


def run_once(run: Callable[[], Any], *contexts: AbstractContextManager, start: Optional[Callable[[], Any]] = None,
             then: Optional[Callable[[], Any]] = None, read: Optional[Callable[[], Any]] = None) -> Any:
    """``run()`` inside ``contexts`` (made lazily, ``@contextmanager``: entered in order once ``start()`` put the
    starting state back: ``StartingState.put_back``, ``StateSnapshot.restore``) — its result, or ``read()``'s once the
    contexts closed (what it wrote, with the data back in place); ``None`` when either raised (rule 3: a run again
    that fails accepts nothing). ``then()`` puts a state back after, however it ended."""
    if start is not None:
        start()
    try:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            result = run()
        return result if read is None else read()
    except Exception:  # noqa: BLE001  (the caller refuses what a failed run cannot judge)
        return None
    finally:
        if then is not None:
            then()


def plain_exchanged_again(run: Callable[[bool], Optional[T]], exchange: Callable[[Optional[T]], bool],
                          any_rank: Callable[[bool], bool] = bool,
                          differ: Callable[[Any, Any], bool] = operator.ne) -> list[Optional[T]]:
    """The runs again of rule 3: ``run(False)`` on the data; ``run(True)`` on its exchanged copy when
    ``exchange(plain)``; ``run(False)`` again when the two ``differ`` on any rank (``any_rank``: one all-reduce, so
    every rank runs as many: their collectives stay paired). One, two or three results (``None``: a run that failed)."""
    runs = [run(False)]
    if not exchange(runs[0]):
        return runs
    runs.append(run(True))
    if any_rank(differ(runs[0], runs[1])):
        runs.append(run(False))
    return runs


def set_apart(runs: list[Optional[T]], compare: Callable[[T, T, T], list[str]]) -> list[str]:
    """``compare(plain, again, exchanged)`` — what the exchanged run set apart and the second plain run did not (a
    clock is not the data's) — when :func:`plain_exchanged_again` made three runs and none failed; else nothing."""
    if len(runs) != 3 or any(r is None for r in runs):
        return []
    return compare(runs[0], runs[2], runs[1])  # type: ignore[arg-type]


def bit_exact(now: Optional[torch.Tensor], first: Optional[torch.Tensor]) -> bool:
    """Whether a tensor a run again left (``now``) is the one the real run wrote (``first``, a copy): the same type,
    shape, dtype and values, bit for bit (rule 3: a write accepted is reproduced exactly); two ``None`` alike."""
    if now is None or first is None:
        return now is None and first is None
    return type(now.detach()) is type(first) and now.shape == first.shape and now.dtype == first.dtype \
        and bool(torch.equal(now.detach(), first))
