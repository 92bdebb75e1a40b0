"""The clocks a hook reads, recorded and replayed (replays/clock.py): a run again reads the first run's values, in
order, the same objects; past them, with other arguments and on another thread the real clock; everything put back
however the block ends."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from datetime import datetime as Datetime
from time import perf_counter as bound_perf_counter
from typing import Any

import pytest

from lightning_dp.replays.clock import CLOCKS, ClockReads

REAL = {name: getattr(time, name) for name in CLOCKS}


def _stamps() -> list[Any]:
    """What a timing hook of this module reads: the clocks through the module, a name bound here, datetime's."""
    return [time.perf_counter(), time.time(), time.monotonic(), time.time_ns(), bound_perf_counter(),
            datetime.datetime.now(), Datetime.now(), Datetime.now(tz=datetime.timezone.utc)]


def _replayed(reads: ClockReads, run: Any = _stamps) -> Any:
    with reads.replayed():
        return run()


def test_a_run_again_reads_what_the_first_run_read() -> None:
    reads = ClockReads(_stamps)
    with reads.recording():
        first = _stamps()
    time.sleep(0.01)
    again = _replayed(reads)
    assert again == first
    assert all(a is f for a, f in zip(again[5:], first[5:]))  # the same datetime objects (compared by identity)
    assert type(again[5]) is datetime.datetime
    assert _replayed(reads) == first  # each run again from the first value


def test_past_the_recorded_values_and_with_other_arguments_the_real_clock() -> None:
    reads = ClockReads(_stamps)
    with reads.recording():
        first = time.perf_counter()
        stamp = Datetime.now(tz=datetime.timezone.utc)
    time.sleep(0.01)
    with reads.replayed():
        assert time.perf_counter() == first
        assert time.perf_counter() > first  # a second read the first run did not make: the real clock
        other = Datetime.now(tz=datetime.timezone(datetime.timedelta(hours=3)))  # another zone: not replayed
    assert other is not stamp and other > stamp


def test_everything_is_put_back_however_the_block_ends() -> None:
    reads = ClockReads(_stamps)
    with pytest.raises(RuntimeError), reads.recording():
        time.perf_counter()
        raise RuntimeError("the hook failed")
    with pytest.raises(RuntimeError), reads.replayed():
        raise RuntimeError("the run again failed")
    assert {name: getattr(time, name) for name in CLOCKS} == REAL
    assert bound_perf_counter is REAL["perf_counter"] and Datetime is datetime.datetime
    assert globals()["datetime"] is sys.modules["datetime"]  # this module's names back


def test_the_hooks_module_and_its_owners_attributes_are_replayed_and_put_back() -> None:
    class Owner:
        def __init__(self) -> None:
            self.clock = time.monotonic
            self.now = datetime.datetime.now
    owner = Owner()
    reads = ClockReads(_stamps, owner)
    with reads.recording():
        assert isinstance(Datetime(2020, 1, 1), Datetime)  # isinstance in the hook's module answers as before
        first = owner.clock(), owner.now()
    assert _replayed(reads, lambda: (owner.clock(), owner.now())) == first
    assert owner.clock is REAL["monotonic"] and vars(owner)["now"] == datetime.datetime.now


def test_another_thread_reads_the_real_clock() -> None:
    reads = ClockReads(_stamps)
    with reads.recording():
        first = time.perf_counter()
    seen: list[float] = []
    with reads.replayed():
        time.sleep(0.01)
        thread = threading.Thread(target=lambda: seen.append(time.perf_counter()))  # (a progress bar's monitor)
        thread.start()
        thread.join()
        assert time.perf_counter() == first
    assert seen[0] > first
    assert reads.values["perf_counter"] == [(((), {}), first)]  # the other thread's read not recorded


def test_a_block_inside_another_serves_its_own_values_then_the_outer_ones() -> None:
    """A decision window's runs again inside a judged hook's first run: each block records and replays its own."""
    outer, inner = ClockReads(_stamps), ClockReads(_stamps)
    with outer.recording():
        first = time.perf_counter()
        with inner.recording():
            nested = time.perf_counter()
        with inner.replayed():
            assert time.perf_counter() == nested  # the inner block's value, not the outer's
        assert time.perf_counter is not REAL["perf_counter"]  # the outer block still open
        last = time.perf_counter()
    assert [v for _, v in inner.values["perf_counter"]] == [nested]
    assert [v for _, v in outer.values["perf_counter"]] == [first, last]
    assert _replayed(outer, lambda: (time.perf_counter(), time.perf_counter())) == (first, last)
    assert time.perf_counter is REAL["perf_counter"]


def test_the_modules_of_the_user_binding_a_clock_are_indexed_and_replayed() -> None:
    """``from time import perf_counter`` in another module of the user's (not the hook's): replayed, put back; the
    index is brought up to date when a module is added."""
    import types

    from lightning_dp.replays.clock import clock_bindings

    utils = types.ModuleType("clock_test_utils")
    exec("from time import perf_counter\ndef stamp():\n    return perf_counter()\n", utils.__dict__)
    utils.__file__ = __file__  # a file of the user's
    sys.modules[utils.__name__] = utils
    try:
        assert any(names is utils.__dict__ for names, _ in clock_bindings())
        reads = ClockReads()  # no hook, no owner: found through the index
        with reads.recording():
            first = utils.stamp()
        time.sleep(0.01)
        assert _replayed(reads, utils.stamp) == first
        assert utils.perf_counter is REAL["perf_counter"]
    finally:
        del sys.modules[utils.__name__]


def test_the_standard_librarys_reads_are_not_replayed() -> None:
    """A read by the standard library's code in the hook's thread (a log record's time, a queue's deadline): the
    real clock, and the user's recorded values are left for the user's reads."""
    import logging

    reads = ClockReads()
    with reads.recording():
        first = time.time()
    time.sleep(0.01)
    with reads.replayed():
        created = logging.LogRecord("n", logging.INFO, "p", 1, "m", None, None).created  # time.time() in logging
        assert created > first + 0.005
        assert time.time() == first  # the user's first read: still the recorded value
