"""What the engines attach to the user's modules leaves no trace outside a private step: pickling, copying, tracing.

A private step hooks the model's layers (forward hooks and pre-hooks that record each call), and some engines replace
a layer's ``forward`` for the duration of the fit (:mod:`~.grad_sample.ghost`'s book-keeping forward). Those objects
live on the user's modules, so everything that handles the module while the engine is attached meets them:

- **pickling**: a Lightning template keeps the network in its hyperparameters (``save_hyperparameters()`` with
  ``net: nn.Module``), and ``ModelCheckpoint`` pickles them with ``torch.save`` in the middle of the fit; a closure
  hook made the whole checkpoint fail (``Can't pickle local object``). An :class:`EngineHook` pickles as an inert
  :class:`DroppedHook` (the loaded module is the user's module: its first call removes the placeholder); the replaced
  forward pickles as the layer's own (:class:`ReplacedForward`). What a checkpoint holds is what it held without the
  engine: the same state dict, and modules without the engine;
- **copying** (``copy.deepcopy``: an EMA or SWA callback's averaged model, a teacher network): the copy is not
  attached to any step, so it gets the same inert placeholders (it never records into the original's capture, and
  its layers keep their own forward);
- **tracing** (``TensorBoardLogger(log_graph=True)`` traces the model with ``torch.jit.trace``, twice, and compares
  the graphs): an engine hook does nothing while ``torch.jit`` traces, and a replaced forward runs the layer's own, so
  the traced graph is the model's and the same at every invocation. No private step runs under a trace;
- **evaluation** (a validation loop inside the fit, ``model.eval()`` under ``torch.no_grad``/``inference_mode``): a
  replaced forward runs the layer's own while grad mode is off. Nothing then records a gradient through the call (its
  output has no history, and the capture's hooks record nothing either), so no per-example capture is skipped; and
  torch's own fast paths keep working (``nn.TransformerEncoder`` with a padding mask turns its input into a nested
  tensor in eval mode under no_grad, which the book-keeping forwards cannot take). A nested input while gradients
  are recorded, to a layer with trainable parameters, is refused by name: its per-example gradients have no rule.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from lightning_dp.errors import PrivacyConfigurationError

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_FLAG_DICTS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
"""Per-hook flags torch keeps by hook id beside the hooks (removed with them)."""


def tracing() -> bool:
    """Whether ``torch.jit`` is tracing the forward now (no private step runs under a trace)."""
    return torch.jit.is_tracing()


class DroppedHook:
    """What an :class:`EngineHook` becomes in a pickled or copied module: does nothing, and at its first call removes
    every dropped hook of the module (its forward and backward hooks alike)."""

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        dropped = set()
        for name in _HOOK_DICTS:
            hooks = module.__dict__.get(name)
            if hooks:
                for key in [k for k, h in hooks.items() if isinstance(h, DroppedHook)]:
                    del hooks[key]
                    dropped.add(key)
        for name in _FLAG_DICTS:
            flags = module.__dict__.get(name)
            for key in dropped & set(flags or ()):
                del flags[key]
        return None


class EngineHook:
    """A module hook registered by an engine: calls ``fn`` with the hook's arguments, except under a ``torch.jit``
    trace (module docstring). Pickled or deep-copied, it becomes a :class:`DroppedHook`: the engine (its capture, the
    step's tensors) never travels with the module."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return None
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return DroppedHook, ()

    def __deepcopy__(self, memo: dict) -> DroppedHook:
        return DroppedHook()


def _dropped_callable(*args: Any, **kwargs: Any) -> None:
    """What an :class:`EngineCallable` becomes in a pickled or copied module: the engine that kept it is not there."""
    raise RuntimeError("this module was pickled or copied while a private step's engine was attached: the engine's "
                       "per-layer function did not travel with it (attach an engine to the module again)")


class EngineCallable:
    """A function an engine keeps on a layer between steps (Opacus' ``ft_compute_sample_grad``, a closure): called as
    itself; pickled or deep-copied, a placeholder that the next engine attached replaces."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return _dropped, ()

    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        return _dropped_callable


def _dropped() -> Callable[..., Any]:
    return _dropped_callable


def _layer_forward(module: nn.Module) -> Any:
    """The layer's own forward, bound to it (what ``module.forward`` is without an instance attribute)."""
    return types.MethodType(type(module).forward, module)


class ReplacedForward:
    """A layer's ``forward`` replaced by an engine for the fit (``module.forward = ReplacedForward(fn, module)``):
    calls ``fn(module, …)``, or the layer's own forward under a ``torch.jit`` trace. Pickled or deep-copied, the
    layer gets its own forward back."""

    __slots__ = ("fn", "module")

    def __init__(self, fn: Callable[..., Any], module: nn.Module) -> None:
        self.fn, self.module = fn, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing() or not torch.is_grad_enabled():  # no gradient through this call: the layer's own (module doc)
            return type(self.module).forward(self.module, *args, **kwargs)
        if _nested(args, kwargs):
            if any(p.requires_grad for p in self.module.parameters()):
                raise PrivacyConfigurationError(
                    f"a nested tensor reached {type(self.module).__name__} while gradients are recorded: its "
                    "per-example gradients have no rule for a nested input (pad the batch, or call the model under "
                    "torch.no_grad() where no gradient is wanted)")
            return type(self.module).forward(self.module, *args, **kwargs)  # frozen: no parameter gradient to keep
        return self.fn(self.module, *args, **kwargs)

    @property
    def __func__(self) -> Callable[..., Any]:
        """The replacing function (as a bound method's: callers that cache by function see one per kind of layer)."""
        return self.fn

    @property
    def __signature__(self) -> inspect.Signature:
        """The replacing function's signature without the module (keyword calls bind as before the replacement)."""
        return inspect.signature(types.MethodType(self.fn, self.module))

    def __reduce__(self) -> tuple:
        return _layer_forward, (self.module,)

    def __deepcopy__(self, memo: dict) -> Any:
        from copy import deepcopy

        return _layer_forward(deepcopy(self.module, memo))


def _nested(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument of the call (positional or keyword, not inside a container) is a nested tensor."""
    return any(isinstance(a, torch.Tensor) and a.is_nested for a in (*args, *kwargs.values()))


def is_own_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` is the layer's own (no instance attribute, or one that is its class's forward bound to
    it: a module pickled or copied while an engine had replaced it)."""
    attr = module.__dict__.get("forward")
    if attr is None:
        return True
    return isinstance(attr, types.MethodType) and attr.__self__ is module and attr.__func__ is type(module).forward


def gradient_nodes(params: Iterable[torch.Tensor]) -> Iterator[Any]:
    """The autograd nodes that receive ``params``' gradients (their ``AccumulateGrad``), one at a time: taken during the
    backward for the tensors a layer's call used (FSDP2's unsharded copies of its shards), whose graph holds them, so
    they are the nodes that call's graph feeds; ``params`` that do not require grad are passed over."""
    return (get_gradient_edge(p).node for p in params if p.requires_grad)


def feeds_parameters(params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> bool:
    """Whether the backward now running computes gradients of ``params`` (the tensors the recorded calls used as their
    parameters): ``False``
    only inside a ``torch.autograd.grad`` (or ``backward(inputs=…)``) with respect to other tensors — FGSM's gradient of
    the loss with respect to the input, ``torch.autograd.grad(loss, x)`` — whose output gradients are no part of the
    parameters' gradients the release clips: the capture's output-gradient hooks ignore that backward (the input
    gradient it returns is a transformation of the batch, which the first step's probe compares in a batch and alone).
    ``torch.autograd.grad`` with respect to the parameters themselves (torch refuses to say for a captured leaf) counts
    as feeding them. ``inputs``: the leaves the recorded calls took (an input made to require grad): a
    ``backward()`` accumulates into them, so one that runs them is the step's own even when no parameter is in the
    graph (the ghost engine keeps its patched layers' parameters out of it); inside ``torch.autograd.grad`` with
    respect to such a leaf torch refuses to say — that backward is an input gradient's. The nodes are looked up one
    at a time and the answer taken at the first that runs (an ordinary backward: one lookup)."""
    any_node = False
    try:
        for node in gradient_nodes(params):
            any_node = True
            if torch._C._will_engine_execute_node(node):
                return True
    except RuntimeError:
        return True
    for node in gradient_nodes(inputs):
        any_node = True
        try:
            if torch._C._will_engine_execute_node(node):
                return True
        except RuntimeError:  # the leaf autograd.grad is taken with respect to
            continue
    return not any_node
