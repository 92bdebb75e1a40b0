"""Lightning's ``ModelPruning`` in a private fit: pruning the released weights is post-processing, accepted as made.

``ModelPruning(pruning_fn, amount)`` prunes at an epoch's end with ``torch.nn.utils.prune``. For each (layer, name) it
registers the parameter ``name`` again as ``name_orig`` (the same Parameter object: the optimizer trains on with it),
adds a buffer ``name_mask`` computed from the released weights (their magnitudes; a random draw for the ``random_*``
methods) and a forward pre-hook that sets ``layer.name = name_orig * name_mask`` before every call. With
``use_lottery_ticket_hypothesis`` it then copies the layers' initial values (copied in its ``setup``, before any
release) into ``name_orig``; at the fit's end (``make_pruning_permanent``) ``torch.nn.utils.prune.remove`` writes
``name_orig * name_mask`` back into a plain ``name``.

None of torch's pruning reads the training data: every value it writes is a function of the released weights, of
the initial ones, of a random draw. The release boundary (rule 3) would still refuse the writes, as state written
outside the release: :class:`PruningWatch` wraps each pruning call of Lightning's own ``ModelPruning`` with one of
torch's pruning methods (not of a subclass, nor with a ``BasePruningMethod`` of the user's: code of the user's may
read the data). The callables ``amount``, ``apply_pruning`` and ``use_lottery_ticket_hypothesis`` are the user's code
(a closure may read the training rows and write the model: zoo29 p01, p02, p05): the watch evaluates them first, as
``ModelPruning`` would, refuses anything they wrote (parameters, buffers, attributes, callbacks' state, the optimizer's
state), then runs the pruning with their values, and accepts only what torch's pruning leaves: for each pruned name,
``name_mask`` with values 0/1 and at least the zeros it had, ``name_orig`` the value it had or (lottery ticket) the
initial one saved at the fit's start (a fresh ``reset_parameters`` draw of a torch layer when resampling), ``name``
their product; ``make_pruning_permanent``: a plain ``name`` equal to the product it served. Any other change in the
call is refused, naming the likely writer. The values the callables return are the user's functions of the epoch: a
closure choosing the pruned share from the training loss decides from it (a documented limit; a logged value read is
refused by rule 6).

The engine follows the renamed parameters at the next step (``PrivateStep.refresh_parameters`` re-attaches it; the
probe runs again before the next release), where example i's gradient of ``name_orig`` is its gradient of ``name``
times the mask (:func:`~lightning_dp.validators.layers.pruned`). Pruning written any other way during the fit (the
user's own hook calling ``torch.nn.utils.prune``) is judged as any other write: refused unless the epoch hooks'
replays find it alike on other data. Pruning before the fit (masks fixed) needs none of this.

It imports no Lightning (the glue imports it; Lightning imports the glue).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.prune import BasePruningMethod

from lightning_dp.records.library_code import library_callable, library_named
from lightning_dp.errors import PrivacyConfigurationError, listed
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.steered_settings import OptimizerState

__all__ = ["PruningWatch", "lightning_model_pruning"]

_PRUNING_CALLS = ("_run_pruning", "make_pruning_permanent")
"""``ModelPruning``'s methods that write the model: the epoch end's pruning (with the lottery-ticket reset) and the
fit end's ``prune.remove``."""


def lightning_model_pruning(callback: Any) -> bool:
    """Whether ``callback`` is Lightning's ``ModelPruning`` itself (a subclass may override what it computes) with one
    of torch's own pruning methods (``pruning_fn`` a name, or a class of ``torch.nn.utils.prune``: a
    ``BasePruningMethod`` of the user's may compute its mask from anything, the training data included)."""
    cls = type(callback)
    method = getattr(callback, "pruning_fn", None)
    method = getattr(method, "func", method)  # functools.partial of a torch function (pruning_fn given by name)
    return cls.__name__ == "ModelPruning" and library_named(cls, ("pytorch_lightning.", "lightning.")) \
        and getattr(method, "__module__", "") == "torch.nn.utils.prune" and library_callable(method)


