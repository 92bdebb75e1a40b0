"""User-level differential privacy (issue #39): the privacy unit is a user and all of its records.

``DPStrategy(privacy_unit=Users(user_ids, users_per_batch=k))``. Each step Poisson-samples *users* with
q = k / n_users (:mod:`~lightning_dp.privacy.user_sampling`); a sampled user contributes its records (at most
``max_examples_per_user``, drawn afresh each step). The user's gradient is the MEAN of its records'
per-example gradients,

    g_u = (1/m_u) Σ_{i∈u} g_i,        ĝ = (Σ_u clip_C(g_u) + σ C z) / k,

so removing every record of one user removes one clipped term: the release moves by at most C (the
sensitivity is C, as for one example), and the accounting is the sampled Gaussian over N = n_users units
at rate q. The mean (rather than the sum) keeps a user's gradient at the scale of one example's whatever its
number of records, so C tuned for examples carries over, and a heavy user is not clipped harder for having
more records. Engines compute ‖Σ_{i∈u} g_i‖ (:mod:`~lightning_dp.clipping.rule`,
:mod:`~lightning_dp.grad_sample.ghost_units`); physical batches and ranks hold whole users.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError


class Users:
    """User-level DP: Poisson-sample users; clip each user's mean gradient to C; account per user.

    Args:
        user_ids: the user of each dataset record (``user_ids[i]`` for record i of the training dataset, any
            hashable ids), or the name of an attribute of the training dataset holding them (for configs:
            ``user_ids: user_ids`` reads ``dataset.user_ids``).
        users_per_batch: k, the expected number of users per step (q = k / n_users; ĝ is divided by k).
        max_examples_per_user: the most records one sampled user contributes to a step, drawn uniformly afresh
            each step (``None``: all of them). Bounds the work per user; the guarantee does not depend on it.

    Example:
        >>> users = Users([0, 0, 1, 2, 2, 2], users_per_batch=2)
    """

    def __init__(self, user_ids: Union[Sequence[int], Sequence[str], str], users_per_batch: int,
                 max_examples_per_user: Optional[int] = None) -> None:
        if not (isinstance(users_per_batch, int) and users_per_batch >= 1):
            raise ValueError(f"users_per_batch must be an integer >= 1, got {users_per_batch!r}")
        if max_examples_per_user is not None and not (isinstance(max_examples_per_user, int)
                                                      and max_examples_per_user >= 1):
            raise ValueError(f"max_examples_per_user must be None or an integer >= 1, got {max_examples_per_user!r}")
        self.user_ids: Union[Sequence[Any], str] = user_ids
        self.users_per_batch = users_per_batch
        self.max_examples_per_user = max_examples_per_user
        self._unit_of: Optional[dict[int, int]] = None

    def __repr__(self) -> str:
        ids = repr(self.user_ids) if isinstance(self.user_ids, str) else f"<{len(self.user_ids)} ids>"
        return (f"Users({ids}, users_per_batch={self.users_per_batch}, "
                f"max_examples_per_user={self.max_examples_per_user})")

    def ids_for(self, dataset: Any) -> Sequence[Any]:
        """The ids, read from ``dataset`` when given by attribute name."""
        if not isinstance(self.user_ids, str):
            return self.user_ids
        ids = getattr(dataset, self.user_ids, None)
        if ids is None:
            raise PrivacyConfigurationError(
                f"Users(user_ids={self.user_ids!r}): the training dataset ({type(dataset).__name__}) has no attribute "
                f"{self.user_ids!r}. Give the list of user ids (one per record), or the name of the dataset's "
                "attribute holding them.")
        return ids

    def user_of(self, dataset: Any) -> Callable[[int], Hashable]:
        """The user of dataset record ``i`` (its id, as :meth:`partition` counts it); ``IndexError`` past the ids."""
        ids = self.ids_for(dataset)
        return lambda index: _hashable(ids[int(index)])

    def partition(self, dataset: Any, population: Sequence[int]) -> list[Tensor]:
        """The positions ``0…N−1`` of the population (dataset index ``population[j]``) grouped by user: one tensor of
        positions per user, users in order of their first record (public: a function of the ids only)."""
        ids = self.ids_for(dataset)
        length = len(ids)
        number: dict[Hashable, int] = {}
        members: list[list[int]] = []
        unit_of: dict[int, int] = {}
        for position, index in enumerate(population):
            if not 0 <= int(index) < length:
                raise PrivacyConfigurationError(
                    f"Users: record {int(index)} of the training data has no user id (user_ids has {length} entries): "
                    "give one id per record of the dataset the loader reads.")
            unit = number.setdefault(_hashable(ids[int(index)]), len(number))
            if unit == len(members):
                members.append([])
            members[unit].append(position)
            unit_of[int(index)] = unit
        self._unit_of = unit_of
        _warn_spellings(number)
        return [torch.tensor(v, dtype=torch.long) for v in members]

    def units_of(self, indices: Sequence[int]) -> list[Any]:
        """The user of each of ``indices``' records (the same user, the same value, across batches)."""
        if self._unit_of is None:
            raise RuntimeError("Users.partition() first (the private step does, when the loader is built)")
        return [self._unit_of[int(i)] for i in indices]

    def groups_of(self, indices: Sequence[int]) -> Tensor:
        """The unit of each of a batch's records ``[n]``, numbered 0… in order of first appearance."""
        if self._unit_of is None:
            raise RuntimeError("Users.partition() first (the private step does, when the loader is built)")
        seen: dict[int, int] = {}
        return torch.tensor([seen.setdefault(self._unit_of[int(i)], len(seen)) for i in indices], dtype=torch.long)


def _warn_spellings(ids: dict[Hashable, int]) -> None:
    """Warn when distinct ids differ only in letter case or surrounding whitespace (``"Ann@x.org"``, ``"ann@x.org "``):
    most likely one person under two spellings, so two users (counts only: ids are data)."""
    spellings: dict[str, int] = {}
    for key in ids:
        text = str(key).strip().lower()
        spellings[text] = spellings.get(text, 0) + 1
    merged = sum(c for c in spellings.values() if c > 1)
    if merged:
        warnings.warn(
            f"Users: {merged} of the {len(ids)} user ids differ from another only in letter case or surrounding "
            "whitespace (or are a number and its text). If they are one person's, that person is several users, each "
            "sampled with its own chance per step, and ε per user understates their privacy loss: normalise the ids "
            "before Users(...) (e.g. str(id).strip().lower()).", UserWarning, stacklevel=3)


def _hashable(value: Any) -> Hashable:
    if isinstance(value, Tensor):
        return value.item()
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value.item() if hasattr(value, "item") and callable(value.item) else value
