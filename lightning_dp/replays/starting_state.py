"""A starting state: what a run again starts from, saved piece by piece, put back however the run ends.

docs/release_boundary.md, rule 3 ("Your hooks run more than once"): a hook run again starts where the real run
started and leaves nothing of itself behind; rule 8: a fetch run again starts from the generators the fetch had.
What is saved is a parameter: each :data:`Piece` (the user's state: ``StateSnapshot(...).restore``; the weights:
``hook_replays.model_kept``; :func:`gradients`; :class:`Generators`; ``held_values.user_generators``).
"""

from __future__ import annotations

import random
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

__all__ = ["Generators", "Piece", "StartingState", "gradients", "put_back_after"]

Piece = Callable[[], Callable[[], Any]]
"""Notes one part of the state now; returns the function that puts it back."""


class StartingState:
    """The state as the pieces found it (rule 3: what a run again starts from, what it leaves)."""

    def __init__(self, *pieces: Piece) -> None:
        self._put_backs = [take() for take in pieces]

    def put_back(self) -> None:
        """Every piece put back, in order; one that fails does not stop the rest (its error raised after)."""
        with ExitStack() as stack:
            for put_back in reversed(self._put_backs):  # (an ExitStack calls them last first, each whatever raised)
                stack.callback(put_back)


@contextmanager
def put_back_after(*pieces: Piece) -> Iterator[StartingState]:
    """The state as it is now (``pieces``) put back when the block ends, however it ends (rule 3)."""
    now = StartingState(*pieces)
    try:
        yield now
    finally:
        now.put_back()


class Generators:
    """A :data:`Piece`: the states now of torch's CPU generator, NumPy's, Python's ``random`` and every CUDA device's
    (``cuda``: once CUDA is ``"initialised"``, whenever ``"available"``, or ``"none"``); calling it puts them back: a
    run again draws what the real run drew (docs/release_boundary.md, "Randomness starts each step afresh")."""

    def __init__(self, cuda: str = "initialised") -> None:
        self.cpu, self.numpy, self.python = torch.get_rng_state(), np.random.get_state(), random.getstate()
        self.cuda = torch.cuda.get_rng_state_all() if cuda != "none" and torch.cuda.is_available() and (
            cuda == "available" or torch.cuda.is_initialized()) else None

    def __call__(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


def gradients(parameters: Sequence[torch.Tensor], copied: bool = True) -> Callable[[], None]:
    """A :data:`Piece`: ĝ of ``parameters``. ``copied``: its values, a fresh copy at each put back (a run again may
    write ĝ in place: ``clip_grad_norm_``); else the same tensors put back (the real run's, rule 3)."""
    held = [(p, g.detach().clone() if copied and g is not None else g) for p in parameters for g in (p.grad,)]

    def put_back() -> None:
        for p, value in held:
            p.grad = value.clone() if copied and value is not None else value
    return put_back
