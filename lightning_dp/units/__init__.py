"""Privacy units beyond the single example: :class:`~.users.Users` for user-level DP (docs/user_level.md). The
sampler of users is sampling, so it lives in the core (:mod:`lightning_dp.privacy.user_sampling`)."""

from lightning_dp._lazy import lazy_exports
from lightning_dp.units.users import Users

__all__ = ["UserPoissonBatchSampler", "Users"]

__getattr__ = lazy_exports(__name__, {"UserPoissonBatchSampler": "lightning_dp.privacy.user_sampling"})
"""The sampler of users, readable here by its earlier name."""
