"""DP-Adam and DP-AdaGrad variants (docs/algorithms.md §1–§5).

``DPAdam(params, variant=...)`` / ``DPAdagrad(params, variant=...)`` implement the
:class:`~lightning_dp.privacy.release.PrivateOptimizer` protocol; the variant
(a :class:`Preconditioner`) decides what the mechanism must release and how the
second moment is formed. Variants: see :func:`variant_names`.

DP-SignSGD with majority vote (docs/algorithms.md §6): :class:`DPSignSGD` (the update) and
:class:`VirtualWorkersSignSGD` (M workers in one process).
"""

from lightning_dp.optim.base import DPOptimizerBase
from lightning_dp.optim.bias_corrected import BiasCorrected
from lightning_dp.optim.convert import dp_class_for, to_dp_optimizer
from lightning_dp.optim.dp_adagrad import DPAdagrad
from lightning_dp.optim.dp_adam import DPAdam
from lightning_dp.optim.independent_moments import IndependentMoments
from lightning_dp.optim.noiseless import Noiseless, NotPrivateWarning
from lightning_dp.optim.post_processing import PostProcessing
from lightning_dp.optim.preconditioner import Preconditioner
from lightning_dp.optim.scale_then_privatize import ScaleThenPrivatize
from lightning_dp.optim.sign_sgd import DPSignSGD, VirtualWorkersSignSGD
from lightning_dp.optim.variants import make_preconditioner, register_variant, variant_class, variant_names

__all__ = [
    "BiasCorrected",
    "DPAdagrad",
    "DPAdam",
    "DPOptimizerBase",
    "DPSignSGD",
    "IndependentMoments",
    "Noiseless",
    "NotPrivateWarning",
    "PostProcessing",
    "Preconditioner",
    "ScaleThenPrivatize",
    "VirtualWorkersSignSGD",
    "dp_class_for",
    "make_preconditioner",
    "register_variant",
    "to_dp_optimizer",
    "variant_class",
    "variant_names",
]
