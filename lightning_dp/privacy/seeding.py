"""Secret seeds for everything whose randomness the guarantee depends on."""

from __future__ import annotations

import os


def secure_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(8), "little") >> 1
