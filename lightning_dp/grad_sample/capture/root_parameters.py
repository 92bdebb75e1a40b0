"""Parameters read directly in a module's forward (timm ViT's ``cls_token`` and ``pos_embed``,
ViTMAE's ``mask_token``, ConvNeXt's layer scale, Swin's relative position bias table, DeBERTa's ``q_bias``).

A parameter owned by a module that also has children is not used inside a leaf layer's
forward, so no layer hook sees it: the module's own ``forward`` reads ``self.cls_token`` and
broadcasts it over the batch (``self.cls_token.expand(B, -1, -1)``, ``x + self.pos_embed``,
``self.mask_token.repeat(B, k, 1)``, ``self.gamma * h``). Its gradient is the sum over the batch;
example i's part is lost.

While a step is being captured, reading such an attribute returns a view of the parameter
whose gradient is gathered per example. The read is intercepted by giving the owning module a
subclass of its own class whose ``__getattr__`` does this, undone by :meth:`RootParameters.detach`.

The view is followed through whatever the model does with it (reshaped and interpolated to another image
size, indexed by a bias table, sliced) to where the model broadcasts it over the examples
(:mod:`~lightning_dp.grad_sample.capture.broadcast_sites`), and example i's gradient is read there: n times the
row of example i (the mean loss). Shape makes no difference (an earlier rule expanded ``[1, …]`` parameters
to ``[n, …]`` before the model saw them, which broke ``.repeat(B, …)`` and ``.reshape(1, …)``). A read
whose examples' gradients do not add up to its gradient (the parameter used as the weight of ``F.linear``,
say) leaves the parameter without per-example gradient, and the step is refused.

A layer's own parameters read while its forward is not running are the same case: DeBERTa-v2's encoder reads
``self.rel_embeddings.weight`` (the embedding is never called) and projects it; hand-written models add
``self.pos.weight[:T]`` to the batch; timm's BEiT/EVA pass ``self.qkv.weight`` to ``F.linear`` and never call ``qkv``
(the functional call is served with a linear layer's rule at the site); timm's MaxViT calls its bias leaf's
``get_bias()`` method, not its forward, and hands the bias to fused attention as ``attn_mask``. Every hooked layer's
trainable parameters are watched (:class:`_Running`: a forward pre-hook and a forward hook): a read while the layer's
forward runs (its own code, or any helper it calls) is untouched, so the layer's rule serves its calls; any other read
by the model is followed like a root parameter's. A step in which one parameter has both kinds of use is refused
(:func:`~lightning_dp.validators.example_dim.mixed_use_error`). Any outside read that is not a broadcast over
the examples or a product's weight on them (``x @ w``, ``F.linear``, an einsum led by the examples) leaves the
parameter without per-example gradient (``self.weight @ h.t()``): refused.

The parameters of an ``nn.ParameterList`` or ``nn.ParameterDict`` (modules without a forward, never hooked:
:data:`~.activations.HOLDERS`) are root parameters of the container: its indexing, iteration, ``values()`` and
``get`` read them through ``getattr``, which the container's intercepting class sees like any attribute read.
"""

from __future__ import annotations

import copyreg
import os
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.broadcast_sites import adds_up
from lightning_dp.grad_sample.capture.engine_hooks import EngineHook
from lightning_dp.validators.example_dim import mixed_use_error

_SUBCLASSES: dict[type, type] = {}


def _intercepting(cls: type) -> type:
    """``cls`` with a ``__getattr__`` that lets :class:`RootParameters` see parameter reads."""
    if cls not in _SUBCLASSES:
        def __getattr__(self: nn.Module, name: str) -> Any:
            value = cls.__getattr__(self, name)
            reader = self.__dict__.get("_dp_root_reader")
            return reader(name, value) if reader is not None else value

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            return _as_base(cls.__reduce_ex__(self, protocol), type(self), cls)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__,
                                                       "__module__": cls.__module__, "_dp_user_class": cls})
    return _SUBCLASSES[cls]


