"""Lightning's ``ModelPruning`` in a private fit: pruning the released weights is post-processing, accepted as made.

``ModelPruning(pruning_fn, amount)`` prunes at an epoch's end with ``torch.nn.utils.prune``. For each (layer, name) it
registers the parameter ``name`` again as ``name_orig`` (the same Parameter object: the optimizer trains on with it),
adds a buffer ``name_mask`` computed from the released weights (their magnitudes; a random draw for the ``random_*``
methods) and a forward pre-hook that sets ``layer.name = name_orig * name_mask`` before every call. With
``use_lottery_ticket_hypothesis`` it then copies the layers' initial values (copied in its ``setup``, before any
release) into ``name_orig``; at the fit's end (``make_pruning_permanent``) ``torch.nn.utils.prune.remove`` writes
``name_orig * name_mask`` back into a plain ``name``.

None of it reads the training data: every value written is a function of the released weights, of the initial ones,
of a random draw and of the epoch number (``amount``, ``apply_pruning`` and ``use_lottery_ticket_hypothesis`` are
given the epoch only). The release boundary (rule 3) would still refuse the writes, as state written outside the
release: :class:`PruningWatch` takes the model's fingerprint around each pruning call of Lightning's own
``ModelPruning`` with one of torch's pruning methods (not of a subclass, nor with a ``BasePruningMethod`` of the
user's: code of the user's may read the data) and accepts exactly what the call changed. ``amount`` given as a
callable is the user's function of the epoch: it is not run again on other data (a closure reading the training loss
would choose the pruned share from it — a documented limit).
The engine follows the renamed parameters at the next step (``PrivateStep.refresh_parameters`` re-attaches it; the
probe runs again before the next release), where example i's gradient of ``name_orig`` is its gradient of ``name``
times the mask (:func:`~lightning_dp.validators.layers.pruned`). Pruning written any other way during the fit (the
user's own hook calling ``torch.nn.utils.prune``) is judged as any other write: refused unless the epoch hooks'
replays find it alike on other data. Pruning before the fit (masks fixed) needs none of this.

It imports no Lightning (the glue imports it; Lightning imports the glue).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn
from torch.nn.utils.prune import BasePruningMethod

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.kept_state import StateFingerprint

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
    return cls.__name__ == "ModelPruning" and cls.__module__.startswith(("pytorch_lightning.", "lightning.")) \
        and getattr(method, "__module__", "") == "torch.nn.utils.prune"


class PruningWatch:
    """Accepts, in ``boundary``'s baseline, what each pruning call of Lightning's ``ModelPruning`` among
    ``callbacks`` writes to ``module`` (module docstring), until :meth:`stop`.

    Args:
        module: the model being fitted.
        boundary: the private step's release boundary (its ``fingerprint``, ``callbacks`` and ``accept``).
        callbacks: the trainer's callbacks.
    """

    def __init__(self, module: nn.Module, boundary: Any, callbacks: Sequence[Any]) -> None:
        self._module, self._boundary = module, boundary
        self._wrapped: list[tuple[Any, str]] = []
        self._known = _pruning_hooks(module)  # pruned before the fit (masks fixed), then each accepted call's
        for callback in callbacks:
            if not lightning_model_pruning(callback):
                continue
            for name in _PRUNING_CALLS:
                callback.__dict__[name] = self._accepting(getattr(callback, name))
                self._wrapped.append((callback, name))

    def _accepting(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def accepting(*args: Any, **kwargs: Any) -> Any:
            fingerprint = self._boundary.fingerprint(self._module)
            before = fingerprint.take(self._boundary.callbacks())
            result = call(*args, **kwargs)
            written = StateFingerprint.changed(before, fingerprint.take(self._boundary.callbacks()))
            if written:
                self._boundary.accept(written)
            self._known |= _pruning_hooks(self._module)
            return result

        accepting._ldp_pruning = True  # type: ignore[attr-defined]
        return accepting

    def check(self) -> None:
        """Refuse a layer pruned during the fit by other code than Lightning's ``ModelPruning`` (a hook of the user's
        calling ``torch.nn.utils.prune``, a subclass of the callback): its mask is kept state no check here judges,
        and it may come from the data (SNIP's or an activation's scores). Raises
        :class:`~lightning_dp.errors.PrivacyConfigurationError` naming the layers and what is served."""
        unknown = sorted({name for name, m in self._module.named_modules()
                          for h in m._forward_pre_hooks.values() if _is_pruning(h) and id(h) not in self._known})
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


def _is_pruning(hook: Any) -> bool:
    return isinstance(hook, BasePruningMethod)


def _pruning_hooks(module: nn.Module) -> set[int]:
    """The ids of the ``torch.nn.utils.prune`` forward pre-hooks on ``module``'s layers now."""
    return {id(h) for m in module.modules() for h in m._forward_pre_hooks.values() if _is_pruning(h)}
