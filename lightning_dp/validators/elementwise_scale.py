"""Verified from autograd's record: a layer whose output is elementwise-affine in its parameters.

RMSNorm-style layers written by model libraries (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, ``MistralRMSNorm``,
``Qwen2RMSNorm``, …) and the global layer norms of speech separation (Conv-TasNet's and DPRNN's ``GlobalLayerNorm``:
``self.weight * (x - mean) / torch.sqrt(var + eps) + self.bias`` with weight and bias of shape [C, 1] on [B, C, T])
have no rule of their own: they are not torch's norms, and the engines differentiate them again per example
(``torch.func.vmap``), which costs more than the layer's own forward and backward at every call. They end in

    out = w ⊙ y + b        y = u_1 ⋯ u_k / (s_1 ⋯ s_m)   (the factors' product, broadcast to the output)

with w and b the layer's parameters broadcast over the output (w: the weight's elements laid out along some of the
output's dimensions, never along the examples), and then example i's gradients are, for the mean loss's output
gradient δ (n: the number of examples),

    g_i(w) = n · Σ_{positions w is broadcast over} δ_i ⊙ y_i        g_i(b) = n · Σ_{positions b is broadcast over} δ_i

exact whatever the factors are, provided none of them depends on w or b. Nothing is taken from the class's name or
source. :func:`scaled_operand` reads the call's last autograd nodes, right after the forward:

- optionally, the output is an addition (``AddBackward0``, α = 1) of the bias — one of the layer's parameters, maybe
  cast, reshaped or shifted by a constant — and a term of the output's shape;
- the term (or the output) is a chain of multiplications and divisions (``MulBackward0``, ``DivBackward0``) whose
  one side carries the chain on and whose other side (a multiplied factor u_j; a divisor s_j, always the denominator)
  never reaches a parameter, ending at a multiplication by the weight: the autograd path from that operand reaches
  the weight's accumulator through casts, views and additions of a constant only (each of derivative 1:
  ``self.weight.float()``, ``weight.view(1, C, 1)``, ``weight[:, None]``, Gemma's ``1.0 + weight``), and the operand
  has the weight's elements (the shapes of the operands, padded on the left, are 1 along the examples);
- the factors' autograd histories, walked back to the call's inputs, never reach a parameter (a second use of the
  weight inside the call, ``self.weight * (x * self.weight.mean())``, would add a gradient this formula misses).

The operands' shapes are read from autograd's input metadata of the next nodes (a torch without it: not served).
A layer that passes gets the formula above (:mod:`~lightning_dp.grad_sample.elementwise_scale`); any other
(``(1 - self.weight) * y``, ``2 * self.weight * y``, ``y - bias``, a history too long to walk) keeps the per-example
vmap. The first step's probe compares the result with autograd's gradient, as for every rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

_PASS_THROUGH = frozenset({"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                           "UnsqueezeBackward0", "AliasBackward0"})
"""Autograd nodes between a parameter and its operand that keep its values (casts, views of its elements)."""

WALK_LIMIT = 256
"""Most autograd nodes walked back from a factor before giving up (the call then keeps the per-example vmap)."""

CHAIN_LIMIT = 8
"""Most multiplications and divisions between the output and the weight (more: the per-example vmap)."""


@dataclass(eq=False)
class ScaledOperand:
    """A call verified as ``out = w ⊙ (Π operands / Π divisors) + b`` (module docstring), its tensors detached.

    ``weight_shape``/``bias_shape``: the shapes of the operands w and b as the output's operation saw them (each the
    parameter's elements, broadcast over the output); ``weight``/``bias``: the parameters (None: absent)."""

    shape: torch.Size
    weight: Optional[Tensor] = None
    weight_shape: Optional[torch.Size] = None
    operands: tuple[Tensor, ...] = ()
    divisors: tuple[Tensor, ...] = ()
    bias: Optional[Tensor] = None
    bias_shape: Optional[torch.Size] = None

    @property
    def y(self) -> Tensor:
        """∂out/∂w elementwise: the factors' product broadcast to the output's shape."""
        y = self.operands[0] if self.operands else torch.ones((), dtype=self.divisors[0].dtype,
                                                               device=self.divisors[0].device)
        for u in self.operands[1:]:
            y = y * u
        for s in self.divisors:
            y = y / s
        return y.expand(self.shape)


