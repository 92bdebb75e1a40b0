"""The layers and parameters a baseline of kept state held, and the entries of those put in place since.

A plain loop that replaces a layer between steps (``model[2] = nn.Linear(8, 2)``) re-attaches the engine and calls
``verify()`` again (the refusal at ``begin()`` says so). The new layer's entries differ from the baseline's only because
it is another object: after that ``verify()`` they are taken as they are (:func:`replaced_entries`). Nothing else is:
a buffer or an attribute a step wrote from its batch in a layer that is still the same object stays refused (no general
re-baseline). The layers are told apart by identity (weak references: a layer freed and another allocated at its
address is still new), the parameters by their slot (a layer's ``weight`` rebound to a new ``nn.Parameter``).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

from torch import nn

Held = tuple[dict[str, "weakref.ref[Any]"], dict[str, "weakref.ref[Any]"]]
"""(module prefix → the module, parameter name → the parameter) as a baseline found them."""

_KINDS = ("parameter", "buffer", "attribute", "configuration", "hook", "mode", "structure")
"""The kinds of entry that belong to one layer or parameter (``class attribute``, ``global``, ``callback``,
``datamodule`` and ``dataset`` entries belong to none)."""


def held_objects(layout: Sequence[tuple[str, nn.Module, Any]], param_slots: Iterable[tuple[str, dict, str]]) -> Held:
    """Weak references to the module at each prefix of ``layout`` (``"net.2."``) and to the parameter in each slot
    (``"net.2.weight"``): the fingerprint's walk of the tree, read again at no cost."""
    modules = {prefix: weakref.ref(m) for prefix, m, _ in layout}
    params = {name: weakref.ref(p) for name, slots, key in param_slots if (p := slots.get(key)) is not None}
    return modules, params


def replaced_entries(held: Held, module: nn.Module, entries: Iterable[str]) -> list[str]:
    """The names among ``entries`` that belong to a submodule of ``module`` or a parameter that is not the object
    ``held`` found at its place (a layer replaced, a parameter rebound; one added where there was none): its
    parameters, buffers, attributes, configuration, hooks and mode, with their contents' entries."""
    modules, params = held
    layers = [(f"{name}.", m) for name, m in module.named_modules() if name]
    new = tuple(prefix for prefix, m in layers if _other(modules.get(prefix), m))
    rebound = {prefix + key for prefix, m in [("", module), *layers] for key, p in m._parameters.items()
               if p is not None and _other(params.get(prefix + key), p)}
    found = []
    for entry in dict.fromkeys(entries):
        kind, _, path = entry.removeprefix("contents of ").partition(" ")
        path = f"{path}." if kind in ("mode", "structure") else path
        if kind in _KINDS and (path.startswith(new) or path in rebound or path.rpartition(".")[0] in rebound):
            found.append(entry)
    return found


def _other(ref: "weakref.ref[Any] | None", obj: Any) -> bool:
    return ref is None or ref() is not obj
