"""The noise path is the library's own at every release: its names, its methods, torch's kernels under it.

The noise is drawn, added and checked with torch's operations bound at import (:mod:`~lightning_dp.bound_torch`), so
a ``torch.Tensor.normal_`` or ``torch._foreach_norm`` replaced later is not called by it. Three ways remain for code in
the same process to put itself under the noise, and :func:`check_sealed` refuses each before a release is noised
(the noise check's wrapper calls it: :mod:`.noise_added`), before the optimizer steps and the ledger is charged:

- **a name of the noise path's modules, or a method of its classes, reassigned**: each module of the path calls
  :func:`seal` as its last line; its globals and the namespaces of the classes it defines are recorded then, and any
  name since bound to another object, or added (a method of a base class shadowed on a subclass, a builtin shadowed
  by a module global), is named. Dunder names a Python process adds by itself (``__warningregistry__``,
  ``__slotnames__``) are left out. A method set on the drawing mechanism itself, or on its worker, is named too
  (:func:`shadowed_methods`);
- **a builtin, a ``math`` function or a ``torch.Tensor`` property the path reads replaced** (``zip``, ``len``,
  ``math.isfinite``, ``Tensor.dtype``): the ones it reads, compared with their objects at import;
- **a kernel of one of torch's ``aten`` operations the path dispatches replaced below Python** (through
  ``torch.library``, for a key a CPU or CUDA tensor's call reaches — a pass-through kernel could keep a copy of each
  draw): torch's record of such registrations (``torch.library._impls``) names none for :data:`OPERATIONS` (torch
  registers none of its own from Python there), read again whenever it grew or was replaced.

Cost (benchmarks/cost_floor.py's setting): ≈ 550 identity comparisons and one length read a release, ≈ 50 µs. Not a
sandbox: code that reaches the library's objects some other way (``gc``, a mechanism's private generator or the draws
held for the next release, a kernel registered through torch's private ``torch._C._dispatch_library`` without
``torch.library``'s record, ``ctypes``) is not ordinary code and is not stopped; what is stopped is every way of
changing the noise path by replacing a name.
"""

from __future__ import annotations

import builtins
import math
import sys
from typing import Any, Iterable, Mapping, Optional

import torch

from lightning_dp.errors import PrivacyConfigurationError

__all__ = ["NoisePathReplacedError", "OPERATIONS", "broken_seals", "check_sealed", "seal", "shadowed_methods"]


class NoisePathReplacedError(PrivacyConfigurationError):
    """Something the noise path computes with was replaced after lightning_dp was imported (module docstring)."""


OPERATIONS = frozenset({
    "_foreach_add_", "_foreach_mul", "_foreach_mul_", "_foreach_norm", "_foreach_sub", "_local_scalar_dense",
    "_to_copy", "_unsafe_view", "add", "add_", "alias", "as_strided", "as_strided_", "cat", "clone", "copy_", "cos",
    "detach", "div", "div_", "empty", "empty_like", "empty_strided", "fill_", "index_select", "lift_fresh",
    "linalg_vector_norm", "log1p", "matmul", "mm", "mul", "mul_", "narrow", "neg", "normal_", "randint", "random_",
    "reshape", "resolve_conj", "resolve_neg", "select", "sin", "slice", "split_with_sizes", "sqrt", "squeeze_",
    "stack", "sub", "sum", "to", "unsqueeze", "view", "zero_", "zeros",
})
"""The ``aten`` operations (any overload) the noise path dispatches — drawn, added, checked, for the Gaussian, secure
and banded mechanisms, drawn at the call or ahead: a test runs the path under torch's profiler and finds no other."""

_KERNEL_KEYS = frozenset({"CPU", "CUDA", "Autograd", "AutogradCPU", "AutogradCUDA", "AutogradOther", "ADInplaceOrView",
                          "BackendSelect", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                          "CompositeExplicitAutogradNonFunctional", "Python", "PythonDispatcher"})
"""The dispatch keys a dense CPU or CUDA tensor's call can reach (torch registers no kernel of its own from Python for
:data:`OPERATIONS` on these keys)."""

_BUILTINS = ("zip", "iter", "next", "len", "sum", "max", "min", "range", "isinstance", "float", "int", "list", "tuple",
             "dict", "any", "all", "getattr", "type", "enumerate", "abs", "sorted", "map", "callable", "bool", "super",
             "repr", "set", "hasattr")
"""The builtins the noise path calls."""

_MATH = ("log", "sqrt", "isfinite", "exp", "pi", "ceil", "floor")
"""The ``math`` functions it calls."""

_TENSOR_PROPERTIES = ("dtype", "device", "shape", "is_cuda", "layout")
"""The tensor properties it reads: torch's own on ``torch._C.TensorBase``; none may be shadowed on ``torch.Tensor``."""