Candidate = Union[Tensor, Sequence[Tensor]]


def scale_candidate(module: nn.Module) -> Optional[tuple[nn.Parameter, ...]]:
    """The parameters of a layer :func:`scaled_operand` may serve: one or two trainable parameters of its own (a
    weight, maybe a bias), and no children with parameters; else None."""
    params = list(module.parameters())
    own = list(module.parameters(recurse=False))
    trainable = tuple(p for p in own if p.requires_grad)
    if len(own) != len(params) or not 1 <= len(trainable) <= 2:
        return None
    return trainable


def _shifted(node: Any) -> Any:
    """The node before an addition or subtraction of a constant whose derivative along the one differentiable input
    is 1 (``1.0 + w``, ``w - c``: Gemma's ``(1 + weight) ⊙ y``), else None. ``c - w`` (−1) and ``c + α·w`` with α ≠ 1
    are not."""
    live = [k for k, (fn, _) in enumerate(node.next_functions) if fn is not None]
    if len(live) != 1:
        return None
    if live[0] == 1 and (node.name() == "SubBackward0" or getattr(node, "_saved_alpha", 1) != 1):
        return None
    return node.next_functions[live[0]][0]


def _is_weight(node: Any, weight: Tensor) -> bool:
    """Whether autograd node ``node`` passes the weight's values on with derivative 1 from its accumulator: casts,
    views, and shifts by a constant (:func:`_shifted`)."""
    for _ in range(8):
        if node is None:
            return False
        if node.name() in _PASS_THROUGH:
            node = node.next_functions[0][0]
            continue
        if node.name() in ("AddBackward0", "SubBackward0"):
            node = _shifted(node)
            continue
        return getattr(node, "variable", None) is weight
    return False


def _reaches(node: Any, weight: Tensor, stop: set, limit: int = WALK_LIMIT) -> bool:
    """Whether the autograd history from ``node`` reaches ``weight`` before the call's inputs (``stop``); True also
    when the history is longer than ``limit`` nodes (undecided counts as reached)."""
    seen, todo = set(), [node]
    while todo:
        fn = todo.pop()
        if fn is None or fn in stop or fn in seen:
            continue
        seen.add(fn)
        if len(seen) > limit or getattr(fn, "variable", None) is weight:
            return True
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return False


def _param_of(node: Any, params: Sequence[Tensor]) -> Optional[Tensor]:
    """The parameter whose values ``node`` passes on with derivative 1 (:func:`_is_weight`), or None."""
    return next((p for p in params if _is_weight(node, p)), None)


def _operand_shape(edge: tuple[Any, int]) -> torch.Size:
    """The shape of the tensor an autograd edge carries (the next node's input metadata)."""
    fn, nr = edge
    return torch.Size(fn._input_metadata[nr].shape)


def _free(node: Any, params: Sequence[Tensor], stop: set) -> bool:
    """Whether the autograd history from ``node`` reaches none of ``params`` (a constant: None)."""
    return node is None or not any(_reaches(node, p, stop) for p in params)


def _along_examples(shape: torch.Size, out: torch.Size) -> bool:
    """Whether an operand of ``shape`` is laid out along the examples (dimension 0 of the output), or does not
    broadcast to the output."""
    padded = (1,) * (len(out) - len(shape)) + tuple(shape)
    try:
        fits = torch.broadcast_shapes(torch.Size(padded), out) == out
    except RuntimeError:
        return True
    return len(padded) != len(out) or padded[0] != 1 or not fits


