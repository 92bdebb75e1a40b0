"""Turn a user's ``torch.optim`` Adam / AdamW / Adagrad into its DP-variant equivalent.

Used by the :class:`~lightning_dp.callbacks.adam_variant.AdamVariant` callback and
usable on its own. Param groups (every key, including a scheduler's
``initial_lr``) and per-parameter state (``exp_avg``/``exp_avg_sq``/``sum``,
``step``) carry over, so the swap is invisible to the trajectory when the new
variant is ``post_processing``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dp.optim.base import UNSUPPORTED_FLAGS, DPOptimizerBase
from lightning_dp.optim.dp_adagrad import DPAdagrad
from lightning_dp.optim.dp_adam import DPAdam

#: source optimizer class -> DP optimizer class (subclasses match: AdamW is an Adam)
CONVERSIONS: tuple[tuple[type[Optimizer], type[DPOptimizerBase]], ...] = (
    (DPAdam, DPAdam),
    (DPAdagrad, DPAdagrad),
    (torch.optim.Adam, DPAdam),
    (torch.optim.Adagrad, DPAdagrad),
)


def dp_class_for(optimizer: Optimizer) -> type[DPOptimizerBase]:
    """The DP optimizer class equivalent to ``optimizer``'s; ValueError if there is none."""
    inner = getattr(optimizer, "optimizer", optimizer)  # unwrap a LightningOptimizer
    for source, target in CONVERSIONS:
        if isinstance(inner, source):
            return target
    raise ValueError(
        f"cannot swap a DP variant into {type(inner).__name__}: supported optimizers are torch.optim.Adam, "
        f"torch.optim.AdamW and torch.optim.Adagrad (return one of them from configure_optimizers)."
    )


def to_dp_optimizer(optimizer: Optimizer, variant: str = "post_processing", **hparams: Any) -> DPOptimizerBase:
    """A DPAdam / DPAdagrad with ``optimizer``'s param groups and state and the given variant.

    Raises ValueError for an unsupported optimizer, a variant without a form for
    it, unknown hyperparameters or group flags the DP optimizers do not
    implement (amsgrad, maximize, capturable, differentiable, fused). The state
    tensors are shared with ``optimizer``, which should not be stepped again.
    """
    inner: Optimizer = getattr(optimizer, "optimizer", optimizer)
    target = dp_class_for(inner)
    for i, group in enumerate(inner.param_groups):
        flags = [k for k in UNSUPPORTED_FLAGS if group.get(k)]
        if flags:
            raise ValueError(f"param group {i} of {type(inner).__name__} sets {flags}; the DP variants do not "
                             f"implement them: construct the optimizer with those set to False.")
    new = target([dict(group) for group in inner.param_groups], variant=variant, **hparams)
    new.defaults = {**new.defaults, **inner.defaults}
    for p, state in inner.state.items():
        new.state[p] = {k: (int(v) if k == "step" else v) for k, v in state.items()}
    return new
