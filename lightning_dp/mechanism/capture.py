"""Activation capture: what the per-layer engines record of each hooked layer's calls.

Shared machinery of the ``vmap`` and ``ghost`` engines (:mod:`.grad_sample`): a forward hook
keeps each call's inputs (keyword tensors included, bound to the layer's signature) and a
tensor hook on its output keeps the gradient of the mean loss w.r.t. that output, δ. From
(inputs, δ) an engine rebuilds or bounds each example's parameter gradient.

The capture also carries the first half of the engine contract (:class:`GradSampleEngine`):
the strategy tells it how many examples the sampler put in the step
(:meth:`ActivationCapture.begin_step`), and every call whose example dimension differs is
recorded as a mismatch (:func:`~lightning_dp.mechanism.validators.example_dim.check_example_dim`
turns it into an error naming the layer) instead of being clipped per token or per time step.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn


@dataclass
class Record:
    """One call of a hooked layer: its inputs and, after backward, the output gradient.

    ``args`` are the call's arguments bound to the layer's ``forward`` signature (a keyword
    tensor ``leaf(x=h)`` arrives as ``args[0]``); ``kwargs`` the keyword-only ones.
    """

    args: Optional[tuple[Any, ...]]  # None once the call was reduced (LayerCalls.reduce)
    kwargs: dict[str, Any]
    grad_out: Optional[Tensor] = None

    def set_grad(self, g: Tensor) -> None:
        """Tensor hook target: keep (accumulate, for retain_graph) the output gradient."""
        self.grad_out = g.detach() if self.grad_out is None else self.grad_out + g.detach()


RecordReducer = Callable[[Record], dict[str, Tensor]]
"""Per-example grads ``{parameter name: [n, *shape]}`` of one call, from its inputs and output grad."""


@dataclass
class LayerCalls:
    """Everything captured for one hooked layer during one step.

    ``records``: calls still holding their inputs (and, after backward, output grads).
    ``reduced``: for a layer with a reducer, the per-example grads of the calls already
    reduced during backward, summed over calls; those calls keep no tensors.
    ``mismatches``: output shapes of this step's calls whose example dimension was not the
    step's number of examples (nothing of those calls is kept).
    ``unbatched``: argument slots seen with a leading dimension other than the step's number of
    examples: never sliced per example afterwards (a [T, T] mask stays whole when T = n).
    """

    name: str
    module: nn.Module
    records: list[Record] = field(default_factory=list)
    reduced: dict[str, Tensor] = field(default_factory=dict)
    mismatches: list[tuple[int, ...]] = field(default_factory=list)
    unbatched: set[str] = field(default_factory=set)

    def reduce(self, rec: Record, grad_out: Tensor, reducer: RecordReducer) -> None:
        """Fold call ``rec``, whose output gradient has arrived, into :attr:`reduced`; drop its tensors."""
        if rec.args is None:
            raise RuntimeError(
                f"{self.name}: a second gradient reached an output whose inputs were already released "
                "(backward twice through one graph, retain_graph=True). The ghost engine reduces "
                "normalisation layers during the first backward; use per_sample='vmap' for this.")
        at = next((i for i, r in enumerate(self.records) if r is rec), None)
        if at is None:
            return  # the call's step was cleared already (a stale graph's backward): ignore it
        rec.grad_out = grad_out.detach()
        for pname, g in reducer(rec).items():
            self.reduced[pname] = self.reduced[pname] + g if pname in self.reduced else g
        del self.records[at]
        rec.args, rec.kwargs, rec.grad_out = None, {}, None

    def batched_slots(self, rec: Record, n: int) -> tuple[list[bool], dict[str, bool]]:
        """Which of ``rec``'s tensor arguments hold one row per example (sliced by vmap):
        leading dimension n, and never seen otherwise in this run (:attr:`unbatched`)."""

        def batched(key: str, a: Any) -> bool:
            return isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == n and key not in self.unbatched

        assert rec.args is not None
        return ([batched(str(i), a) for i, a in enumerate(rec.args)],
                {k: batched(k, v) for k, v in rec.kwargs.items()})


def direct_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs owned directly by ``module`` that require grad."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def owners_of(module: nn.Module) -> dict[Tensor, list[tuple[nn.Module, str, str]]]:
    """Map each parameter to the (module, module name, attribute) pairs that own it."""
    owners: dict[Tensor, list[tuple[nn.Module, str, str]]] = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub.named_parameters(recurse=False):
            entry = (sub, mname, pname)
            lst = owners.setdefault(p, [])
            if all(e[0] is not sub for e in lst):
                lst.append(entry)
    return owners


def leaf_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The leaf modules of ``module`` that own parameters: what per-layer engines hook."""
    return [(n, m) for n, m in module.named_modules()
            if any(True for _ in m.parameters(recurse=False)) and not any(True for _ in m.children())]


_SIGNATURES: dict[Any, inspect.Signature] = {}


