"""A starting state: what a run again starts from, saved piece by piece, put back however the run ends.

Rule 3 of docs/release_boundary.md ("Your hooks run more than once"): a hook run again to judge what it kept starts
where the real run started and leaves nothing of itself behind; rule 8: a fetch run again starts from the dataset's
state and the generators as the fetch had them. What is saved is a parameter: each *piece* notes one part of the
state when called and returns what puts it back (:data:`Piece`): the user's state
(``StateSnapshot(...).restore``), the weights (``hook_replays.model_kept``), ĝ (:func:`gradients`), the global
generators (:func:`generators`), the generators the user holds (``held_values.user_generators``), a fetch's objects
(``fetch_reruns.Kept``).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

__all__ = ["Piece", "StartingState", "generators", "gradients", "put_back_after"]

Piece = Callable[[], Callable[[], Any]]
"""Notes one part of the state now; returns the function that puts it back."""


class StartingState:
    """The state as the pieces found it when made (docs/release_boundary.md, rule 3: what a run again starts from)."""

    def __init__(self, *pieces: Piece) -> None:
        self._put_backs = [take() for take in pieces]

    def put_back(self) -> None:
        """Every piece put back, in order; one that fails does not stop the others (the first error is raised)."""
        failed: list[BaseException] = []
        for put_back in self._put_backs:
            try:
                put_back()
            except BaseException as err:  # noqa: BLE001  (raised below, once the rest is back)
                failed.append(err)
        if failed:
            raise failed[0]


@contextmanager
def put_back_after(*pieces: Piece) -> Iterator[StartingState]:
    """The state as it is now (``pieces``) put back when the block ends, however it ends (rule 3: a run again leaves
    the state as the real run left it)."""
    now = StartingState(*pieces)
    try:
        yield now
    finally:
        now.put_back()


def generators(cuda: bool = True) -> Callable[[], None]:
    """A :data:`Piece`: the global generators' states now (torch's CPU generator, NumPy's, Python's ``random`` and,
    when ``cuda``, every CUDA device's once CUDA is initialised); a run again draws what the real run drew
    (docs/release_boundary.md, "Randomness starts each step afresh")."""
    cpu = torch.get_rng_state()
    devices = torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None
    numpy_state, python_state = np.random.get_state(), random.getstate()

    def put_back() -> None:
        torch.set_rng_state(cpu)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    return put_back


def gradients(parameters: Sequence[torch.Tensor], copied: bool = True) -> Callable[[], None]:
    """A :data:`Piece`: the gradients (ĝ) of ``parameters`` now. ``copied``: their values, a fresh copy put back each
    time (a run again may write ĝ in place: ``clip_grad_norm_``); else the same tensors put back (the real run's)."""
    held = [(p, g.detach().clone() if copied and g is not None else g) for p in parameters for g in (p.grad,)]

    def put_back() -> None:
        for p, value in held:
            p.grad = value.clone() if copied and value is not None else value
    return put_back
