"""What the first step's forward calls, for the probe's diagnosis: a double backward, a sort of the batch.

The probe (:mod:`.probe`) compares each example's gradient in a batch and alone. Two things published code does make
those comparisons fail for a reason "examples interact" would misname:

- **a double backward**: a physics-informed loss (the residual of a differential equation, built from
  ``torch.autograd.grad(u, x, create_graph=True)``), a gradient penalty, input-gradient regularisation. The loss
  depends on ∂f/∂x as well as on the layers' outputs, and every per-example engine here computes example i's
  gradient layer by layer from its output gradient alone, g_i = n · ∂⟨f(θ, x_i), δ_i⟩/∂θ: the second-order path
  (through ∂f/∂x) is not in it, and the inner ``autograd.grad`` also fires the engines' output hooks. No engine serves
  it:
  :func:`double_backward_error` names the cause and the fixes, whatever the comparisons said;
- **a batch sorted** before packing (``lengths.sort(descending=True)`` and ``x[order]``, then
  ``pack_padded_sequence(..., enforce_sorted=True)``): each row is still one example, in another order. The probe
  accepts a permutation (:func:`~.probe.same_norms`); when the examples do interact after a sort (outputs in sorted
  order paired with targets in the batch's order), the error says so (:func:`sorted_batch_hint`).
- **a class-weighted mean loss** (``nn.CrossEntropyLoss(weight=w)``, ``F.nll_loss(..., weight=w)`` with class
  indices and the default ``reduction='mean'``): torch divides by Σ w[y_j] over the batch's labels, not by B, so
  example i's gradient depends on the other examples' labels; the error names it (:func:`weighted_mean_hint`).

:class:`StepWatch` records both while the probe's passes run (once per fit: its cost is a Python call per torch call
of those passes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_dp.errors import PrivacyConfigurationError

SORTS = frozenset({"sort", "argsort", "msort"})
"""torch functions (and Tensor methods) that order a tensor: a batch sorted by length before packing."""

WEIGHTED_LOSSES = {"cross_entropy": 6, "nll_loss": 6}
"""Class-weighted losses whose ``reduction='mean'`` divides by the sum of the batch's label weights (with class-index
targets): the function's name and the position of its ``reduction`` argument."""


class StepWatch(TorchFunctionMode):
    """Records, over the torch calls it sees, whether a gradient was taken with ``create_graph=True``
    (:attr:`double_backward`), whether anything was sorted (:attr:`sorted`) and whether a class-weighted loss was
    averaged by its weights (:attr:`weighted_mean`, :func:`weighted_mean`)."""

    def __init__(self) -> None:
        super().__init__()
        self.double_backward = False
        self.sorted = False
        self.weighted_mean = False
        self.differentiated: set[int] = set()
        """The ids of the leaves that require grad (parameters, an input made to require grad) the step took
        ``torch.autograd.grad`` with respect to: for a parameter, the batch's own, un-noised gradient of it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            self.double_backward |= bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
            inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs or ())
            self.differentiated.update(id(t) for t in inputs
                                       if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad)
        elif getattr(func, "__name__", "") == "backward":  # Tensor.backward(gradient, retain_graph, create_graph)
            self.double_backward |= bool(kwargs.get("create_graph", args[3] if len(args) > 3 else False))
        elif getattr(func, "__name__", "") in SORTS:
            self.sorted = True
        elif getattr(func, "__name__", "") in WEIGHTED_LOSSES:
            self.weighted_mean |= weighted_mean(func.__name__, args, kwargs)
        return func(*args, **kwargs)


def weighted_mean(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``name`` (:data:`WEIGHTED_LOSSES`) averages by the batch's label weights: a ``weight``, class
    index targets (class probabilities are averaged over the batch size) and reduction 'mean' (the legacy
    ``size_average``/``reduce`` flags left at their defaults)."""
    def argument(key: str, position: int) -> Any:
        return kwargs[key] if key in kwargs else args[position] if len(args) > position else None

    weight, target = argument("weight", 2), argument("target", 1)
    reduction = argument("reduction", WEIGHTED_LOSSES[name]) or "mean"
    legacy = argument("size_average", 3) is False or argument("reduce", 5) is False
    return (isinstance(weight, torch.Tensor) and isinstance(target, torch.Tensor) and not target.is_floating_point()
            and reduction == "mean" and not legacy)


def double_backward_error(engine: str) -> PrivacyConfigurationError:
    """The probe's refusal of a training step that differentiates through a gradient (module docstring)."""
    return PrivacyConfigurationError(
        "The training step takes a gradient with create_graph=True and differentiates through it (a double "
        "backward: a physics-informed residual built from torch.autograd.grad(u, x, create_graph=True), a gradient "
        "penalty, input-gradient regularisation). The loss then depends on the derivatives of the layers' outputs as "
        "well as on the outputs, and no per-example engine serves it: 'ghost', 'vmap' and 'opacus_hooks' all compute "
        "example i's gradient layer by layer from the gradient reaching each layer's output (engine "
        f"'{engine}' was tried), which misses the second-order path, so per-example clipping would not bound "
        "the example's true gradient. Nothing was released. Fixes: replace the autograd derivative by a finite "
        "difference of the model's own outputs, e.g. (u(x + h) - u(x - h)) / (2h) (first order in the parameters: "
        "served exactly by every engine); or drop create_graph where the derivative need not be trained through "
        "(torch.autograd.grad(..., create_graph=False) makes it a constant). torch.func's transforms (grad, "
        "vmap(grad), jacrev, hessian) called in the step take their gradients with create_graph=True too: per-example "
        "gradients or norms the step computes itself (to weight the loss by them, zoo29 n14) are DPStrategy's work — "
        "return the plain loss; a weighting normalised over the batch would make the examples interact anyway.")


def weighted_mean_hint() -> str:
    """What an interaction after a class-weighted mean loss usually is (added to the probe's interaction error)."""
    return ("The step calls a class-weighted loss with reduction='mean' (nn.CrossEntropyLoss(weight=...) or "
            "F.cross_entropy/nll_loss(..., weight=...)): torch divides it by the sum of the weights of the batch's "
            "labels, not by the number of examples, so each example's gradient depends on the other examples' "
            "labels. Use reduction='none' and take the plain mean of the per-example losses, e.g. "
            "F.cross_entropy(logits, y, weight=w, reduction='none').mean() (or return that [B] vector from "
            "training_step). ")


def sorted_batch_hint() -> str:
    """What an interaction after a sort of the batch usually is (added to the probe's interaction error)."""
    return ("The step sorts a tensor (torch.sort/argsort: a batch sorted by length before "
            "pack_padded_sequence(enforce_sorted=True)?). Reordering the examples alone is served (each row is "
            "still one example); here the examples' outputs and targets are not paired example by example after the "
            "sort: apply the same order to the targets (y[order]) or undo it on the outputs (out[order.argsort()]), "
            "or pack unsorted with enforce_sorted=False (nn.LSTM/GRU/RNN serve it). ")
