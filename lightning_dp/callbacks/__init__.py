"""Callbacks: everything downstream of the noise (post-processing; no raw gradients)."""

from lightning_dp.callbacks.adam_variant import AdamVariant
from lightning_dp.callbacks.privacy_budget import PrivacyBudget
from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor

__all__ = ["AdamVariant", "PrivacyBudget", "SecondMomentMonitor"]
