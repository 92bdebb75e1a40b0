"""Captured tensors made finite: the ghost engine's second pass over a step where an example's gradient is not.

A record holding an inf (an inf feature) or a NaN reaches the captured activations and output gradients of every
layer it passes; its factor is 0 (:func:`~lightning_dp.clipping.rule.finite_only`) but the book-keeping contractions
multiply that 0 into its rows (0·inf = NaN), which would make the release NaN exactly when the record is sampled.
The ghost engine then sets those entries to 0 in what it captured (:meth:`ActivationCapture.make_finite`) and
computes the step again: every other example's rows are the same values, so its contribution is unchanged; the
example's own is a function of its own rows, clipped to C (or 0), so the sensitivity is unchanged
(docs/algorithms.md, "Non-finite gradients"). Tensors already finite are kept as they are (their identity too:
layers that read one tensor are found by it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

_DEPTH = 6


def finite_copy(value: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    """``value`` with every floating tensor in it that holds an inf or a NaN replaced by a copy with those entries 0
    (lists, tuples, named tuples, dicts and dataclasses walked to a depth of six; a dataclass is changed in place)."""
    if isinstance(value, Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return value
        if id(value) not in memo:
            bad = not bool(torch.isfinite(value).all())
            memo[id(value)] = torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0) if bad else value
        return memo[id(value)]
    if depth >= _DEPTH:
        return value
    if isinstance(value, tuple):
        items = [finite_copy(v, memo, depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [finite_copy(v, memo, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: finite_copy(v, memo, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        finite_fields(value, memo, depth + 1)
    return value


def finite_fields(obj: Any, memo: dict[int, Any], depth: int = 0) -> None:
    """Every field of the dataclass ``obj`` through :func:`finite_copy`, in place (frozen ones left alone: they
    hold no captured tensor)."""
    if getattr(type(obj), "__dataclass_params__").frozen:
        return
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, finite_copy(getattr(obj, f.name), memo, depth))
