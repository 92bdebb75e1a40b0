"""Who called: the first frame up the stack that is not passed over, for the checks that tell the user's code from a
library's.

A *library frame* is one whose module belongs to a package the caller names (torch, Lightning, lightning_dp, …; the
checks differ in which they count); a frame of the standard library, of the checking module itself or of a module
that only relays a call (torch between the user's arithmetic and a tensor's ``__torch_function__``) is *passed over*:
it neither is the user's code nor says whose call it is. :func:`first_caller` walks the stack past those and hands
back the first frame left; each check then asks of it what it needs (is it the user's, is it a library's, is it
lightning_dp's own). Code run as a script (``__main__``) is never the standard library's."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Callable, Collection, Optional

__all__ = ["STANDARD", "first_caller", "package_of"]

STANDARD = frozenset(sys.stdlib_module_names) - {"__main__"}
"""The standard library's top-level packages (a script run as ``__main__`` is the user's code)."""


def package_of(frame: FrameType) -> str:
    """The top-level package of ``frame``'s module (``""`` where its globals name none)."""
    return (frame.f_globals.get("__name__", "") or "").split(".")[0]


def first_caller(depth: int, *, modules: Collection[str] = (), packages: Collection[str] = (),
                 standard: bool = False, also: Optional[Callable[[FrameType], bool]] = None) -> Optional[FrameType]:
    """The first frame, from ``depth`` frames above the function that calls this one (as ``sys._getframe(depth)``
    there), that is not passed over; ``None`` if every frame is.

    Passed over: a frame of one of ``modules`` (full module names: the checking module itself), of one of
    ``packages`` (top-level names: torch relaying an operation), of the standard library if ``standard``
    (:data:`STANDARD`), and, of the others, one for which ``also(frame)`` is true (a metric's own helper methods)."""
    frame: Optional[FrameType] = sys._getframe(depth + 1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "") or ""
        top = name.split(".")[0]
        if not (name in modules or top in packages or (standard and top in STANDARD) or (also and also(frame))):
            return frame
        frame = frame.f_back
    return None
