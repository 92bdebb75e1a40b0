"""Privacy units beyond the single example (issue #39): :class:`~.users.Users` for user-level DP."""

from lightning_dp.units.user_sampler import UserPoissonBatchSampler
from lightning_dp.units.users import Users

__all__ = ["UserPoissonBatchSampler", "Users"]
