"""The same computation once more in float64: where float32 round-off vanishes and a true dependence stays.

The batch check (:mod:`~lightning_dp.validators.batch_check`) compares one example's gradient computed in batches of
different composition, at τ = 64 float32 ulps of the largest norm (:mod:`~lightning_dp.tolerance`). A model whose
float32 round-off is amplified (a feature encoder's group norm over a long signal, a weight-normed positional
convolution) can miss τ by a little with independent examples. Widening τ would let a true small interaction through;
instead a near miss is computed again under :func:`in_float64`: every float32 parameter and buffer of the module and
every float32 tensor a torch call receives (the batch read from the data, a constant) is taken in float64, and a
``dtype=torch.float32`` asked for (``.float()``, ``softmax(dtype=torch.float32)``) is float64 too. Round-off there is
2^-29 of float32's, so the re-judged comparison can hold a far tighter tolerance than τ: an interaction of the size
float32 refused stays refused. A call that still computes in a narrower float (an in-place write into a float32
tensor kept outside the module, autocast) clears :attr:`Float64.complete`: the float32 verdict then stands.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import chain
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map


class Float64(TorchFunctionMode):
    """Every float32 tensor or dtype a torch call receives taken as float64 (module docstring); :attr:`complete`
    false once a call returned a floating tensor narrower than float64 (a write into a float32 tensor in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.complete = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        func = Tensor.double if func is Tensor.float else func
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__") or name == "__setitem__"
        first, rest = (args[0], args[1:]) if in_place and args else (None, args)
        rest, kwargs = tree_map(_wide, (tuple(rest), kwargs or {}))
        out = func(*((first, *rest) if first is not None else rest), **kwargs)
        if any(isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
               for t in tree_flatten(out)[0]):
            self.complete = False
        return out


def _wide(x):
    if isinstance(x, Tensor) and x.dtype == torch.float32:
        return x.double()
    return torch.float64 if x is torch.float32 else x


@contextmanager
def in_float64(module: nn.Module) -> Iterator[Float64]:
    """``module``'s float32 parameters and buffers in float64 (the same tensor objects: an engine's and an optimizer's
    references stay valid; their ``.grad`` dropped), torch's default dtype float64 and :class:`Float64` on, until the
    block ends; then every tensor gets its own float32 storage back, bit for bit, and its ``.grad`` as it was."""
    kept, seen = [], set()
    for t in chain(module.parameters(), module.buffers()):
        if id(t) not in seen and t.dtype == torch.float32:
            seen.add(id(t))
            kept.append((t, t.data, t.grad))
            t.grad = None
            t.data = t.data.double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64() as mode:
            yield mode
    finally:
        torch.set_default_dtype(default)
        for t, data, grad in kept:
            t.grad = None
            t.data = data
            t.grad = grad
