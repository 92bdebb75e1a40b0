"""A user's utils module for tests/replays/test_clock_replays.py: a clock bound by name here, not in the hook's
module (replays/clock.py's index of the modules binding one)."""

from __future__ import annotations

from time import perf_counter


def stamp() -> float:
    """A time stamp read through the name this module binds."""
    return perf_counter()
