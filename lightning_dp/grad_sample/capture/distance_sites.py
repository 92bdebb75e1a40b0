"""Distances of the examples to a followed tensor: broadcast sites (:mod:`.broadcast_sites`).

Learnable prototypes (prototypical heads, center-based classifiers, RBF layers) keep a ``[k, d]`` parameter on the
LightningModule and score each example by its distance to them, ``logits = -torch.cdist(features, self.prototypes)``.
The prototypes are read outside any layer (:mod:`.root_parameters`), and ``cdist`` is neither a broadcast nor a
product, so without this site their per-example gradients were missing and the step was refused.

Row i of ``cdist(x, t)`` depends on x's row i and on t alone, so example i's gradient of t is the vector-Jacobian
product of ``cdist(x_i, t)`` with the output gradient's row i, taken for all rows at once with ``torch.func.vmap``
(the same call, the same ``p`` and ``compute_mode``), and mapped back to t's sources. Rows of verified flattened
examples (n·m rows) are summed per example. Not a site (the step is refused as before) when t holds the examples'
rows itself, when x is followed too, or when the result's dimension 0 is not x's.

``F.cosine_similarity(z[:, None, :], self.prototypes[None], dim=-1)`` (cosine classifiers, few-shot heads) and
``F.pairwise_distance`` broadcast their two inputs and reduce one dimension of the broadcast shape: row i of the result
depends on the examples' row i and on the followed tensor t alone when the reduced dimension is not the broadcast's
dimension 0 and t has none there (size 1, or fewer dimensions). Then t is replaced by its explicit expansion to the n
rows, as at any broadcast site (the same values), and the expansion's row i receives example i's gradient
(:func:`reduced_broadcast_site`). Not a site when the reduced dimension is dimension 0 or both inputs are followed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

if TYPE_CHECKING:
    from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites


def cdist_site(sites: "BroadcastSites", args: tuple, kwargs: dict, result: Any, rows: set[int]) -> bool:
    """Serve ``torch.cdist(x1, x2, …)`` with the examples in x1 ``[n, …, d]`` and a followed x2 (module docstring):
    a hook on the result hands example i's gradient of x2 to its sources. False: not a site."""
    parsed = _cdist_arguments(args, kwargs)
    if parsed is None or not isinstance(result, Tensor) or not result.requires_grad:
        return False
    x, t, rest = parsed
    if (sites._sources(x) or not sites._sources(t) or x.dim() < 2 or result.dim() != x.dim()
            or result.shape[0] != x.shape[0] or (2 < t.dim() == x.dim() and t.shape[0] != 1)):
        return False
    if not sites._holds_examples(x, rows):
        return False
    n, sources, edge = sites.n, sites._sources(t), get_gradient_edge(t)
    inputs, table = x.detach(), t.detach()

    def one(xi: Tensor, gi: Tensor) -> Tensor:
        _, pull = torch.func.vjp(lambda u: torch.cdist(xi.unsqueeze(0), u, **rest), table.to(gi.dtype))
        return pull(gi.unsqueeze(0))[0]

    def hook(g: Tensor) -> None:
        if sites._mapping[0]:
            return
        per_row = torch.func.vmap(one)(inputs.to(g.dtype), g.detach())
        per_example = per_row if per_row.shape[0] == n else per_row.reshape(n, -1, *per_row.shape[1:]).sum(1)
        for source in sources:
            source.arrive_rows(None if t is source.out() else edge, per_example)

    result.register_hook(hook)
    return True


REDUCED_BROADCASTS: dict[str, tuple[str, ...]] = {
    "cosine_similarity": ("x1", "x2", "dim", "eps"),
    "pairwise_distance": ("x1", "x2", "p", "eps", "keepdim"),
}
"""Two-input operations that broadcast their inputs and reduce one dimension (``dim``; the last for
``pairwise_distance``): the arguments' names in order."""


def reduced_broadcast_site(sites: "BroadcastSites", name: str, args: tuple, kwargs: dict, result: Any,
                           rows: set[int]) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` of a :data:`REDUCED_BROADCASTS` call with its one followed input replaced by the expansion
    to the result's n rows (module docstring: the caller runs the call on them), or None: not a site."""
    names = REDUCED_BROADCASTS[name]
    if len(args) > len(names) or any(k not in names for k in kwargs) or not isinstance(result, Tensor):
        return None
    bound = {**dict(zip(names, args)), **kwargs}
    x1, x2 = bound.get("x1"), bound.get("x2")
    if not isinstance(x1, Tensor) or not isinstance(x2, Tensor):
        return None
    followed = [k for k, v in (("x1", x1), ("x2", x2)) if sites._sources(v)]
    if len(followed) != 1:
        return None
    t = bound[followed[0]]
    rank = max(x1.dim(), x2.dim())
    reduced = bound.get("dim", 1) if name == "cosine_similarity" else -1
    if rank < 2 or not isinstance(reduced, int) or reduced % rank == 0 or not result.dim() \
            or result.shape[0] not in rows or not (t.dim() < rank or t.shape[0] == 1):
        return None
    bound[followed[0]] = sites._expanded(t, sites._sources(t), rank, result.shape[0])
    return (), bound


def _cdist_arguments(args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Tensor, dict]]:
    """(x1, x2, the other arguments by name) of a ``torch.cdist`` call, or None."""
    names = ("x1", "x2", "p", "compute_mode")
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = {**dict(zip(names, args)), **kwargs}
    x, t = bound.pop("x1", None), bound.pop("x2", None)
    if not isinstance(x, Tensor) or not isinstance(t, Tensor):
        return None
    return x, t, bound
