"""Runs again from a starting state under variants, compared with the real run by a comparison given as a parameter.

docs/release_boundary.md, rule 3 ("Your hooks run more than once": the judged writes, the end of a fit, the checkpoint
hooks, the batch hooks): what user code wrote is accepted only when runs again on other data write it alike.
"""

from __future__ import annotations

import operator
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

__all__ = ["InterruptedRun", "bit_exact", "interrupts_failed", "plain_exchanged_again", "run_once", "set_apart"]

T = TypeVar("T")


class InterruptedRun(RuntimeError):
    """A ``KeyboardInterrupt``, ``SystemExit`` or ``GeneratorExit`` (any exception that is not an ``Exception``) the
    user's code raised while the library ran it again: a failed run again, judged as any other failure (a run that
    fails accepts nothing; one that fails on the data and not on other data is a decision made by raising), never the
    user's own interrupt ending the fit (zoo36 T19: raised from the batch's label rate inside the first step's replay,
    it ended the fit with no release and no refusal). The original is its ``__cause__``."""


class interrupts_failed:  # noqa: N801  (used as a context: ``with interrupts_failed():``)
    """Inside, an exception that is not an ``Exception`` leaves as :class:`InterruptedRun`."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> bool:
        if error is not None and not isinstance(error, Exception):
            raise InterruptedRun(f"{type(error).__name__} raised by the user's code run again") from error
        return False


def run_once(run: Callable[[], Any], *contexts: AbstractContextManager, start: Optional[Callable[[], Any]] = None,
             then: Optional[Callable[[], Any]] = None, read: Optional[Callable[[], Any]] = None) -> Any:
    """One run again (rule 3): ``run()`` inside ``contexts`` (the variant: made lazily, ``@contextmanager``, entered
    once ``start()`` put the starting state back), its result or ``read()``'s once they closed (the data back in
    place); ``None`` when either raised (a run that fails accepts nothing). ``then()`` puts a state back after."""
    if start is not None:
        start()
    try:
        with interrupts_failed(), ExitStack() as stack:
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
    """Rule 3's usual runs: ``run(False)`` on the data, ``run(True)`` on its exchanged copy when ``exchange(plain)``,
    ``run(False)`` again when the two ``differ`` on any rank (``any_rank``, one all-reduce: every rank runs as many,
    their collectives stay paired). One, two or three results, in that order (``None``: a run that failed)."""
    runs = [run(False)]
    if not exchange(runs[0]):
        return runs
    runs.append(run(True))
    if any_rank(differ(runs[0], runs[1])):
        runs.append(run(False))
    return runs


def set_apart(plain: Optional[T], again: Optional[T], others: Sequence[Optional[T]],
              compare: Callable[[T, T, T], list[str]]) -> list[str]:
    """What a run on other data (each of ``others`` that ran) set apart from the run on the data, and the second run
    on the data did not (``compare``, e.g. ``fingerprint_entries.moved_by_data``: a clock is not the data's), each name
    once, in order; nothing when ``plain`` or ``again`` failed (rule 3: what is set apart is refused)."""
    if plain is None or again is None:
        return []
    return list(dict.fromkeys(n for other in others if other is not None for n in compare(plain, again, other)))


def bit_exact(now: Optional[torch.Tensor], first: Optional[torch.Tensor]) -> bool:
    """Whether a tensor a run again left (``now``) is the one the real run wrote (``first``, a copy): the same type,
    shape, dtype and values bit for bit (rule 3: a write accepted is reproduced exactly); two ``None`` alike."""
    if now is None or first is None:
        return now is None and first is None
    return type(now.detach()) is type(first) and now.shape == first.shape and now.dtype == first.dtype \
        and bool(torch.equal(now.detach(), first))
