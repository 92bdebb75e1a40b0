"""Autograd's record of one ``nn.MultiheadAttention`` self-attention call: its two projection nodes, their inputs,
and (by node pre-hooks) their output gradients, kept by the capture for
:mod:`~lightning_dp.grad_sample.attention_projections` (which explains the formulas and the checks).

Found right after the call by walking back from its output to the matrix-product nodes that read ``in_proj_weight``
and ``out_proj.weight`` through their transpose (exactly one of each); the in-projection's input must equal the call's
query laid out ``[T, B, E]`` (torch's rows t·B + b), checked here at every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

_WALK_LIMIT = 400
"""Most autograd nodes walked back from the module's output to find its projections."""


@dataclass
class Projections:
    """One call's projection inputs (time-major flattened rows) and, after backward, their output gradients."""

    x_in: Tensor
    x_out: Tensor
    grads: list[Optional[Tensor]] = field(default_factory=lambda: [None, None])  # ∂Y, δ

    def hook(self, k: int, mapping: Callable[[], bool]) -> Callable[[tuple], None]:
        """A node pre-hook keeping output gradient k (accumulated over backward passes; ignored during a map-back)."""
        def keep(grad_outputs: tuple) -> None:
            g = grad_outputs[0]
            if g is None or mapping():
                return
            g = g.detach()
            self.grads[k] = g if self.grads[k] is None else self.grads[k] + g
        return keep


def projection_candidate(module: nn.Module, args: Sequence[Any], kwargs: dict) -> bool:
    """torch's own ``nn.MultiheadAttention`` forward, packed projections, no ``bias_k``/``bias_v``, called as
    self-attention on a batched tensor (query, key and value the same tensor)."""
    if type(module) is not nn.MultiheadAttention or not module._qkv_same_embed_dim:
        return False
    if module.bias_k is not None or module.bias_v is not None or module.in_proj_weight is None:
        return False
    if len(args) < 3 or kwargs.keys() & {"query", "key", "value"}:
        return False
    q, k, v = args[:3]
    return isinstance(q, Tensor) and q.dim() == 3 and q is k and k is v


def _reads(node: Any, weight: Tensor) -> bool:
    """Whether autograd node ``node`` takes ``weight`` through its transpose (a linear map's matrix product)."""
    for nxt, _ in node.next_functions:
        if nxt is not None and nxt.name() == "TBackward0":
            acc = nxt.next_functions[0][0]
            if getattr(acc, "variable", None) is weight:
                return True
    return False


def _saved_input(node: Any) -> Optional[Tensor]:
    """The ``[rows, E]`` input a matrix-product node saved (``addmm``'s mat1, ``mm``'s self)."""
    for name in ("_saved_mat1", "_saved_self"):
        try:
            t = getattr(node, name)
        except (AttributeError, RuntimeError):
            continue
        if isinstance(t, Tensor) and t.dim() == 2:
            return t
    return None


def record_projections(module: nn.MultiheadAttention, query: Tensor, out: Tensor,
                       mapping: Callable[[], bool]) -> Optional[Projections]:
    """Find the call's two projection nodes from its output ``out``, verify the in-projection's input against
    ``query`` (module docstring), keep both inputs and hook both nodes; None where any step fails."""
    nodes: dict[str, list[Any]] = {"in": [], "out": []}
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if len(seen) > _WALK_LIMIT:
            return None
        if fn.name() in ("AddmmBackward0", "MmBackward0"):
            if _reads(fn, module.in_proj_weight):
                nodes["in"].append(fn)
                continue  # the in-projection's input is the call's query: nothing of the call lies beyond
            if _reads(fn, module.out_proj.weight):
                nodes["out"].append(fn)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    if len(nodes["in"]) != 1 or len(nodes["out"]) != 1:
        return None
    x_in, x_out = _saved_input(nodes["in"][0]), _saved_input(nodes["out"][0])
    q = query if not module.batch_first else query.transpose(0, 1)  # [T, B, E]
    if x_in is None or x_out is None or x_in.shape != (q.shape[0] * q.shape[1], q.shape[2]):
        return None
    if not torch.equal(x_in.view(q.shape), q.detach().to(x_in.dtype)):
        return None
    found = Projections(x_in.detach(), x_out.detach())
    nodes["in"][0].register_prehook(found.hook(0, mapping))
    nodes["out"][0].register_prehook(found.hook(1, mapping))
    return found
