"""Poisson sampling of users (user-level DP): who is sampled is decided per user, never per record.

Each step every user of this rank's shard joins independently with probability q = k / n_users (the plain
Poisson sampler of :mod:`~lightning_dp.privacy.min_sep_sampling`, over users); a joining user brings its
records, at most ``max_examples_per_user`` of them drawn uniformly afresh each step. A batch lists each user's
records together, users one after another, so physical batches and ranks can keep every user whole: users are
sharded across ranks (user j on rank j mod W), never their records.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_dp.privacy.min_sep_sampling import FrozenSampler, MinSepPoissonBatchSampler
from lightning_dp.secure_random import secure_seed, secure_uniform


class UserPoissonBatchSampler(FrozenSampler):
    """Yields ``steps_per_epoch`` batches of record positions: the records of the users sampled that step.

    Args:
        members: the record positions of each user (:meth:`~lightning_dp.units.users.Users.partition`).
        sample_rate: q (per user).
        steps_per_epoch: batches per epoch.
        rank, world_size: this process's shard of the users.
        seed: seed of the private generators (``None``: from the OS).
        secure: draw from the OS's CSPRNG (``seed`` must be ``None``).
        max_examples_per_user: the most records a sampled user brings (``None``: all).
    """

    def __init__(self, members: list[Tensor], sample_rate: float, steps_per_epoch: int, rank: int = 0,
                 world_size: int = 1, seed: Optional[int] = None, secure: bool = False,
                 max_examples_per_user: Optional[int] = None) -> None:
        self.members = members
        self.users = MinSepPoissonBatchSampler(len(members), sample_rate, steps_per_epoch, 1, rank, world_size, seed,
                                               secure)
        self.secure, self.limit = secure, max_examples_per_user
        self._generator = torch.Generator().manual_seed(secure_seed() if seed is None else seed + 7919)
        self._freeze()

    @property
    def step(self) -> int:
        """Steps drawn so far (continues across epochs and a resume)."""
        return self.users.step

    @step.setter
    def step(self, value: int) -> None:
        self.users.step = value

    def __len__(self) -> int:
        return len(self.users)

    def __iter__(self) -> Iterator[list[int]]:
        for users in self.users:
            yield [position for user in users for position in self.records_of(user)]

    def records_of(self, user: int) -> list[int]:
        """The record positions user ``user`` brings to this step (a fresh uniform subset beyond the limit)."""
        records = self.members[user]
        if self.limit is None or len(records) <= self.limit:
            return records.tolist()
        draws = secure_uniform(len(records)) if self.secure else torch.rand(len(records), generator=self._generator)
        keep = torch.argsort(draws)[: self.limit].sort().values
        return records[keep].tolist()

    def first_positions(self, count: int) -> list[int]:
        """The first ``count`` record positions of this rank's users, two records of each user where it has them (a
        fixed, public choice: the probe's examples)."""
        out: list[int] = []
        for user in self.users.groups[0].tolist():
            out.extend(self.members[user][:2].tolist())
            if len(out) >= count:
                break
        return out[:count]

    def state_dict(self) -> dict[str, Any]:
        """The step counter."""
        return self.users.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpointed step counter."""
        self.users.load_state_dict(state)
