"""Lightning's loop methods wrapped for one fit or evaluation, on the loop instance (never the user's objects).

The strategy's own hooks run after the user's (Lightning calls the callbacks', then the module's, then the
strategy's ``on_validation_start``), and some of Lightning's steps call no strategy hook at all (the scheduler's
update). Where a watch must begin before the user's code runs, or see what one of Lightning's steps changes, the
library wraps that method of the loop instance for the run: :func:`wrap_method` binds the wrapper as an instance
attribute and returns the function that restores the loop as it was (its own instance attribute, if it had one, or
the class's method). The user's module and callbacks are left alone, so they stay picklable (zoo31 s12).
Used by :mod:`.mechanism_notes` (the scheduler update) and :mod:`.validation_reads` (an evaluation loop's start).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["wrap_method"]

_MISSING = object()


def wrap_method(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace ``owner.<name>`` by ``make(original)`` on the instance; return the function that undoes it (once)."""
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, make(getattr(owner, name)))
    done = [False]

    def undo() -> None:
        if done[0]:
            return
        done[0] = True
        if own is _MISSING:
            vars(owner).pop(name, None)
        else:
            setattr(owner, name, own)
    return undo
