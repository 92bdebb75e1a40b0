"""``Trainer(gradient_clip_val=...)`` under a private strategy: a published config's clipping bound taken as C.

Lightning's gradient clipping clips the *batch* gradient, the mean over the examples: it bounds no single example's
influence, so it is no substitute for per-example clipping. Most published Lightning configs set it anyway (9 of 15
Trainers in issue 37's survey), with the meaning "gradients of norm at most this". The decision, for both private
strategies:

- ``gradient_clip_algorithm="norm"`` (Lightning's default) and no ``max_grad_norm`` given to the strategy: the value
  becomes the per-example bound C, said in one INFO line, so a published config runs unchanged. Lightning's own
  clipping is switched off for the fit (``trainer.gradient_clip_val`` is ``None`` while it runs, restored at its
  end): after the strategy's release it would clip the noised mean gradient again — post-processing, harmless to the
  guarantee, but not what the config meant and a surprise in the update's scale.
- ``max_grad_norm`` given as well: the same value is accepted (Lightning's clipping switched off likewise); a
  different one is refused naming both, before any release (which bound was meant cannot be guessed).
- ``gradient_clip_algorithm="value"``: refused. It clips each coordinate of the batch gradient; the private
  counterpart is per-example norm clipping (``max_grad_norm``), and there is no per-example value clipping here.

A value that appears later in the fit (a callback setting ``trainer.gradient_clip_val``) is checked the same way at
the next step: equal to C it is switched off again, otherwise refused.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

from lightning_dp._warnings import said
from lightning_dp.errors import PrivacyConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl


DEFAULT_MAX_GRAD_NORM = 1.0
"""C when neither ``max_grad_norm`` nor ``Trainer(gradient_clip_val=...)`` gives one."""


def adopt_gradient_clip(trainer: "pl.Trainer", strategy: Any, label: str) -> None:
    """Apply the decision of the module docstring to ``trainer``'s clipping settings for ``strategy`` (one of the
    private strategies: ``private_step``, ``_max_grad_norm_given``); idempotent."""
    value = trainer.gradient_clip_val
    if not value:
        return
    algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
    if algorithm == "value":
        raise PrivacyConfigurationError(
            f"Trainer(gradient_clip_val={value}, gradient_clip_algorithm='value') clips each coordinate of the batch "
            f"gradient, which bounds no example's influence, and {label} has no per-example value clipping. Nothing "
            f"was released. Remove both Trainer arguments and set {label}(max_grad_norm=...), the per-example norm "
            "bound C (Trainer(gradient_clip_val=...) with the default 'norm' algorithm is taken as C).")
    step = strategy.private_step
    if not strategy._max_grad_norm_given:
        step.max_grad_norm = float(value)
        strategy._max_grad_norm_given = True
        said(f"{label}: per-example clipping bound C = {float(value)}, from Trainer(gradient_clip_val={value}); "
             "Lightning's own clipping of the batch gradient is off for this fit")
    elif float(value) != step.max_grad_norm:
        raise PrivacyConfigurationError(
            f"Trainer(gradient_clip_val={value}) and {label}(max_grad_norm={step.max_grad_norm}) give two different "
            f"clipping bounds. {label} clips each example's gradient to max_grad_norm (C) and takes gradient_clip_val "
            "as C when max_grad_norm is not given; Lightning's gradient_clip_val alone would clip the batch gradient, "
            f"which bounds no example. Nothing was released. Keep one: remove gradient_clip_val, or remove "
            f"max_grad_norm from {label}(...), or set both to the same value.")
    if strategy._clip_restore is None:
        strategy._clip_restore = (weakref.ref(trainer), value)
    trainer.gradient_clip_val = None  # Lightning's clipping would act on the released, noised gradient


def restore_gradient_clip(strategy: Any) -> None:
    """Give the Trainer back the ``gradient_clip_val`` it was built with (end of the fit)."""
    restore: Optional[tuple[Any, Any]] = strategy._clip_restore
    strategy._clip_restore = None
    if restore is not None:
        trainer = restore[0]()
        if trainer is not None:
            trainer.gradient_clip_val = restore[1]
