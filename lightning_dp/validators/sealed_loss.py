"""The step's loss, sealed while the step still runs: its value may not steer the update it belongs to.

Lightning's documented ``optimizer_step`` override is handed the closure that runs ``training_step`` and the backward
(where the release happens); what the closure returns — and what ``optimizer.step(closure)`` returns — is the step's
un-noised loss. Code after it in the override (``lr = 0.5 / loss``, an extra ``optimizer.step()`` when the loss is
high, ``if loss > 1: return``) would set this update, or the next, from the private batch, after the release and
outside every other check (the learning rate is compared between the step's beginning and its release; the batch-end
windows of :mod:`.decisions` open later). The private strategies hand Lightning the loss as a :class:`SealedLoss`: a
tensor like any other (autograd, arithmetic, ``.detach()`` and the loggers work on it unchanged; what is computed
from it is sealed too) with which nothing but handing it on (detach, clone, backward) and asking its shape may be
done while the module's current hook is ``optimizer_step``: its value read there — ``float()``, ``.item()``,
``bool()`` (a comparison in an ``if``), a print — or arithmetic carrying it into a learning rate is refused
(:class:`~lightning_dp.errors.PrivacyConfigurationError`), before the update it would steer. Anywhere else the loss
is a report: the batch-end hooks read it (``outputs["loss"]``), and what they decide from it is :mod:`.decisions`'
to judge.

Not sealed under ``Trainer(detect_anomaly=True)``, whose finiteness check reads the loss there.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError

__all__ = ["SealedLoss", "sealed", "sealed_loss_error", "watch"]

_PASSED_ON = frozenset({"detach", "clone", "backward", "requires_grad_", "size", "dim", "numel", "is_floating_point",
                        "__get__"})
"""What may be done with the loss inside ``optimizer_step``: hand it on (Lightning detaches and clones it for the batch
end, the backward differentiates it) and ask its shape, dtype or device. Anything else there — reading its value,
arithmetic that would carry it into a learning rate — is refused."""

_INSIDE: Callable[[], bool] = lambda: False  # noqa: E731  (set by :func:`watch`: whether a read is refused now)


class SealedLoss(Tensor):
    """A loss whose value may not be read inside ``optimizer_step`` (module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in _PASSED_ON and _INSIDE() and not _libraries_own():
            raise sealed_loss_error(name)
        return super().__torch_function__(func, types, args, kwargs or {})


_LIBRARIES = ("pytorch_lightning", "lightning", "lightning_dp")


def _libraries_own() -> bool:
    """Whether the operation is Lightning's or lightning_dp's own (the first caller outside torch: Lightning divides
    the loss by the accumulation factor, 1, as it hands it on)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "torch":
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES


def watch(module: Any) -> None:
    """From now on a :class:`SealedLoss` is sealed while ``module``'s current hook is ``optimizer_step`` (the private
    fit of ``module`` starts; ``None``: never, the fit is over)."""
    global _INSIDE
    if module is None:
        _INSIDE = lambda: False  # noqa: E731
        return
    ref = weakref.ref(module)

    def inside() -> bool:
        owner = ref()
        return owner is not None and getattr(owner, "_current_fx_name", None) == "optimizer_step"
    _INSIDE = inside


def sealed(output: Any) -> Any:
    """``output`` (``training_step``'s: a loss, or a dict with ``"loss"``) with its loss a :class:`SealedLoss`."""
    if isinstance(output, Tensor) and not isinstance(output, SealedLoss):
        return output.as_subclass(SealedLoss)
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": sealed(output["loss"])}
    return output


def sealed_loss_error(read: str) -> PrivacyConfigurationError:
    """The refusal of a read of the step's loss inside ``optimizer_step``."""
    return PrivacyConfigurationError(
        f"The step's loss was read inside optimizer_step ({read}), after the closure ran training_step and the "
        "backward: it is the batch's un-noised loss, and a learning rate, an extra or a skipped optimizer step set "
        "from it steers the update by the private batch, outside the guarantee. The update was not made. Leave "
        "optimizer_step to call optimizer.step(closure=optimizer_closure) and set rates from the step count (a "
        "scheduler), or from held-out data at validation; print the loss from a batch-end hook or self.log it.")
