"""Whether nothing but Lightning's callback loop ran between two user callbacks' calls of one hook (issue 38).

The late-write watch (:meth:`~lightning_dp.validators.judged_writes._Judge.watched`) fingerprints a silent hook's
state before and after each call; with several user callbacks silent in one hook, the fingerprint after one call is
the fingerprint before the next exactly when nothing that could write ran in between. :func:`only_the_loop_between`
proves that from the call stack, or says it cannot: both calls made by one running frame of Lightning's
``_call_callback_hooks`` (the same frame object, held by the caller, so not a new dispatch at a freed one's address),
the earlier callback before the later in the list that frame iterates, and every callback between them one whose hook
is the base ``Callback``'s (it does nothing); the profiler Lightning's pass-through one, the later callback's
``state_key`` (read for the profiler's label before its call) and the trainer's and strategy's ``lightning_module``
(read for the call's arguments) the base classes' own, and no ``__getattribute__`` of a callback's class run for the
attribute reads. Anything else — another frame (the LightningModule's hook, another dispatch, a wrapper between),
a callback with its own hook or ``state_key``, a user's profiler, a list changed so that the order is not so — is
"cannot", and the watch fingerprints anew. The loop's other code (its iteration, ``getattr``, ``callable``, the
profiler's no-op context) writes nothing a fingerprint holds.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

__all__ = ["only_the_loop_between"]

_LOOP: list[Any] = []  # [the code object of Lightning's _call_callback_hooks, Callback, PassThroughProfiler, Trainer,
# Strategy], read once


def _lightning() -> list[Any]:
    if not _LOOP:
        import pytorch_lightning as pl
        from pytorch_lightning.profilers import PassThroughProfiler
        from pytorch_lightning.strategies import Strategy
        from pytorch_lightning.trainer import call

        _LOOP.extend((call._call_callback_hooks.__code__, pl.Callback, PassThroughProfiler, pl.Trainer, Strategy))
    return _LOOP


def only_the_loop_between(frame: FrameType, earlier: Any, later: Any, name: str, trainer: Any) -> bool:
    """Whether ``frame`` (the caller of both hook calls, held since the earlier) is Lightning's callback loop calling
    hook ``name`` of ``earlier`` and then of ``later`` with nothing run between but that loop (module docstring)."""
    code, callback, passthrough, trainer_class, strategy_class = _lightning()
    if frame.f_code is not code or type(trainer.profiler) is not passthrough:
        return False
    if _own(type(trainer), trainer_class, "lightning_module") or _own(type(trainer.strategy), strategy_class,
                                                                      "lightning_module"):
        return False
    listed = frame.f_locals.get("callbacks")
    if type(listed) is not list:
        return False
    at = [k for k, cb in enumerate(listed) if cb is earlier or cb is later]
    if len(at) != 2 or listed[at[0]] is not earlier or _own(type(later), callback, "state_key") \
            or type(later).__getattribute__ is not object.__getattribute__:
        return False
    base = getattr(callback, name)
    return all(getattr(type(cb), name, None) is base and name not in getattr(cb, "__dict__", {name: None})
               and type(cb).__getattribute__ is object.__getattribute__ and not _own(type(cb), callback, "state_key")
               for cb in listed[at[0] + 1:at[1]])


def _own(cls: type, base: type, attribute: str) -> bool:
    """Whether ``cls`` has an ``attribute`` other than ``base``'s."""
    return getattr(cls, attribute, None) is not getattr(base, attribute, None)
