"""Parameters read directly in a module's forward (timm ViT's ``cls_token`` and ``pos_embed``).

A parameter owned by a module that also has children is not used inside a leaf layer's
forward, so no layer hook sees it: the module's own ``forward`` reads ``self.cls_token`` and
broadcasts it over the batch (``self.cls_token.expand(B, -1, -1)``, ``x + self.pos_embed``).
Its gradient is the sum over the batch; example i's part is lost.

For a parameter of shape ``[1, …]`` (the usual layout of such tokens and tables) the engines
serve it exactly: while a step is being captured, reading the attribute returns the parameter
expanded to ``[n, …]`` (a view; broadcasting it gives the model the same values), and the
gradient reaching that view holds example i's part in row i. Example i's gradient is n times
that row (the mean loss). The read is intercepted by giving the owning module a subclass of its
own class whose ``__getattr__`` does this, undone by :meth:`RootParameters.detach`. Other
parameters of such modules stay refused by the engines (``structural_problems``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

_SUBCLASSES: dict[type, type] = {}


def expandable(p: Tensor) -> bool:
    """A parameter read directly that the engines can serve: trainable, shape ``[1, …]``."""
    return p.requires_grad and p.dim() >= 1 and p.shape[0] == 1


def _intercepting(cls: type) -> type:
    """``cls`` with a ``__getattr__`` that lets :class:`RootParameters` see parameter reads."""
    if cls not in _SUBCLASSES:
        def __getattr__(self: nn.Module, name: str) -> Any:
            value = cls.__getattr__(self, name)
            reader = self.__dict__.get("_dp_root_reader")
            return reader(name, value) if reader is not None else value

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__})
    return _SUBCLASSES[cls]


class RootParameters:
    """The expandable parameters read directly in non-leaf modules, and their per-example gradients.

    Args:
        expected: a callable returning the step's number of examples (``None``: not verified, no capture)
            and whether capturing is on (the engine's capture is not suspended).
    """

    def __init__(self, expected: Callable[[], Optional[int]]) -> None:
        self._expected = expected
        self._modules: list[tuple[nn.Module, type]] = []
        self._owners: dict[int, tuple[nn.Module, str]] = {}
        self.grads: dict[int, Tensor] = {}  # id(parameter) → [n, *p.shape], summed over reads

    def attach(self, root: nn.Module, is_leaf_like: Callable[[nn.Module], bool]) -> None:
        """Intercept reads of every expandable parameter owned by a module that is not leaf-like."""
        self.detach()
        for name, module in root.named_modules():
            if is_leaf_like(module):
                continue
            own = {pname: p for pname, p in module.named_parameters(recurse=False) if expandable(p)}
            if not own:
                continue
            self._modules.append((module, type(module)))
            module.__class__ = _intercepting(type(module))
            module.__dict__["_dp_root_reader"] = self._reader(own)
            for pname, p in own.items():
                self._owners[id(p)] = (module, f"{name or '<root>'}.{pname}")

    def _reader(self, own: dict[str, Tensor]) -> Callable[[str, Any], Any]:
        def read(name: str, value: Any) -> Any:
            n = self._expected()
            if name not in own or n is None or not torch.is_grad_enabled():
                return value
            view = value.expand(n, *value.shape[1:])
            view.register_hook(lambda g, key=id(value), n=n: self._store(key, g, n))
            return view

        return read

    def _store(self, key: int, g: Tensor, n: int) -> None:
        g = g.detach().unsqueeze(1) * n  # row i of the view's gradient, as example i's gradient of p
        self.grads[key] = g if key not in self.grads else self.grads[key] + g

    def owns(self, p: Tensor) -> bool:
        """Whether ``p`` is one of the intercepted parameters."""
        return id(p) in self._owners

    def name_of(self, p: Tensor) -> str:
        """The dotted name of an intercepted parameter."""
        return self._owners[id(p)][1]

    def clear(self) -> None:
        """Drop this step's per-example gradients."""
        self.grads.clear()

    def detach(self) -> None:
        """Give every module back its own class."""
        for module, cls in self._modules:
            module.__dict__.pop("_dp_root_reader", None)
            module.__class__ = cls
        self._modules, self._owners = [], {}
        self.grads.clear()
