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


class StepWatch(TorchFunctionMode):
    """Records, over the torch calls it sees, whether a gradient was taken with ``create_graph=True``
    (:attr:`double_backward`) and whether anything was sorted (:attr:`sorted`)."""

    def __init__(self) -> None:
        super().__init__()
        self.double_backward = False
        self.sorted = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            self.double_backward |= bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))
        elif getattr(func, "__name__", "") == "backward":  # Tensor.backward(gradient, retain_graph, create_graph)
            self.double_backward |= bool(kwargs.get("create_graph", args[3] if len(args) > 3 else False))
        elif getattr(func, "__name__", "") in SORTS:
            self.sorted = True
        return func(*args, **kwargs)


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
        "(torch.autograd.grad(..., create_graph=False) makes it a constant).")


def sorted_batch_hint() -> str:
    """What an interaction after a sort of the batch usually is (added to the probe's interaction error)."""
    return ("The step sorts a tensor (torch.sort/argsort: a batch sorted by length before "
            "pack_padded_sequence(enforce_sorted=True)?). Reordering the examples alone is served (each row is "
            "still one example); here the examples' outputs and targets are not paired example by example after the "
            "sort: apply the same order to the targets (y[order]) or undo it on the outputs (out[order.argsort()]), "
            "or pack unsorted with enforce_sorted=False (nn.LSTM/GRU/RNN serve it). ")