_Snapshot = tuple[str, Mapping[str, Any], dict[str, Any], Optional[frozenset[str]]]
_SEALED: list[_Snapshot] = []
_MISSING = object()


def _watch(label: str, namespace: Mapping[str, Any], names: Optional[Iterable[str]] = None,
           whole: bool = False) -> None:
    """Record ``names`` of ``namespace`` (all of them when ``None``); ``whole``: a name added later is refused too."""
    chosen = list(namespace) if names is None else [n for n in names if n in namespace]
    _SEALED.append((label, namespace, {n: namespace[n] for n in chosen}, frozenset(namespace) if whole else None))


def seal(module_name: str, tunable: tuple[str, ...] = ()) -> None:
    """Record the globals of module ``module_name`` and the namespaces of the classes it defines (its last line);
    ``tunable``: globals that decide when or how the work is cut, never what is drawn (a bucket size, whether a
    worker draws ahead), left out (tests and benchmarks set them)."""
    module = sys.modules[module_name]
    _watch(module_name, vars(module), [n for n in vars(module) if n not in tunable], whole=True)
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module_name:
            _watch(f"{module_name}.{value.__qualname__}", vars(value), whole=True)


_watch("builtins", vars(builtins), _BUILTINS)
_watch("math", vars(math), _MATH)


def broken_seals() -> list[str]:
    """What :func:`check_sealed` would name: the sealed names bound to other objects or added, the tensor properties
    shadowed, the kernels registered (module docstring)."""
    broken: list[str] = []
    for label, namespace, recorded, names in _SEALED:
        for name, value in recorded.items():
            if namespace.get(name, _MISSING) is not value:
                broken.append(f"{label}.{name}")
        if names is not None and len(namespace) != len(names):
            broken.extend(f"{label}.{n} (added)" for n in list(namespace) if n not in names and not n.startswith("__"))
    shadowed = vars(torch.Tensor)
    broken.extend(f"torch.Tensor.{n}" for n in _TENSOR_PROPERTIES if n in shadowed)
    broken.extend(_replaced_kernels())
    return broken


_KERNELS_SEEN: list[Any] = [None, -1, ()]


def _replaced_kernels() -> tuple[str, ...]:
    """The kernels of :data:`OPERATIONS` on :data:`_KERNEL_KEYS` registered through ``torch.library`` (its record of
    registrations, ``torch.library._impls``, read again only when it changed: one length read a release)."""
    impls = getattr(torch.library, "_impls", None)
    if not isinstance(impls, (set, frozenset)):
        return ("torch.library's record of registrations (torch.library._impls)",)
    if _KERNELS_SEEN[0] is impls and _KERNELS_SEEN[1] == len(impls):
        return _KERNELS_SEEN[2]  # type: ignore[no-any-return]
    found = []
    for entry in list(impls):
        namespace, _, rest = entry.partition("/")
        op, _, key = rest.rpartition("/")
        if namespace == "aten" and key in _KERNEL_KEYS and op.partition(".")[0] in OPERATIONS:
            found.append(f"the {key} kernel of aten::{op} (registered through torch.library)")
    _KERNELS_SEEN[:] = [impls, len(impls), tuple(sorted(found))]
    return _KERNELS_SEEN[2]  # type: ignore[no-any-return]


def shadowed_methods(*objects: Any) -> list[str]:
    """The methods of ``objects``' classes set on the objects themselves (``noise._normal = ...``: an instance's own
    attribute wins over its sealed class's method)."""
    found = []
    for obj in objects:
        own = getattr(obj, "__dict__", None)
        if own:
            cls = type(obj)
            found += [f"{cls.__qualname__}.{name} (set on the instance)" for name in list(own)
                      if not name.startswith("__") and callable(getattr(cls, name, None))]
    return found


def check_sealed(*objects: Any) -> None:
    """Refuse (:class:`NoisePathReplacedError`) when :func:`broken_seals` names anything, or a method of one of
    ``objects`` (the mechanism drawing, its worker) is set on the object itself (:func:`shadowed_methods`)."""
    broken = broken_seals() + shadowed_methods(*objects)
    if broken:
        shown = "; ".join(broken[:6]) + (f"; and {len(broken) - 6} more" if len(broken) > 6 else "")
        raise NoisePathReplacedError(
            f"The noise path was changed after lightning_dp was imported: {shown}. The noise is drawn, added and "
            "checked with torch's own operations and the library's own code; a name replaced there (a module's "
            "global, a class's method, a builtin or math function it calls, a torch.library kernel of an operation "
            "it dispatches) could keep a copy of the draw or change it. Nothing was released (the optimizer did not "
            "step, the ledger was not charged). Remove the replacement for the fit; a profiler's timer of torch's "
            "functions or tensor methods is fine (the noise path does not call them).")


seal(__name__)
