"""A layer's own parameters as the engine reads them every step, without ``nn.Module``'s attribute machinery.

The capture watches a hooked layer's ``_parameters`` (:class:`~.root_parameters._OutsideReads`): a read of
``layer.weight`` outside the layer's forward costs a frame inspection (≈ 1 µs) to tell the model's reads from the
engine's. The engine's own per-step reads (the rules' shapes and dtypes, the input-gradient-only forwards) know they
are its own, and read the table directly (:func:`own`). Likewise a layer without submodules is never a unit and
never parametrized (:func:`plain_leaf`), which :func:`~.activations.is_unit` and the rules' dispatch otherwise learn
by torch's ``is_parametrized``, whose ``getattr`` of a missing attribute raises and catches an exception each time.

Nothing is cached: each call reads the module as it is now and returns what the attribute read would.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dp.validators.layers import parametrized, pruned


def plain_leaf(m: nn.Module) -> bool:
    """``m`` has no submodules and nowhere a ``parametrizations`` attribute could come from (its ``__dict__``, its
    class): then torch's ``is_parametrized(m)`` is False (a parametrization is a ``ModuleDict`` child; ``_parameters``
    and ``_buffers`` hold tensors) and ``m`` has no children; nor is it pruned (a layer with buffers is asked)."""
    return (not m._modules and "parametrizations" not in m.__dict__ and not hasattr(type(m), "parametrizations")
            and not (m._buffers and pruned(m)))


def is_parametrized(m: nn.Module) -> bool:
    """:func:`~lightning_dp.validators.layers.parametrized`, answered without it for a :func:`plain_leaf`."""
    return not plain_leaf(m) and parametrized(m)


def own(m: nn.Module, name: str) -> Any:
    """``getattr(m, name)`` for a registered parameter (or ``None`` slot) not shadowed by an instance or class
    attribute, read from ``m._parameters`` itself (a watched table's own ``__getitem__`` is skipped: the read is the
    engine's); any other name by ``getattr``."""
    table = m.__dict__.get("_parameters")
    if table is not None and name in table and name not in m.__dict__ and not hasattr(type(m), name):
        return dict.__getitem__(table, name)
    return getattr(m, name)


def own_trainable(m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``[(name, p) for name, p in m.named_parameters(recurse=False) if p.requires_grad]`` from ``m._parameters``
    (the same order, a parameter registered twice listed once, as ``named_parameters`` does)."""
    seen: set[int] = set()
    out = []
    for name, p in m._parameters.items():
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            out.append((name, p))
    return out
