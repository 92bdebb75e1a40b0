"""Which of torch's own operations the process has replaced: named in a refusal's message, never a refusal itself.

The checks read the user's step with torch's operations and compare it with what torch computes: a
``torch.Tensor.clamp`` monkeypatched to a pass-through makes the engine's clipping look wrong (zoo36 T30: refused as
"Engine 'ghost' clipped the first step's examples wrongly ... please report the model"), an ``aten::normal_`` CPU
kernel overridden through ``torch.library`` makes the noise look missing or, in an earlier form, the dataset look
as if it ignored its index (T28). The refusal was right, the text pointed elsewhere. :func:`replaced_operations`
lists what was replaced — a method of ``torch.Tensor``, a function of ``torch``, ``torch.nn.functional`` or
``torch.autograd`` that is now code outside the libraries (:func:`~lightning_dp.records.library_code.library_callable`:
by the code that runs, not by its name), a kernel of torch's own ``aten`` namespace registered through
``torch.library`` for the CPU, an autograd or a composite key (torch registers others lazily: functorch's batching
rules, Meta kernels), the ``torch`` name of one of lightning_dp's modules bound to something else — and
:func:`note_replaced_operations` adds them to a refusal as a note (``BaseException.add_note``: shown under the
message), so the cause is read first.

Not a check: a process may replace torch's functions for good reasons (a profiler, a library's compatibility shim),
and the guarantee is enforced where the replaced operation's effect shows (the noise check of
:mod:`.noise_added`, the probes). Cost: a walk of ≈ 1,500 attributes, only when a refusal is raised.
"""

from __future__ import annotations

import sys
import types

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.library_code import library_callable

__all__ = ["note_replaced_operations", "replaced_operations"]

_NAMESPACES = (("torch.Tensor", lambda: vars(torch.Tensor)), ("torch", lambda: vars(torch)),
               ("torch.nn.functional", lambda: vars(torch.nn.functional)),
               ("torch.autograd", lambda: vars(torch.autograd)))
"""Where a replaced operation is looked for: the tensor's methods and the functions the step computes with."""

_KERNEL_KEYS = frozenset({"CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd", "Autograd", "AutogradCPU"})
"""The dispatch keys of an ``aten`` kernel that runs in a CPU fit (torch registered none of its own from Python at
this module's import; those it had are left out)."""


def _registered_kernels() -> frozenset[str]:
    impls = getattr(getattr(torch, "library", None), "_impls", None)
    return frozenset(impls) if isinstance(impls, (set, frozenset)) else frozenset()


_AT_IMPORT = _registered_kernels()


def replaced_operations() -> list[str]:
    """The torch operations this process has replaced (module docstring), by name."""
    found: list[str] = []
    for prefix, namespace in _NAMESPACES:
        for name, value in list(namespace().items()):
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(fn, (types.FunctionType, types.MethodType)) and not library_callable(fn):
                where = getattr(getattr(fn, "__code__", None), "co_filename", "?")
                found.append(f"{prefix}.{name} (by {getattr(fn, '__qualname__', name)} in {where})")
    for key in sorted(_registered_kernels()):
        namespace, _, rest = key.partition("/")
        op, _, dispatch = rest.rpartition("/")
        if namespace == "aten" and dispatch in _KERNEL_KEYS and key not in _AT_IMPORT:
            found.append(f"the {dispatch} kernel of aten::{op} (registered through torch.library)")
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_dp.") and module is not None \
                and getattr(module, "torch", torch) is not torch:
            found.append(f"the name torch in {name}")
    return found


def note_replaced_operations(error: BaseException) -> None:
    """Add to a refusal (:class:`~lightning_dp.errors.PrivacyConfigurationError`) a note naming the torch operations
    the process replaced, where there are any; other exceptions, or a refusal noted already, are left as they are."""
    if not isinstance(error, PrivacyConfigurationError) or getattr(error, "_replaced_noted", False):
        return
    error._replaced_noted = True  # type: ignore[attr-defined]
    replaced = replaced_operations()
    if replaced:
        shown = "; ".join(replaced[:6]) + (f"; and {len(replaced) - 6} more" if len(replaced) > 6 else "")
        error.add_note(f"Note: this process replaced torch operations the checks compute with — {shown}. A refusal "
                       "above may come from the replacement rather than from the model or the data: train without it.")
