"""An optimizer's learning-rate schedulers, found without walking the heap at every step (issue 38).

A loop of one's own hands :class:`~lightning_dp.privacy.private_step.PrivateStep` its optimizer, not its schedulers;
the plain loop's checks (:mod:`lightning_dp.validators.plain_loop`) find them among the optimizer's referrers
(``gc.get_referrers``), which visits every object the collector tracks (importing ``lightning_dp`` makes 330k):
100–140 ms a call on a loaded 2-vCPU machine, tens of times the digits CNN's whole private step. It was repeated
at every release while none was found (docs/results/performance_log.md).

A scheduler can hold the optimizer unseen only if it was built without ``LRScheduler.__init__``, which marks the
optimizer it is given (``initial_lr`` in every parameter group, its ``step`` wrapped; torch's ``SequentialLR`` and
``ChainedScheduler`` are made of schedulers so built). So the walk runs only while the optimizer carries such a mark
or some subclass of ``LRScheduler`` outside torch defines an ``__init__`` that calls no ``__init__``; otherwise no
scheduler holds it and none is looked for. Nothing is cached here: the marks and the classes are read at every call.
"""

from __future__ import annotations

import gc
from typing import Any

from lightning_dp.records.library_code import library_named

__all__ = ["may_be_scheduled", "schedulers_of"]


def may_be_scheduled(optimizer: Any) -> bool:
    """Whether a ``torch.optim.lr_scheduler`` scheduler may hold ``optimizer`` (module docstring)."""
    from torch.optim.lr_scheduler import LRScheduler

    groups = getattr(optimizer, "param_groups", None) or ()  # (an object of one's own: only the classes tell)
    if hasattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched") or any("initial_lr" in g for g in groups):
        return True
    classes = LRScheduler.__subclasses__()
    while classes:
        cls = classes.pop()
        init = vars(cls).get("__init__")
        if init is not None and not library_named(cls, "torch.") and "__init__" not in getattr(
                getattr(init, "__code__", None), "co_names", ()):
            return True
        classes.extend(cls.__subclasses__())
    return False


def schedulers_of(optimizer: Any) -> list[Any]:
    """The schedulers (not ``ReduceLROnPlateau``, which is told a value) whose ``optimizer`` is ``optimizer``: its
    referrers walked when one may hold it, else none."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if not may_be_scheduled(optimizer):
        return []
    return [s for s in gc.get_referrers(optimizer) if isinstance(s, LRScheduler)
            and not isinstance(s, ReduceLROnPlateau) and getattr(s, "optimizer", None) is optimizer]
