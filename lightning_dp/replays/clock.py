"""The clocks a hook reads, recorded as it runs and replayed as it runs again.

docs/release_boundary.md, rule 3 ("Your hooks run more than once"): a write is accepted when the runs again on other
data reproduce it. A time stamp is no function of the data, but a run again reads the clock later: a throughput
callback appending ``time.perf_counter()`` to a list at a batch's end would write otherwise in every run, and excusing
what a run on the same data sets apart too lets the data through beside the clock (``self.t = time.time() +
x.mean() * 1e-3``: zoo30 k03). :class:`ClockReads` records the values the clocks gave the real run
(:meth:`~ClockReads.recording`; or the first of the runs again, :meth:`~ClockReads.next_run`) and hands each run again
the same values in the same order (:meth:`~ClockReads.replayed`), so a write of the clock alone is written alike and
accepted, and one mixing the data into it still differs on other data and is refused. Used by every family of runs
again with a run on the same data beside them: the judged writes, the logger calls, the first step's batch and epoch
hooks, the hooks before a later release, the decision windows, the batch-start settings, the checkpoint hooks, the
end of a fit, a plain loop's lazy caches (:func:`~lightning_dp.fingerprints.fingerprint_entries.moved_by_data`).

Replayed: the clocks of :mod:`time` (:data:`CLOCKS`, looked up on the module as they are called, or bound by name
— ``from time import perf_counter`` — in the hook's own module or in any other module of the user's:
:func:`clock_bindings`, an index of the module dicts holding one, built once and brought up to date when
:data:`sys.modules` grows) and ``datetime.now()``, ``utcnow()``, ``today()`` where such a module (not an installed
library's) holds :mod:`datetime` or its ``datetime`` class; a clock function an attribute of the hook's owner (or of
``owners``: the module, the callbacks a replay runs) holds (``self.clock = time.perf_counter``) is replayed too.
Only reads of the thread that runs the hook, and only from code that is neither the standard library's nor
lightning_dp's (:func:`replayed_caller`: a queue's or a lock's deadline, the library's own timers read the real clock)
are served recorded values: another thread (a progress bar's monitor, a loader's workers) reads the real clock, and
every reader reads it outside the block (Lightning's ``Timer`` keeps counting). Past the recorded values a run again
reads the real clock, which then writes otherwise (refused): a clock read a number of times that depends on the data.
Not seen: a duration the data steers (a sleep by a value of the batch) is recorded as the real run read it; a clock
read inside the standard library for the user (``email.utils.formatdate()``) or by C code other than these functions
(``os.times()``) is not replayed (written otherwise in every run: refused).
"""

from __future__ import annotations

import datetime as _datetime
import os
import sys
import sysconfig
import threading
import time
import types
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from lightning_dp.replays.bindings import ModuleIndex, rebound

__all__ = ["CLOCKS", "ClockReads", "clock_bindings", "file_kind", "replayed_caller"]

CLOCKS = tuple(name for name in ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                                 "process_time", "process_time_ns", "thread_time", "thread_time_ns")
               if hasattr(time, name))
"""The functions of :mod:`time` replayed."""

_REAL_DATETIME = _datetime.datetime
_DATETIME = ("now", "utcnow", "today")  # datetime.datetime's clocks (its C code reads the system clock itself)
_ACTIVE = threading.local()  # .stack: the clocks of the blocks open on this thread, innermost last
_LOCK = threading.Lock()
_OPEN = [0]  # how many blocks are open, on every thread (the first installs the replacements, the last removes them)
_OPEN_REAL: dict[str, Callable[..., Any]] = {}  # the clocks as the first block found them


def _clocks() -> dict[str, Callable[..., Any]]:
    """Each clock as it is now (one mocked by a test is kept), by name: ``"perf_counter"``, ``"datetime.now"``."""
    return {**{name: getattr(time, name) for name in CLOCKS},
            **{f"datetime.{name}": getattr(_REAL_DATETIME, name) for name in _DATETIME}}


_REAL = _clocks()
_REAL_VALUES = frozenset(_REAL.values())  # (a bound classmethod is a new object at each access: compared by ==)

