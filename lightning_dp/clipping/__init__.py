"""Clipping policies (issue #39): how each privacy unit's gradient is bounded, consulted by every engine
through one :class:`~.rule.ClipRule`. ``DPStrategy(clipping=...)`` takes one of the public policies."""

from lightning_dp.clipping.adaptive import AdaptiveClipping
from lightning_dp.clipping.automatic import AutomaticClipping
from lightning_dp.clipping.flat import FlatClipping, flat_factors
from lightning_dp.clipping.per_layer import PerLayerClipping
from lightning_dp.clipping.policy import ClippingPolicy
from lightning_dp.clipping.rule import ClipRule, as_rule

__all__ = [
    "AdaptiveClipping",
    "AutomaticClipping",
    "ClipRule",
    "ClippingPolicy",
    "FlatClipping",
    "PerLayerClipping",
    "as_rule",
    "flat_factors",
]
