"""Whether two stored tensors or arrays hold the same values, as the checks that put state back need it: value for
value, a NaN equal to a NaN in the same place (``torch.equal`` says a tensor holding a NaN differs from itself, so a
record with a missing value looked written on every comparison, and putting it back moved its version counter)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


def same_tensor_values(a: Tensor, b: Tensor) -> bool:
    """``torch.equal``, with NaNs in the same places counted equal."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def same_array_values(a: Any, b: Any) -> bool:
    """``np.array_equal``, with NaNs in the same places counted equal (floating and complex arrays)."""
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