def _bias_split(node: Any, params: Sequence[Tensor]) -> Optional[tuple[Any, Tensor, torch.Size]]:
    """For an output ``term + b`` (``AddBackward0``, α = 1, b one of ``params`` through casts and views): (the
    term's node, b, the shape of b's operand); else None."""
    if node.name() != "AddBackward0" or getattr(node, "_saved_alpha", 1) != 1:
        return None
    edges = node.next_functions
    for k in (0, 1):
        bias = None if edges[k][0] is None else _param_of(edges[k][0], params)
        if bias is not None:
            return edges[1 - k][0], bias, _operand_shape(edges[k])
    return None


def _weight_chain(node: Any, params: Sequence[Tensor], stop: set):
    """Follow multiplications and divisions from ``node`` down to the multiplication by a parameter (the weight):
    (weight, its operand's shape, the multiplied factors, the divisors), the factors detached; None if the chain is
    anything else (module docstring)."""
    operands: list[Tensor] = []
    divisors: list[Tensor] = []
    for _ in range(CHAIN_LIMIT):
        if node is None or node.name() not in ("MulBackward0", "DivBackward0"):
            return None
        (left, ln), (right, rn) = node.next_functions
        lw = None if left is None else _param_of(left, params)
        rw = None if right is None else _param_of(right, params)
        if node.name() == "DivBackward0":  # the chain goes on in the numerator; the divisor is free of parameters
            if not _free(right, params, stop):
                return None
            divisors.append(node._saved_other.detach())
            if lw is not None:
                return lw, _operand_shape((left, ln)), operands, divisors
            node = left
        elif lw is not None and rw is None and _free(right, params, stop):  # w ⊙ u
            operands.append(node._saved_other.detach())
            return lw, _operand_shape((left, ln)), operands, divisors
        elif rw is not None and lw is None and _free(left, params, stop):  # u ⊙ w
            operands.append(node._saved_self.detach())
            return rw, _operand_shape((right, rn)), operands, divisors
        elif _free(right, params, stop) and not _free(left, params, stop):  # (chain) ⊙ u
            operands.append(node._saved_other.detach())
            node = left
        elif _free(left, params, stop) and not _free(right, params, stop):  # u ⊙ (chain)
            operands.append(node._saved_self.detach())
            node = right
        else:
            return None
    return None


def scaled_operand(candidate: Candidate, out: Any, inputs: Sequence[Tensor]) -> Optional[ScaledOperand]:
    """The call's :class:`ScaledOperand` when its output ``out`` is verified to be ``w ⊙ y + b`` with y free of the
    ``candidate`` parameters (:func:`scale_candidate`, or one weight); else None. ``inputs``: the call's tensor
    arguments (where the walks stop)."""
    params = (candidate,) if isinstance(candidate, Tensor) else tuple(candidate)
    if not isinstance(out, Tensor) or out.dim() < 2 or out.grad_fn is None:
        return None
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    try:
        return _verified(out, params, stop)
    except (RuntimeError, AttributeError):  # an operand autograd did not save; a torch without input metadata
        return None


def _verified(out: Tensor, params: tuple[Tensor, ...], stop: set) -> Optional[ScaledOperand]:
    node, bias, bias_shape = out.grad_fn, None, None
    split = _bias_split(node, params)
    if split is not None:
        node, bias, bias_shape = split
        if bias.numel() != bias_shape.numel() or _along_examples(bias_shape, out.shape):
            return None
        if _free(node, params, stop):  # a term without the weight (a frozen one): the bias alone
            return ScaledOperand(out.shape, bias=bias, bias_shape=bias_shape)
    chain = _weight_chain(node, params, stop)
    if chain is None:
        return None
    weight, weight_shape, operands, divisors = chain
    if weight is bias or weight.numel() != weight_shape.numel() or _along_examples(weight_shape, out.shape):
        return None
    term = torch.broadcast_shapes(weight_shape, *(t.shape for t in (*operands, *divisors)))
    if term != out.shape:  # the term has the output's shape: the bias is what is broadcast, never the term
        return None
    return ScaledOperand(out.shape, weight, weight_shape, tuple(operands), tuple(divisors), bias, bias_shape)
