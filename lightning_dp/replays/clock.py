"""The clocks a hook reads, recorded as it runs and replayed as it runs again.

docs/release_boundary.md, rule 3 ("Your hooks run more than once"): a write is accepted when the runs again on other
data reproduce it. A time stamp is no function of the data, but a run again reads the clock later: a throughput
callback appending ``time.perf_counter()`` to a list at a batch's end would write otherwise in every run, and a
difference the run on the same data shows too is excused only for a Python number (a container may hide randomness
the runs do not replay behind it: zoo27). :class:`ClockReads` records the values the clocks gave the real run
(:meth:`~ClockReads.recording`) and hands each run again the same values in the same order
(:meth:`~ClockReads.replayed`), so a write of the clock alone is written alike and accepted, and one mixing the data
into it (``time.perf_counter() + x.mean()``) still differs on other data and is refused.

Replayed: the clocks of :mod:`time` (:data:`CLOCKS`, looked up on the module as they are called, or bound in the
hook's own module by ``from time import perf_counter``) and ``datetime.now()``, ``utcnow()``, ``today()`` where the
hook's module holds :mod:`datetime` or its ``datetime`` class; a clock function an
attribute of the hook's owner holds (``self.clock = time.perf_counter``) is replayed too. Only the thread that runs the
hook is served recorded values: another (a progress bar's monitor, a loader's workers) reads the real clock, and every
reader reads it outside the block (Lightning's ``Timer`` keeps counting). Past the recorded values a run again reads
the real clock, which then writes otherwise (refused, as before): a clock read in a helper of another module by a
name bound there, or a clock read a number of times that depends on the data. Not seen: a duration the data steers (a
sleep by a value of the batch) is recorded as the real run read it, as a float time stamp was excused before.
"""

from __future__ import annotations

import datetime as _datetime
import threading
import time
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

__all__ = ["CLOCKS", "ClockReads"]

CLOCKS = tuple(name for name in ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                                 "process_time", "process_time_ns", "thread_time", "thread_time_ns")
               if hasattr(time, name))
"""The functions of :mod:`time` replayed."""

_REAL_DATETIME = _datetime.datetime
_DATETIME = ("now", "utcnow", "today")  # datetime.datetime's clocks (its C code reads the system clock itself)
_ACTIVE = threading.local()  # whether a block of this module is open on this thread (a nested one changes nothing)


def _clocks() -> dict[str, Callable[..., Any]]:
    """Each clock as it is now (one mocked by a test is kept), by name: ``"perf_counter"``, ``"datetime.now"``."""
    return {**{name: getattr(time, name) for name in CLOCKS},
            **{f"datetime.{name}": getattr(_REAL_DATETIME, name) for name in _DATETIME}}


_REAL = _clocks()


class ClockReads:
    """The clock values one real run of ``hook`` read, per clock, in order, with their arguments (module
    docstring)."""

    def __init__(self, hook: Optional[Callable[..., Any]] = None, owner: Any = None) -> None:
        self.values: dict[str, list[tuple[tuple[tuple, dict], Any]]] = {}  # name → ((args, kwargs), value)
        self._names = [getattr(hook, "__globals__", None) or {}]  # where a clock is bound by name: the hook's module,
        try:  # and its owner's attributes (a callback built with clock=time.perf_counter)
            self._names.append(vars(owner) if owner is not None else {})
        except TypeError:
            pass

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, the hook's thread reads the real clocks, and the values are kept."""
        def clock(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def read(*args: Any, **kwargs: Any) -> Any:
                value = real(*args, **kwargs)
                self.values.setdefault(name, []).append(((args, kwargs), value))
                return value
            return read
        with self._patched(clock):
            yield

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside, the hook's thread reads the recorded values again, in order (the same objects: a ``datetime`` is
        compared by identity); past them, or called with other arguments (a time zone), the real clock."""
        served: dict[str, int] = {}

        def clock(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def read(*args: Any, **kwargs: Any) -> Any:
                kept, at = self.values.get(name, []), served.get(name, 0)
                served[name] = at + 1
                return kept[at][1] if at < len(kept) and kept[at][0] == (args, kwargs) else real(*args, **kwargs)
            return read
        with self._patched(clock):
            yield

    @contextmanager
    def _patched(self, clock: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        """The clocks replaced by ``clock(name, real)`` for this thread, put back however the block ends."""
        if getattr(_ACTIVE, "open", False):
            yield
            return
        thread, now = threading.get_ident(), _clocks()

        def for_thread(name: str) -> Callable[..., Any]:
            real, ours = now[name], clock(name, now[name])
            return lambda *args, **kwargs: (ours if threading.get_ident() == thread else real)(*args, **kwargs)
        patched = {name: for_thread(name) for name in now}
        datetime_class = _datetime_class(patched)
        datetime_module = types.ModuleType("datetime")
        datetime_module.__dict__.update(vars(_datetime), datetime=datetime_class)
        swapped: list[tuple[dict[str, Any], str, Any, Any]] = []  # (namespace, name, its value, the replayed one)
        for names in self._names:
            for key, value in list(names.items()):
                bound = [n for n in now if type(value) is types.BuiltinFunctionType and (
                    value is _REAL[n] or value is now[n] or value == _REAL[n])]  # (a bound classmethod: ==)
                ours = patched[bound[0]] if bound else datetime_class if value is _REAL_DATETIME else \
                    datetime_module if value is _datetime else None
                if ours is not None:
                    swapped.append((names, key, value, ours))
        _ACTIVE.open = True
        try:
            for name in CLOCKS:
                setattr(time, name, patched[name])
            for names, key, _, ours in swapped:
                names[key] = ours
            yield
        finally:
            for name in CLOCKS:
                setattr(time, name, now[name])
            for names, key, value, ours in swapped:
                if names.get(key) is ours:
                    names[key] = value
            _ACTIVE.open = False


class _AnyDatetime(type):
    """The replayed ``datetime`` class's type: a real ``datetime`` is an instance of it (``isinstance`` in the hook's
    module answers as before)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _REAL_DATETIME)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _REAL_DATETIME)


def _datetime_class(clocks: dict[str, Callable[..., Any]]) -> type:
    """``datetime.datetime`` whose ``now``, ``utcnow`` and ``today`` are ``clocks``'; their values are real
    ``datetime`` objects."""
    return _AnyDatetime("datetime", (_REAL_DATETIME,), {
        name: staticmethod(clocks[f"datetime.{name}"]) for name in _DATETIME})