class PruningWatch:
    """Accepts, in ``boundary``'s baseline, what torch's pruning writes to ``module`` in each pruning call of
    Lightning's ``ModelPruning`` among ``callbacks`` (module docstring), until :meth:`stop`; refuses any other write.

    Args:
        module: the model being fitted.
        boundary: the private step's release boundary (its ``fingerprint``, ``callbacks`` and ``accept``).
        callbacks: the trainer's callbacks.
    """

    def __init__(self, module: nn.Module, boundary: Any, callbacks: Sequence[Any]) -> None:
        self._module, self._boundary = module, boundary
        self._wrapped: list[tuple[Any, str]] = []
        self._known = _pruning_hooks(module)  # pruned before the fit (masks fixed), then each accepted call's
        self._declined = [_declined(callback) for callback in callbacks if _model_pruning(callback)
                          and not lightning_model_pruning(callback)]  # a ModelPruning whose masks are the user's
        for callback in callbacks:
            if not lightning_model_pruning(callback):
                continue
            initial = _initial_values(callback)  # the lottery-ticket reset's values, as saved at the fit's start
            for name in _PRUNING_CALLS:
                call = getattr(callback, name)
                checked = self._checked_run(callback, call, initial) if name == "_run_pruning" \
                    else self._checked_permanent(call)
                callback.__dict__[name] = checked
                callback.__dict__[name]._ldp_pruning = True
                self._wrapped.append((callback, name))

    def _taken(self) -> tuple[Any, Fingerprint, list[tuple[Any, OptimizerState]]]:
        fingerprint = self._boundary.fingerprint(self._module)
        optimizers = getattr(getattr(self._module, "_trainer", None), "optimizers", None) or []
        return fingerprint, fingerprint.take(self._boundary.callbacks()), [(o, OptimizerState(o)) for o in optimizers]

    def _written(self, taken: tuple[Any, Fingerprint, list[tuple[Any, OptimizerState]]]) -> list[str]:
        fingerprint, before, optimizers = taken
        written = StateFingerprint.changed(before, fingerprint.take(self._boundary.callbacks()))
        return written + [name for o, state in optimizers for name in state.changed(OptimizerState(o))]

    def _checked_run(self, callback: Any, call: Callable[[int], None],
                     initial: "_Values") -> Callable[[int], None]:
        def run(current_epoch: int) -> None:
            taken = self._taken()
            with _constants(callback, current_epoch) as ran:  # the user's callables run here, outside the window
                if ran and (written := self._written(taken)):
                    raise _written_error(f"{' / '.join(ran)} callable(s) wrote kept state at an epoch's end",
                                         written)
                pairs = [(layer, name) for layer, name in callback._parameters_to_prune]
                before = {(id(layer), name): _pruned_values(layer, name) for layer, name in pairs}
                call(current_epoch)  # torch's pruning and the lottery-ticket reset only
                reset = bool(callback._use_lottery_ticket_hypothesis)
            written = self._written(taken)
            wrong = _unexplained(self._module, written, pairs, lambda layer, name: _pruned_as_torch(
                layer, name, before[id(layer), name], reset, initial.get((id(layer), name)),
                callback._resample_parameters))
            if wrong:
                writers = " / ".join([*ran, "code of yours run inside it"])
                raise _written_error("pruning call changed state torch's pruning does not write, or not as it "
                                     f"writes it (likely writer: {writers})", wrong)
            self._accept(written)

        return run

    def _checked_permanent(self, call: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def permanent(module: nn.Module) -> None:
            taken = self._taken()
            pairs = [(m, h._tensor_name) for m in self._module.modules() for h in m._forward_pre_hooks.values()
                     if _is_pruning(h)]
            products = {(id(m), name): (getattr(m, f"{name}_orig") * getattr(m, f"{name}_mask")).detach().clone()
                        for m, name in pairs}
            call(module)
            written = self._written(taken)
            wrong = _unexplained(self._module, written, pairs, lambda layer, name: _made_permanent(
                layer, name, products[id(layer), name]))
            if wrong:
                raise _written_error("make_pruning_permanent changed state torch's prune.remove does not write, or "
                                     "not as it writes it (likely writer: code of yours run inside it)", wrong)
            self._accept(written)

        return permanent

    def _accept(self, written: list[str]) -> None:
        if written:
            self._boundary.accept(written)
        self._known |= _pruning_hooks(self._module)

    def check(self) -> None:
        """Refuse a layer pruned during the fit by other code than Lightning's ``ModelPruning`` (a hook of the user's
        calling ``torch.nn.utils.prune``, a subclass of the callback): its mask is kept state no check here judges,
        and it may come from the data (SNIP's or an activation's scores). Raises
        :class:`~lightning_dp.errors.PrivacyConfigurationError` naming the layers and what is served."""
        unknown = sorted({name for name, m in self._module.named_modules()
                          for h in m._forward_pre_hooks.values() if _is_pruning(h) and id(h) not in self._known})
        if unknown and self._declined:
            raise PrivacyConfigurationError(
                f"The model's trainable parameters changed during training: layer(s) {unknown[:6]} were pruned during "
                f"the fit by {'; '.join(self._declined)}: code of yours computes the masks (its compute_mask may read "
                "the training data), and a mask is kept state the release boundary cannot judge. Nothing more was "
                "released. Accepted: pytorch_lightning.callbacks.ModelPruning itself with one of torch's pruning "
                "methods, by name or class (\"l1_unstructured\", \"random_unstructured\", \"ln_structured\", "
                "\"random_structured\", torch.nn.utils.prune.L1Unstructured, ...), whose masks are functions of the "
                "released weights or a random draw. Fix: give ModelPruning one of those (a random mask: "
                "pruning_fn=\"random_unstructured\" or \"random_structured\"), or prune with your method before the "
                "fit (the masks fixed) or after it.")
        if unknown:
            raise PrivacyConfigurationError(
                f"The model's trainable parameters changed during training: layer(s) {unknown[:6]} were pruned during "
                "the fit (torch.nn.utils.prune) by other code than Lightning's ModelPruning callback, and the mask is "
                "kept state the release boundary cannot judge (it may come from the training data). Nothing more was "
                "released. Prune before the fit (the masks fixed: served), prune the released weights after it, or "
                "use pytorch_lightning.callbacks.ModelPruning itself (not a subclass) with one of torch's pruning "
                "methods (not a BasePruningMethod of your own), whose pruning of the released weights at an epoch's "
                "end is served.")

    def stop(self) -> None:
        """The callbacks' own methods back."""
        for callback, name in self._wrapped:
            if getattr(callback.__dict__.get(name), "_ldp_pruning", False):
                del callback.__dict__[name]
        self._wrapped = []


def _model_pruning(callback: Any) -> bool:
    """Whether ``callback`` is Lightning's ``ModelPruning`` or a subclass of it."""
    return any(c.__name__ == "ModelPruning" and c.__module__.startswith(("pytorch_lightning.", "lightning."))
               for c in type(callback).__mro__)  # (by name: a class claiming it is declined, :func:`_declined`)


def _declined(callback: Any) -> str:
    """Why a ``ModelPruning`` (:func:`_model_pruning`) is not :func:`lightning_model_pruning`, in words: a subclass
    of it, or a pruning method of the user's (its class named), which is not one of torch's."""
    cls = type(callback)
    if cls.__name__ != "ModelPruning" or not library_named(cls, ("pytorch_lightning.", "lightning.")):
        return f"{cls.__name__}, a subclass of ModelPruning (its code may compute the masks otherwise)"
    method = getattr(callback, "pruning_fn", None)
    method = getattr(method, "func", method)
    name = getattr(method, "__name__", None) or type(method).__name__
    return f"ModelPruning with pruning_fn={name}, a pruning method of yours (not one of torch.nn.utils.prune's)"


def _is_pruning(hook: Any) -> bool:
    return isinstance(hook, BasePruningMethod)


def _pruning_hooks(module: nn.Module) -> set[int]:
    """The ids of the ``torch.nn.utils.prune`` forward pre-hooks on ``module``'s layers now."""
    return {id(h) for m in module.modules() for h in m._forward_pre_hooks.values() if _is_pruning(h)}


_Values = dict[tuple[int, str], Tensor]
_CALLABLES = (("apply_pruning", "_apply_pruning"), ("amount", "amount"),
              ("use_lottery_ticket_hypothesis", "_use_lottery_ticket_hypothesis"))
"""``ModelPruning``'s arguments that may be callables of the epoch (the user's code), and their attributes."""


@contextmanager
def _constants(callback: Any, epoch: int) -> Iterator[list[str]]:
    """Evaluate ``callback``'s callables of ``epoch`` as ``ModelPruning._run_pruning`` would (the lottery-ticket one
    only when it prunes), then hold their values in their place: the pruning call runs none of the user's code.
    Yields the arguments whose callables ran."""
    ran: list[str] = []
    held = {attr: callback.__dict__[attr] for _, attr in _CALLABLES if attr in callback.__dict__}
    try:
        for argument, attr in _CALLABLES:
            value = held.get(attr)
            if attr == "_use_lottery_ticket_hypothesis" and not (callback._apply_pruning and callback.amount):
                value = False  # not reached: ModelPruning returns before it
            elif callable(value):
                ran.append(argument)
                value = value(epoch)
            callback.__dict__[attr] = value
        yield ran
    finally:
        callback.__dict__.update(held)


def _initial_values(callback: Any) -> _Values:
    """(layer id, name) → a copy of the value ``ModelPruning``'s lottery-ticket reset writes into ``name_orig``, as
    saved in its ``setup`` (before any release)."""
    out: _Values = {}
    for ref in (getattr(callback, "_original_layers", None) or {}).values():
        for i, name in ref["names"]:
            value = getattr(ref["data"], name, None)
            if isinstance(value, Tensor):
                out[id(callback._parameters_to_prune[i][0]), name] = value.detach().clone()
    return out


def _pruned_values(layer: nn.Module, name: str) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Copies of the tensor pruning renames to ``name_orig`` and of the mask it holds (``None``: not pruned yet)."""
    orig = layer._parameters.get(f"{name}_orig", getattr(layer, name, None))
    mask = layer._buffers.get(f"{name}_mask")
    return (None if orig is None else orig.detach().clone()), (None if mask is None else mask.detach().clone())


def _pruned_as_torch(layer: nn.Module, name: str, before: tuple[Optional[Tensor], Optional[Tensor]], reset: bool,
                     initial: Optional[Tensor], resample: bool) -> bool:
    """Whether ``layer.name`` is as a call of torch's pruning (with the lottery-ticket reset when ``reset``) leaves
    it from ``before``: ``name_orig`` the value before (or the saved initial one, or a fresh draw of a torch layer's
    ``reset_parameters``), ``name_mask`` 0/1 with at least the zeros it had, ``name`` the product (of the original
    before the reset)."""
    orig, mask = layer._parameters.get(f"{name}_orig"), layer._buffers.get(f"{name}_mask")
    old, old_mask = before
    if orig is None or mask is None or old is None or mask.shape != orig.shape:
        return False
    kept = torch.equal(orig.detach(), old) or reset and (
        initial is not None and torch.equal(orig.detach(), initial)
        or resample and type(layer).reset_parameters.__module__.startswith("torch.")
        and library_callable(type(layer).reset_parameters))
    zeros_kept = old_mask is None or bool((mask <= old_mask).all())
    served = getattr(layer, name).detach()  # the product as pruned (before the reset; the hook recomputes it)
    return kept and zeros_kept and bool(((mask == 0) | (mask == 1)).all()) \
        and (torch.equal(served, (orig * mask).detach()) or torch.equal(served, old * mask))


def _made_permanent(layer: nn.Module, name: str, product: Tensor) -> bool:
    """Whether ``prune.remove`` left ``layer.name`` a plain parameter holding the pruned product it served."""
    value = layer._parameters.get(name)
    return value is not None and f"{name}_orig" not in layer._parameters and f"{name}_mask" not in layer._buffers \
        and torch.equal(value.detach(), product)


def _unexplained(module: nn.Module, written: Sequence[str], pairs: Sequence[tuple[nn.Module, str]],
                 as_torch: Callable[[nn.Module, str], bool]) -> list[str]:
    """The entries of ``written`` that are not the parameter and buffers of a pruned (layer, name) of ``pairs`` left
    as torch leaves them (``as_torch``)."""
    prefixes = {id(m): f"{path}." if path else "" for path, m in module.named_modules()}
    owners = {f"{prefixes.get(id(layer), '?')}{name}{suffix}": (layer, name)
              for layer, name in pairs for suffix in ("", "_orig", "_mask")}
    verdicts: dict[tuple[int, str], bool] = {}
    wrong = []
    for entry in written:
        kind, _, path = entry.removeprefix("contents of ").partition(" ")
        owner = owners.get(path) if kind in ("parameter", "buffer") else None
        if owner is not None and (id(owner[0]), owner[1]) not in verdicts:
            verdicts[id(owner[0]), owner[1]] = as_torch(*owner)
        if owner is None or not verdicts[id(owner[0]), owner[1]]:
            wrong.append(entry)
    return wrong


def _written_error(what: str, written: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of a write inside ``ModelPruning``'s pruning that is not torch's pruning: ``what`` wrote it."""
    shown = listed(written)
    return PrivacyConfigurationError(
        f"ModelPruning's {what}: {shown}. ModelPruning's "
        "pruning of the released weights is served (torch's masks, the lottery-ticket reset to the initial values); "
        "its callables are your code, and what they write may come from the training data (a fit step on all rows, "
        "a class mean, a label frequency) outside the release. Nothing more was released. Fix: make amount, "
        "apply_pruning and use_lottery_ticket_hypothesis functions of the epoch that write nothing (or plain "
        "values); write the model only in training_step, from the noised update.")
