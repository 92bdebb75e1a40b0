"""Clipped sums computed one layer at a time, when read: the ghost engine's sums for sharded models.

The ghost engine (:mod:`.ghost`) first computes every example's whole-model norm, hence the clip
factors c_i = min(1, C/‖g_i‖) (docs/algorithms.md, clip_C); each layer's clipped sum Σ_i c_i g_i is then
one contraction of that layer's captured activations and output gradients. Computed eagerly, the sums
of all layers exist at once: one model-sized gradient, whatever the sharding. :class:`StreamedSums`
is the same mapping parameter → Σ_i c_i g_i, computed when a parameter is first read and forgotten
when it is popped: a consumer that pops one parameter at a time (the sharded privatizer copies each
into a reduce-scatter bucket) never holds more than one layer's sums, and each layer's captured
tensors are released as soon as its sums are computed. Reading every entry (``items()``, merging
physical batches, diagnostics) gives exactly the eager sums.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Iterator, Sequence

from torch import Tensor


class StreamedSums(MutableMapping):
    """Parameter → Σ_i c_i g_i, each layer's contraction run on first read.

    Args:
        params: the parameters, in the order iteration yields them.
        layers: the per-layer statistics by key; each has ``sums(c) -> {parameter: sum}``.
        keys: for each parameter, the keys of the layers contributing to its sum (several for a tied weight).
        c: the per-example clip factors.
    """

    def __init__(self, params: Sequence[Tensor], layers: dict[int, Any], keys: dict[Tensor, list[int]],
                 c: Tensor) -> None:
        self._order = list(params)
        self._layers = dict(layers)
        self._keys = keys
        self._c = c
        self._ready: dict[Tensor, Tensor] = {}
        self._popped: set[int] = set()

    def __getitem__(self, p: Tensor) -> Tensor:
        if id(p) in self._popped or p not in self._keys:
            raise KeyError("parameter not in this batch's sums (or already popped)")
        for key in self._keys[p]:
            layer = self._layers.pop(key, None)  # run once; its captured tensors go with it
            if layer is None:
                continue
            for q, v in layer.sums(self._c).items():
                self._ready[q] = self._ready[q] + v if q in self._ready else v
        return self._ready[p]

    def __setitem__(self, p: Tensor, value: Tensor) -> None:
        self._ready[p] = value
        self._keys.setdefault(p, [])
        self._popped.discard(id(p))

    def __delitem__(self, p: Tensor) -> None:
        self[p]  # noqa: B018  (computed first: a layer's other parameters stay readable)
        del self._ready[p]
        self._popped.add(id(p))

    def __iter__(self) -> Iterator[Tensor]:
        return (p for p in self._order if id(p) not in self._popped)

    def __len__(self) -> int:
        return sum(1 for _ in self)


__all__ = ["StreamedSums"]