def _as_base(reduced: Any, sub: type, cls: type) -> Any:
    """A module's pickle (or deep copy) recipe with its own class ``cls`` in place of the intercepting ``sub`` and
    without the reader: a module pickled or copied while a step reads its parameters is the user's module, detached
    (:mod:`~lightning_dp.grad_sample.capture.engine_hooks`)."""
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        return reduced
    fn, args, *rest = reduced
    args = tuple(cls if a is sub else a for a in args)
    if fn is copyreg.__newobj__:  # pickle checks that __newobj__'s class is the object's: build it by our own call
        fn = _new
    elif fn is copyreg.__newobj_ex__:
        fn = _new_ex
    if rest and isinstance(rest[0], dict) and "_dp_root_reader" in rest[0]:
        rest[0] = {k: v for k, v in rest[0].items() if k != "_dp_root_reader"}
    return (fn, args, *rest)


def _new(cls: type, *args: Any) -> Any:
    """``copyreg.__newobj__`` under another name (a module pickled as its own class, :func:`_as_base`)."""
    return cls.__new__(cls, *args)


def _new_ex(cls: type, args: tuple, kwargs: dict) -> Any:
    """``copyreg.__newobj_ex__`` under another name."""
    return cls.__new__(cls, *args, **kwargs)


_MODULE_GETATTR = nn.Module.__getattr__.__code__
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
"""torch's own code (FSDP2 gathering shards, parametrizations) and the engines' (``lightning_dp/grad_sample``) read
parameters for their own purposes: not the model's use (the library's own models are models like any other)."""


