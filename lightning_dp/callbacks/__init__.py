"""Callbacks: everything downstream of the noise (post-processing; no raw gradients), and public
pretraining before the private fit (no private data)."""

from lightning_dp.callbacks.adam_variant import AdamVariant
from lightning_dp.callbacks.privacy_budget import PrivacyBudget
from lightning_dp.callbacks.public_pretraining import PublicPretraining
from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor

__all__ = ["AdamVariant", "PrivacyBudget", "PublicPretraining", "SecondMomentMonitor"]