_SITE = tuple(os.path.join(path, "") for path in {sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
_STDLIB = tuple(os.path.join(path, "") for path in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_OURS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")  # lightning_dp/
_KINDS: dict[str, str] = {}  # file name → "site", "std", "ours" or "user"


def file_kind(filename: str) -> str:
    """Whose code a file holds: an installed library's (``"site"``), the standard library's, lightning_dp's, or the
    user's."""
    kind = _KINDS.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
        kind = _KINDS[filename] = (
            "site" if path.startswith(_SITE) or "site-packages" in path or "dist-packages" in path else
            "std" if path.startswith(_STDLIB) or path.startswith("<frozen") else
            "ours" if path.startswith(_OURS) else "user")
    return kind


def replayed_caller(code: types.CodeType) -> bool:
    """Whether a clock read from ``code`` is served recorded values: not from the standard library's code (a queue's,
    a lock's or a thread's deadline) nor from lightning_dp's (its own timers)."""
    return file_kind(code.co_filename) not in ("std", "ours")




def _binds(names: dict[str, Any], datetime: bool) -> bool:
    """Whether a namespace holds a clock function (or, given ``datetime``, :mod:`datetime` or its class)."""
    for value in list(names.values()):
        if type(value) is types.BuiltinFunctionType and value in _REAL_VALUES:
            return True
        if datetime and (value is _datetime or value is _REAL_DATETIME):
            return True
    return False


def clock_bindings() -> list[tuple[dict[str, Any], bool]]:
    """The dicts of the modules (not the standard library's, not lightning_dp's) that bind a clock by name (``from
    time import perf_counter`` in a user's utils module), each with whether its ``datetime`` names are swapped too
    (not in an installed library: a ``datetime`` of the replayed class would not pickle). Scanned once per module:
    the index is brought up to date only when :data:`sys.modules` changed size (a few milliseconds for a thousand new
    modules; nothing otherwise)."""
    return _CLOCK_MODULES.entries()


def _clock_module(name: str, names: dict[str, Any], filename: str) -> Optional[tuple[dict[str, Any], bool]]:
    """(the dict, whether its ``datetime`` names are swapped) of a module of the user's or an installed library's
    binding a clock by name; ``None`` for any other."""
    kind = file_kind(filename) if filename else "std"  # a built-in module
    if kind in ("site", "user") and name != __name__ and _binds(names, kind == "user"):
        return names, kind == "user"
    return None


_CLOCK_MODULES = ModuleIndex(_clock_module)


class ClockReads:
    """The clock values one real run of ``hook`` read, per clock, in order, with their arguments (module
    docstring). ``owner`` and ``owners``: the objects whose attributes may hold a clock function."""

    def __init__(self, hook: Optional[Callable[..., Any]] = None, owner: Any = None,
                 owners: Sequence[Any] = ()) -> None:
        self.values: dict[str, list[tuple[tuple[tuple, dict], Any]]] = {}  # name → ((args, kwargs), value)
        self._names = [getattr(hook, "__globals__", None) or {}]  # where a clock is bound by name: the hook's module,
        for held in (owner, *owners):  # and its owners' attributes (a callback built with clock=time.perf_counter)
            try:
                self._names.append(vars(held) if held is not None else {})
            except TypeError:
                pass
        self.recorded = False  # whether a run was recorded (next_run: the first records, the others replay)

    def next_run(self) -> AbstractContextManager[None]:
        """The block of the next run: the first run records (:meth:`recording`), every later one replays
        (:meth:`replayed`) — for runs again where the first is itself a run again (rule 3's plain run)."""
        if self.recorded:
            return self.replayed()
        self.recorded = True
        return self.recording()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, the hook's thread reads the real clocks, and the values are kept."""
        self.recorded = True

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
        """The clocks replaced by ``clock(name, real)`` for this thread's reads from the user's code, put back however
        the block ends. A block inside another (a decision window's runs again inside a judged hook's first run)
        serves its own values until it ends, then the outer block's again. The replacements are the same objects in
        every block (a fingerprint of a module's globals taken in two runs finds them alike)."""
        with _LOCK:
            if not _OPEN[0]:
                _OPEN_REAL.update(_clocks())  # (one mocked by a test is kept as the real one)
                for name in CLOCKS:
                    setattr(time, name, _PATCHED[name])
            _OPEN[0] += 1
        stack = _ACTIVE.__dict__.setdefault("stack", [])
        stack.append({name: clock(name, _OPEN_REAL[name]) for name in _PATCHED})
        try:
            with rebound([*((names, True) for names in self._names), *clock_bindings()], _replacing):
                yield
        finally:
            stack.pop()
            with _LOCK:
                _OPEN[0] -= 1
                if not _OPEN[0]:
                    for name in CLOCKS:
                        setattr(time, name, _OPEN_REAL[name])


def _dispatch(name: str) -> Callable[..., Any]:
    """The replacement of clock ``name``: on a thread with a block open, from the user's code, the innermost block's
    ``clock``; elsewhere the real clock."""
    def read(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_ACTIVE, "stack", None)
        if stack and replayed_caller(sys._getframe(1).f_code):
            return stack[-1][name](*args, **kwargs)
        return _OPEN_REAL.get(name, _REAL[name])(*args, **kwargs)
    read.__name__ = read.__qualname__ = name.rpartition(".")[2]
    return read


def _replacing(value: Any, datetime: bool) -> Any:
    """What replaces ``value`` in a namespace (``None``: it is no clock); ``datetime``: :mod:`datetime` and its class
    too."""
    if type(value) is types.BuiltinFunctionType:
        for name, real in _REAL.items():
            if value is real or value is _OPEN_REAL.get(name) or value == real:  # (a bound classmethod: ==)
                return _PATCHED[name]
        return None
    if not datetime:
        return None
    return _DATETIME_CLASS if value is _REAL_DATETIME else _DATETIME_MODULE if value is _datetime else None


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


_PATCHED = {name: _dispatch(name) for name in _REAL}
_DATETIME_CLASS = _datetime_class(_PATCHED)
_DATETIME_MODULE = types.ModuleType("datetime")
_DATETIME_MODULE.__dict__.update(vars(_datetime), datetime=_DATETIME_CLASS)
