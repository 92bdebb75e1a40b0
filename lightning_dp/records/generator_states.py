"""The random generators' states, taken at one moment and put back at will: a check's passes drawing exactly as a step.

A step whose ``training_step`` tosses a coin (``if np.random.rand() < 0.3: mixup``) mixes examples only on some steps.
The batch check (:mod:`~lightning_dp.validators.batch_check`) runs before the step's ``training_step`` and with the
generators as that step will find them (:class:`~lightning_dp.records.fresh_randomness.FreshRandomness` has seeded
them at the step's start): :func:`taken` notes them there, and :meth:`GeneratorStates.restore` starts every pass of
the check from them, so the check tosses the real step's own coin. :meth:`GeneratorStates.moved` tells whether a
pass drew from any of them (the step draws random numbers of its own at all, whatever it drew).

The generators: torch's CPU generator, every CUDA device's (once CUDA is initialised), NumPy's global ``RandomState``,
Python's ``random`` and the ``torch.Generator`` objects the model and the user's callbacks hold
(:mod:`~lightning_dp.records.user_generators`).
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.records import user_generators
from lightning_dp.replays.starting_state import Generators


class GeneratorStates(Generators):
    """The states of the module docstring's generators when it was made (the global ones:
    :class:`~lightning_dp.replays.starting_state.Generators`, once CUDA is initialised)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = user_generators.states()

    def restore(self) -> None:
        """Put every generator back in the state noted (the caller forks them: the check's passes leave no trace)."""
        self()
        user_generators.restore(self.users)

    def moved(self) -> bool:
        """Whether any generator is in another state than the one noted (something drew since)."""
        now = GeneratorStates()
        if not torch.equal(now.cpu, self.cpu) or now.python != self.python:
            return True
        if (self.cuda is None) != (now.cuda is None) or (self.cuda is not None and now.cuda is not None and any(
                not torch.equal(a, b) for a, b in zip(self.cuda, now.cuda))):
            return True
        if now.numpy[2:] != self.numpy[2:] or not np.array_equal(now.numpy[1], self.numpy[1]):
            return True
        mine = {id(g): s for g, s in self.users}
        return any(id(g) not in mine or not torch.equal(s, mine[id(g)]) for g, s in now.users)


def taken() -> GeneratorStates:
    """The generators' states now."""
    return GeneratorStates()
