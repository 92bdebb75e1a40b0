"""A user's utils module for tests/replays/test_draws.py: a source of entropy bound by name here, not in the test's
module (replays/draws.py's index of the user's modules binding one)."""

from __future__ import annotations

from os import urandom

from torch import Generator


def token() -> bytes:
    """Eight bytes read through the name this module binds."""
    return urandom(8)


def seeded_generator() -> int:
    """The seed a generator made through the class this module binds takes from entropy."""
    return Generator().seed()
