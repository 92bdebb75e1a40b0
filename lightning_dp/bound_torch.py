"""torch's own operations, bound when lightning_dp is imported: the noise, its draw and its check compute with these.

The red team's round 37 drew the noise through whatever ``torch.Tensor.normal_`` was at the release: a wrapper of
the user's kept a copy of each draw and the user's optimizer step subtracted it again (T04, T07, T47: σ = 1000, the
weights moved as if σ were 0), or handed back numbers of its choosing — a function of the data, a replay of a seeded
stream, a tenth of the noise on the 10-number output bias (T01–T03, T10); ``torch._foreach_norm`` replaced to inflate
the norms the noise check reads (T08, T09). A check reading what the draw did cannot see a copy kept, and cannot
tell a Gaussian from a replay. So the mechanism does not ask the user's namespace for its operations at all: the
names here are taken from torch's C types when this module is imported — ``torch._C._VariableFunctions`` (what
``torch.add``, ``torch.empty``, ``torch._foreach_norm`` are) and ``torch._C.TensorBase`` (what a tensor's methods
are) — whose attributes Python cannot reassign ("cannot set attribute of immutable type"). A function or method
of ``torch`` or ``torch.Tensor`` replaced later, by a profiler's pass-through timer or by an attack, is simply not
called by the noise path: a timer keeps timing the user's code, an attack's wrapper sees no draw.

What still reaches the noise path, and is checked where the release is made
(:mod:`~lightning_dp.sealed_noise`): a kernel of these ``aten`` operations registered through
``torch.library`` (below Python: the bound name dispatches to it), a name in one of the noise path's modules or a
method of one of its classes reassigned, and a ``torch.Tensor`` property (``dtype``, ``shape``, ``device``)
shadowed. The user's torch modes are taken off the stack around the mechanism (:mod:`~lightning_dp.mode_free`).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["TB", "VF", "Generator", "finfo"]


def _torch_own(namespace: object, expected: str) -> object:
    """``namespace`` when it is torch's C namespace of type name ``expected`` (refused at import otherwise: the
    process replaced it before lightning_dp was imported)."""
    if type(namespace).__name__ != expected and getattr(namespace, "__name__", "") != expected:
        raise ImportError(f"lightning_dp: torch's {expected} was replaced before lightning_dp was imported "
                          f"(found {namespace!r}); the noise cannot be drawn with torch's own operations")
    return namespace


VF: Any = _torch_own(torch._C._VariableFunctions, "_VariableFunctionsClass")
"""torch's functions (``VF.add``, ``VF.empty``, ``VF._foreach_norm``): its attributes cannot be reassigned."""

TB: Any = _torch_own(torch._C.TensorBase, "TensorBase")
"""torch's tensor methods (``TB.normal_(t, 0, s)``, ``TB.view(t, shape)``): an immutable type."""

Generator: Any = _torch_own(torch._C.Generator, "Generator")
"""torch's random generator type (immutable: ``manual_seed`` cannot be replaced)."""

finfo: Any = _torch_own(torch.finfo, "finfo")
"""torch's float-format description (a C type)."""

for _name in ("add", "empty", "normal_", "_foreach_norm"):
    _fn = getattr(VF, _name, None) or getattr(TB, _name)
    if not isinstance(_fn, (types.BuiltinFunctionType, types.MethodDescriptorType)):
        raise ImportError(f"lightning_dp: torch's {_name} is not torch's own function ({_fn!r})")