class _Running:
    """Whether a layer's forward is running (forward pre-hook in, forward hook out, also on an exception): a read
    of its parameters meanwhile is its own, whatever code makes it (its methods, helpers it calls)."""

    def __init__(self, module: nn.Module) -> None:
        self.depth = 0
        self.handles = [module.register_forward_pre_hook(EngineHook(self._enter)),
                        module.register_forward_hook(EngineHook(self._leave), always_call=True)]

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _OutsideReads(dict):
    """A watched layer's ``_parameters``: a read through ``module.weight`` while the layer's forward is not running
    goes to ``reader`` (``nn.Module.__getattr__`` looks the name up here; torch's and the engines' own reads, and
    every read inside the forward, get the parameter)."""

    def __init__(self, items: dict, running: _Running, reader: Callable[[str, Any], Any]) -> None:
        super().__init__(items)
        self._running, self._reader = running, reader

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickled or copied, a plain dict (the module's own ``_parameters``, without the step's reader)."""
        return dict, (dict(self),)

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if self._running.depth:
            return value
        caller = sys._getframe(1)
        if caller.f_code is not _MODULE_GETATTR or caller.f_back is None:
            return value
        if caller.f_back.f_code.co_filename.startswith(_INTERNAL):
            return value
        return self._reader(name, value)


class RootParameters:
    """The trainable parameters read directly in non-leaf modules, and their per-example gradients.

    Args:
        expected: a callable returning the step's number of examples (``None``: not verified, no capture)
            and whether capturing is on (the engine's capture is not suspended).
        follow: the capture's :meth:`~lightning_dp.grad_sample.capture.activations.ActivationCapture.follow` (the
        broadcast
            sites of a read).
    """

    def __init__(self, expected: Callable[[], Optional[int]],
                 follow: Callable[[Tensor, int, Callable[[Optional[Tensor], Tensor], None]], None]) -> None:
        self._expected = expected
        self._follow = follow
        self._unserved: set[int] = set()  # parameters with a read this step that no site served
        self._outside: set[int] = set()  # layers' parameters read outside their forward this step
        self._modules: list[tuple[nn.Module, type]] = []
        self._tables: list[tuple[nn.Module, _Running]] = []  # watched layers (their _parameters are _OutsideReads)
        self._watched: set[int] = set()  # their trainable parameters
        self._owners: dict[int, tuple[nn.Module, str]] = {}
        self.grads: dict[int, Tensor] = {}  # id(parameter) → [n, *p.shape], summed over reads

    def attach(self, root: nn.Module, is_leaf_like: Callable[[nn.Module], bool],
               hooked: Callable[[nn.Module], bool] = lambda m: True) -> None:
        """Intercept reads of every trainable parameter owned by a module that is not leaf-like, and reads of a
        ``hooked`` layer's parameters while its forward is not running (not a unit's child: the unit's forward
        reads those itself)."""
        self.detach()
        in_layers = {id(p) for m in root.modules() if is_leaf_like(m) for p in m.parameters(recurse=False)}
        for name, module in root.named_modules():
            if is_leaf_like(module) and hooked(module):
                self._watch_table(name, module)
            if is_leaf_like(module):
                continue
            own = {pname: p for pname, p in module.named_parameters(recurse=False)
                   if id(p) not in in_layers and p.requires_grad}
            if not own:
                continue
            self._modules.append((module, type(module)))
            module.__class__ = _intercepting(type(module))
            module.__dict__["_dp_root_reader"] = self._reader(own)
            for pname, p in own.items():
                self._owners[id(p)] = (module, f"{name or '<root>'}.{pname}")

    def _watch_table(self, name: str, module: nn.Module) -> None:
        """Follow reads of a layer's trainable parameters made while its forward is not running."""
        own = {pname: p for pname, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not own:
            return
        running = _Running(module)
        module._parameters = _OutsideReads(module._parameters, running, self._reader(own, True))
        self._tables.append((module, running))
        for pname, p in own.items():
            self._owners.setdefault(id(p), (module, f"{name or '<root>'}.{pname}"))
            self._watched.add(id(p))

    def _reader(self, own: dict[str, Tensor], outside: bool = False) -> Callable[[str, Any], Any]:
        def read(name: str, value: Any) -> Any:
            n = self._expected()
            if name not in own or n is None or not torch.is_grad_enabled():
                return value
            return self._followed(value, n, outside)

        return read

    def _followed(self, p: Tensor, n: int, outside: bool = False) -> Tensor:
        """A view of ``p`` whose per-example gradient the broadcast sites gather (n · row i: the mean loss).
        ``outside``: a read of a layer's parameter outside its forward, counted (:meth:`direct`) once a gradient flows
        through it (a read of its ``.device`` or ``.shape`` is no use)."""
        view, key = p.view_as(p), id(p)

        def deliver(rows: Optional[Tensor], total: Tensor) -> None:
            if outside:
                self._outside.add(key)
            if rows is None or not adds_up(rows, total):
                self._unserved.add(key)
                self.grads.pop(key, None)
            else:
                self._store(key, rows * n)

        self._follow(view, n, deliver)
        return view

    def _store(self, key: int, g: Tensor) -> None:
        """Add one read's per-example gradients ``[n, *p.shape]`` (none once a read of ``p`` was not served)."""
        if key not in self._unserved:
            self.grads[key] = g if key not in self.grads else self.grads[key] + g

    def owns(self, p: Tensor) -> bool:
        """Whether ``p`` is a parameter of a non-leaf module, whose reads are intercepted."""
        return id(p) in self._owners and id(p) not in self._watched

    def direct(self, p: Tensor, layer_ran: bool) -> Optional[Tensor]:
        """Example i's gradients ``[n, *p.shape]`` of ``p`` from its direct reads in this step (a parameter of a
        non-leaf module, or a layer's read outside its forward), or None (no such read served: the engine
        then finds ``p`` unused or refuses it). A layer's parameter read outside while the layer also ran
        (``layer_ran``) is refused: the two kinds of use are not combined."""
        if layer_ran and id(p) in self._outside:
            raise mixed_use_error(self.name_of(p))
        return self.grads.get(id(p))

    def name_of(self, p: Tensor) -> str:
        """The dotted name of an intercepted parameter."""
        return self._owners[id(p)][1]

    def clear(self) -> None:
        """Drop this step's per-example gradients."""
        self.grads.clear()
        self._unserved.clear()
        self._outside.clear()

    def detach(self) -> None:
        """Give every module back its own class."""
        for module, cls in self._modules:
            module.__dict__.pop("_dp_root_reader", None)
            module.__class__ = cls
        for module, running in self._tables:
            module._parameters = dict(module._parameters)
            running.remove()
        self._modules, self._owners, self._tables = [], {}, []
        self._watched.clear()
        self.grads.clear()