def bind_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call with every argument that can be positional made positional,
    in the order of ``module.forward``'s signature: ``leaf(x=h)`` and ``leaf(h)`` record alike."""
    if not kwargs:
        return args, kwargs
    fn = getattr(module.forward, "__func__", module.forward)
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(module.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs  # the call itself will raise the user's error
    return tuple(bound.args), dict(bound.kwargs)


def broadcast_call(out: Tensor, args: tuple, n: int) -> tuple[Tensor, tuple]:
    """A call on a ``[1, …]`` input whose output the model broadcasts over the batch (Hugging
    Face's ``[1, T]`` position ids): its output, and its ``[1, …]`` tensor inputs, expanded to n
    rows (views, no copy). Broadcasting the expanded output gives the model the same values,
    and the gradient reaching it is now example i's in row i instead of the batch's sum, so the
    layer gets exact per-example gradients. (Were the output used in another way, the first
    step's probe, :mod:`~lightning_dp.mechanism.validators.probe`, would see the examples interact.)"""
    grown = tuple(a.expand(n, *a.shape[1:]) if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == 1 else a
                  for a in args)
    return out.expand(n, *out.shape[1:]), grown


class ActivationCapture:
    """Forward hooks that keep each hooked layer's inputs and output gradients.

    Only calls made with grad enabled whose output requires grad are recorded; calls
    that never see a backward (e.g. an extra forward for logging) are dropped by
    :meth:`completed`. Inputs are detached views: no copy beyond what autograd keeps.

    A layer attached with a :data:`RecordReducer` is reduced as soon as each call's output
    gradient arrives (:meth:`LayerCalls.reduce`): its inputs and output gradient are released
    during backward instead of being held until the clipping step.

    :meth:`begin_step` (n) clears whatever an earlier forward left behind and makes every call
    check its example dimension against n.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._calls: dict[int, LayerCalls] = {}
        self.expected: Optional[int] = None
        self._suspended = False
        self._unbatched: dict[int, set[str]] = {}  # per layer, kept across detach/attach (LayerCalls.unbatched)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """No recording while engines re-run a layer themselves (vmap's ``functional_call``)."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    def attach(self, layers: Sequence[tuple[str, nn.Module]],
               reducer_for: Callable[[nn.Module], Optional[RecordReducer]] = lambda m: None) -> None:
        """Register a forward hook on every ``(name, module)``; ``reducer_for(module)`` picks
        the layers reduced during backward (default: none)."""
        self.detach()
        for name, module in layers:
            calls = LayerCalls(name, module, unbatched=self._unbatched.setdefault(id(module), set()))
            self._calls[id(module)] = calls
            hook = self._hook(calls, reducer_for(module))
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Drop everything captured so far; calls from now on belong to a step of ``num_examples``."""
        self.clear()
        self.expected = num_examples

    def _hook(self, calls: LayerCalls, reducer: Optional[RecordReducer]):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            if self._suspended or not (torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad):
                return
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                return
            n = self.expected
            args, kwargs = bind_call(module, args, kwargs)
            if n is not None and n > 1 and out.dim() > 0 and out.shape[0] == 1:
                out, args = broadcast_call(out, args, n)
            if n is not None and (out.dim() == 0 or out.shape[0] != n):
                calls.mismatches.append(tuple(out.shape))
                return None
            if n is not None:
                self._note_unbatched(calls, args, kwargs, n)
            rec = Record(tuple(a.detach() if isinstance(a, Tensor) else a for a in args),
                         {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()})
            calls.records.append(rec)
            if reducer is None:
                out.register_hook(rec.set_grad)
            else:
                out.register_hook(lambda g: calls.reduce(rec, g, reducer))
            return out

        return hook

    @staticmethod
    def _note_unbatched(calls: LayerCalls, args: tuple, kwargs: dict, n: int) -> None:
        for key, a in [*((str(i), a) for i, a in enumerate(args)), *kwargs.items()]:
            if isinstance(a, Tensor) and (a.dim() == 0 or a.shape[0] != n):
                calls.unbatched.add(key)

    def completed(self) -> dict[int, LayerCalls]:
        """Layers with at least one call that received an output gradient (id(module) → calls)."""
        done = {}
        for key, calls in self._calls.items():
            recs = [r for r in calls.records if r.grad_out is not None]
            if recs or calls.reduced:
                done[key] = LayerCalls(calls.name, calls.module, recs, dict(calls.reduced),
                                       list(calls.mismatches), calls.unbatched)
        return done

    def mismatched(self) -> dict[str, list[tuple[int, ...]]]:
        """Layer name → output shapes of this step's calls whose example dimension was wrong."""
        return {c.name: list(c.mismatches) for c in self._calls.values() if c.mismatches}

    def any_recorded(self) -> bool:
        """Whether any hooked layer saw a forward since the last :meth:`clear`."""
        return any(c.records for c in self._calls.values())

    def clear(self) -> None:
        """Drop every captured tensor (called after each step)."""
        for calls in self._calls.values():
            calls.records.clear()
            calls.reduced.clear()
            calls.mismatches.clear()

    def detach(self) -> None:
        """Remove the hooks and captured tensors."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._calls.clear()
        self.expected = None
