"""The checks' passes leave every random number generator as they found it.

The probe and the batch check run the user's ``training_step`` several times on examples. A step that draws random
numbers (dropout masks, augmentation, a NumPy or ``random`` call in the user's code) would otherwise advance the
generators, and the real step after the check would draw other numbers than a run without the check: a check that
changes training is a check nobody can turn on. :func:`forked_rngs` saves torch's CPU and accelerator generators,
NumPy's global generator and Python's ``random``, and restores them all.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def forked_rngs() -> Iterator[None]:
    """Run the block, then put torch's (CPU and every CUDA device), NumPy's and Python's generators back."""
    state = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        np, np_state = None, None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        if np is not None:
            np.random.set_state(np_state)
