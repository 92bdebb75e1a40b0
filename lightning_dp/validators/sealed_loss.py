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

What the closure hands the optimizer is sealed for good (:class:`HandedLoss`). Lightning's closure returns the very
tensor that becomes ``outputs["loss"]``; the strategies hand the optimizer another tensor object on the same memory,
of which nothing — and nothing computed from it (``detach()``, ``clone()``, arithmetic) — may ever be read, wherever
it is kept: an optimizer keeping ``loss.detach()`` for a scheduler, a ``training_step`` scaled by it, a history in
``optimizer.state`` would set later updates from the un-noised loss. ``outputs["loss"]`` is Lightning's own copy and
stays a report. Belt and braces, :func:`check_kept` refuses after every optimizer step an optimizer (its attributes,
``state`` entries, parameter groups) or scheduler that holds a sealed loss, before anything reads it or a checkpoint
writes it. Torch's optimizers only return the closure's loss, and train unchanged.
"""

from __future__ import annotations

from itertools import chain
import weakref
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.call_sites import first_caller, package_of

__all__ = ["HandedLoss", "SealedLoss", "check_kept", "handed", "sealed", "sealed_loss_error", "watch"]

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
        if name not in _PASSED_ON and _INSIDE() and not _libraries_own(func):
            raise sealed_loss_error(name)
        return super().__torch_function__(func, types, args, kwargs or {})

    def __deepcopy__(self, memo: dict) -> Tensor:
        """A copy of the same class, sealed as this one is (a clone: handing it on). ``ModelCheckpoint`` deep-copies
        the logged metrics, ``outputs["loss"]`` logged at batch end among them; torch's own fails for a subclass."""
        if id(self) not in memo:
            with torch._C.DisableTorchFunctionSubclass():
                memo[id(self)] = self.detach().clone().as_subclass(type(self))
        return memo[id(self)]


_MOVED = frozenset({"to", "cpu", "cuda", "__hash__"})
"""What may also be done with a :class:`HandedLoss`: move it (Lightning moves the optimizer's state to the CPU at the
fit's end) and hash it (by identity)."""


