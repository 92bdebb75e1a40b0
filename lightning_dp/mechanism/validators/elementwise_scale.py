"""Verified from autograd's record: a layer whose output is its weight times something the weight does not touch.

RMSNorm-style layers written by model libraries (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, ``MistralRMSNorm``,
``Qwen2RMSNorm``, …) have no rule of their own: they are not ``nn.RMSNorm``, and the engines differentiate them again
per example (``torch.func.vmap``), which costs more than the layer's own forward and backward at every call. Most end
in ``return self.weight * y`` (``y`` the normalised input, maybe cast), and then example i's weight gradient is, for
the mean loss's output gradient δ (n: the number of examples),

    g_i = n · Σ_t δ_{i,t} ⊙ y_{i,t}        (Σ_t over every position of example i; ⊙ per feature)

exact whatever ``y`` is, provided ``y`` does not depend on the weight. Nothing is taken from the class's name or
source. :func:`scaled_operand` reads the call's last autograd node, right after the forward:

- the output is made by one multiplication (``MulBackward0``), one of whose operands is the weight, maybe cast,
  reshaped or shifted by a constant (``self.weight.float()``, ``weight.view(1, 1, d)``, Gemma's ``1.0 + weight``):
  the autograd path from that operand reaches the weight's accumulator through casts, views and additions of a
  constant only (each of derivative 1), and the operand has the weight's d elements, broadcast along the output's
  last dimension only;
- the other operand ``y`` has the output's shape (the weight is broadcast, never the examples' values), and its
  autograd history, walked back to the call's inputs, never reaches the weight (a second use of the weight inside
  the call, ``self.weight * (x * self.weight.mean())``, would add a gradient this formula misses).

A layer that passes gets the formula above (:mod:`~lightning_dp.mechanism.grad_sample.elementwise_scale`); any other
(``(1 - self.weight) * y``, ``2 * self.weight * y``, a bias added after, a history too long to walk) keeps the
per-example vmap.
The first step's probe compares the result with autograd's gradient, as for every rule.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import Tensor, nn

_PASS_THROUGH = frozenset({"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                           "UnsqueezeBackward0", "AliasBackward0"})
"""Autograd nodes between the weight and its operand that keep its values (casts, views of its d elements)."""

WALK_LIMIT = 256
"""Most autograd nodes walked back from ``y`` before giving up (the call then keeps the per-example vmap)."""


def scale_candidate(module: nn.Module) -> Optional[nn.Parameter]:
    """The weight of a layer :func:`scaled_operand` may serve: one trainable 1-D parameter of its own, and no
    children with parameters; else None."""
    params = list(module.parameters())
    if len(params) != 1 or not params[0].requires_grad or params[0].dim() != 1:
        return None
    own = list(module.parameters(recurse=False))
    return params[0] if own and own[0] is params[0] else None


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


def _operand_shape(saved: Optional[Tensor], node: Any, nr: int) -> Optional[tuple[int, ...]]:
    """The shape of the weight's operand of the multiplication. Autograd saves that operand only when the other one,
    ``y``, requires grad (its gradient is δ ⊙ w): an ``nn.RMSNorm`` on the data itself (an input that does not require
    grad) leaves it unsaved, and its shape is then read from the autograd node that produced it (its output
    metadata), the weight's own accumulator or the cast or view in between."""
    if isinstance(saved, Tensor):
        return tuple(saved.shape)
    metadata = getattr(node, "_input_metadata", None)
    return None if metadata is None or nr >= len(metadata) else tuple(metadata[nr].shape)


def scaled_operand(weight: Tensor, out: Any, inputs: Sequence[Tensor]) -> Optional[Tensor]:
    """``y`` (detached) when the call's output ``out`` is verified to be ``weight ⊙ y`` with ``y`` independent of
    ``weight`` (module docstring); else None. ``inputs``: the call's tensor arguments (where the walk stops)."""
    if not isinstance(out, Tensor) or out.dim() < 2 or out.shape[-1] != weight.numel():
        return None
    node = out.grad_fn
    if node is None or node.name() != "MulBackward0":
        return None
    (left, left_nr), (right, right_nr) = node.next_functions
    try:
        if _is_weight(left, weight) and not _is_weight(right, weight):
            w_shape, y, y_node = _operand_shape(node._saved_self, left, left_nr), node._saved_other, right
        elif _is_weight(right, weight) and not _is_weight(left, weight):
            w_shape, y, y_node = _operand_shape(node._saved_other, right, right_nr), node._saved_self, left
        else:
            return None
    except RuntimeError:  # an operand autograd did not save
        return None
    if not isinstance(y, Tensor) or y.shape != out.shape or w_shape is None or math.prod(w_shape) != weight.numel():
        return None
    if len(w_shape) > 1 and any(s != 1 for s in w_shape[:-1]):
        return None
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    if y_node is not None and _reaches(y_node, weight, stop):
        return None
    return y.detach()