class HandedLoss(SealedLoss):
    """The loss the closure hands the optimizer: nothing but handing it on and asking its shape, anywhere, ever."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in _PASSED_ON and name not in _MOVED:
            raise sealed_loss_error(name) if _INSIDE() else handed_loss_error(name)
        return super(SealedLoss, cls).__torch_function__(func, types, args, kwargs or {})

    def as_subclass(self, cls: Any) -> Tensor:  # torch does not dispatch it: it would unseal
        raise sealed_loss_error("as_subclass") if _INSIDE() else handed_loss_error("as_subclass")


def handed(loss: Any) -> Any:
    """What the closure returned (Lightning's ``outputs["loss"]``), as the optimizer is handed it: another object,
    a :class:`HandedLoss`, so that what the optimizer derives from it stays sealed and the report does not."""
    if not isinstance(loss, Tensor):
        return loss
    with torch._C.DisableTorchFunctionSubclass():
        return loss.as_subclass(HandedLoss)


def _holds(value: Any, depth: int = 1) -> bool:
    """Whether ``value`` is a sealed loss, or a list, tuple, set or dict holding one (``depth`` levels down)."""
    if isinstance(value, SealedLoss):
        return True
    if depth and isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds(v, depth - 1) for v in value.values())
    return False


_SUSPECT = (SealedLoss, list, tuple, set, frozenset, dict)


def _plain(state: dict) -> bool:
    """Whether no entry of an optimizer's ``state`` can hold a sealed loss: the set of the types of every entry's
    values, collected at C speed (torch's optimizers keep tensors and numbers: 40 µs for 1,000 parameters)."""
    try:
        types = set(map(type, chain.from_iterable(map(dict.values, state.values()))))
    except TypeError:  # an entry that is not a dict
        return False
    return not any(issubclass(t, _SUSPECT) for t in types)


def check_kept(optimizer: Any, schedulers: Any = ()) -> None:
    """Refuse an optimizer or scheduler that keeps a sealed loss after the optimizer's step (module docstring): its
    attributes, the values of its ``state`` entries and of its parameter groups (but ``params``), and the schedulers'
    attributes, each a sealed loss or a container of one. Type checks only (tens of µs a step for a thousand
    parameters)."""
    where = None
    for key, value in vars(optimizer).items():
        if key == "state" and isinstance(value, dict):
            where = None if _plain(value) else next((f"optimizer.state[p][{k!r}]" for entry in value.values()
                                                     if isinstance(entry, dict) for k, v in entry.items()
                                                     if _holds(v)), None)
        elif key == "param_groups" and isinstance(value, list):
            where = next((f"optimizer.param_groups[{i}][{k!r}]" for i, group in enumerate(value)
                          if isinstance(group, dict) for k, v in group.items() if k != "params" and _holds(v)), None)
        elif _holds(value):
            where = f"optimizer.{key}"
        if where is not None:
            break
    for scheduler in () if where is not None else schedulers:
        where = next((f"{type(scheduler).__name__}.{k}" for k, v in vars(scheduler).items() if _holds(v)), None)
        if where is not None:
            break
    if where is not None:
        raise PrivacyConfigurationError(
            f"{type(optimizer).__name__} keeps the loss its closure returned ({where}) after its step: it is the "
            "batch's un-noised loss, and a learning rate, a step or a loss scale set from it later steers the updates "
            "by the private batch, outside the guarantee (a checkpoint would also carry it). Training stops before "
            "it is read. Keep nothing from the closure's loss in the optimizer or its schedulers; read the loss from "
            "outputs[\"loss\"] at batch end or self.log it.")


_LIBRARIES = ("pytorch_lightning", "lightning", "lightning_dp")


def _libraries_own(func: Any) -> bool:
    """Whether the operation ``func`` is Lightning's or lightning_dp's own (the first caller outside torch: Lightning
    divides the loss by the accumulation factor, 1, as it hands it on). A user's ``TorchFunctionMode`` entered around
    the fit (an op tracer, a counter) is handed the operation first: its ``__torch_function__`` frame is looked past
    when it passes that very ``func`` on (:func:`_passes_on`), so the caller is the code that asked for the operation;
    a mode reading the loss itself (``float``, ``.item()`` inside its handler) calls another operation and is the
    caller then, refused like any other read."""
    frame = first_caller(2, packages=("torch",), also=lambda f: _passes_on(f, func))
    return frame is not None and package_of(frame) in _LIBRARIES


def _passes_on(frame: FrameType, func: Any) -> bool:
    """Whether ``frame`` runs a torch function mode's ``__torch_function__`` that was handed ``func`` (its second
    argument, whatever the mode names it) and is calling it on: torch relaying an operation through the mode."""
    code = frame.f_code
    if code.co_name != "__torch_function__" or code.co_argcount < 2:
        return False
    local = frame.f_locals
    return isinstance(local.get(code.co_varnames[0]), TorchFunctionMode) and local.get(code.co_varnames[1]) is func


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


def handed_loss_error(read: str) -> PrivacyConfigurationError:
    """The refusal of a read, anywhere, of what the closure handed the optimizer (or of what was computed from it)."""
    return PrivacyConfigurationError(
        f"The loss the step's closure handed the optimizer, or a value computed from it, was read ({read}): it is "
        "the batch's un-noised loss, kept by the optimizer (loss.detach() in its step, a history in its state) or by "
        "code around optimizer.step(), and a learning rate, a step or a loss scale set from it steers later updates "
        "by the private batch, outside the guarantee. Keep nothing from the closure's loss; read the loss from "
        "outputs[\"loss\"] at batch end (a report) or self.log it.")


def sealed_loss_error(read: str) -> PrivacyConfigurationError:
    """The refusal of a read of the step's loss inside ``optimizer_step``."""
    return PrivacyConfigurationError(
        f"The step's loss was read inside optimizer_step ({read}), after the closure ran training_step and the "
        "backward: it is the batch's un-noised loss, and a learning rate, an extra or a skipped optimizer step set "
        "from it steers the update by the private batch, outside the guarantee. The update was not made. Leave "
        "optimizer_step to call optimizer.step(closure=optimizer_closure) and set rates from the step count (a "
        "scheduler), or from held-out data at validation; print the loss from a batch-end hook or self.log it.")
