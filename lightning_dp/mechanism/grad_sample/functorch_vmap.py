"""Per-example gradients by per-layer ``torch.func.vmap`` (engine ``"vmap"``).

The strategy runs one ordinary backward of the *mean* loss, so the per-example loss is
never available to re-differentiate. What *is* available, per layer, is the layer's
input ``x`` (forward hook) and the gradient of the mean loss w.r.t. the layer's output
``δ`` (a tensor hook on the output). Because a layer acts on each example separately,
the per-example gradient of its parameters θ is the vector-Jacobian product

    g_i = n · ∂⟨f(θ, x_i), δ_i⟩ / ∂θ          (n = batch size, undoing the mean's 1/n)

which ``torch.func.vmap(torch.func.grad(...))`` evaluates for all i at once, for any
leaf module with parameters (ALGORITHMS.md, "The mechanism": this is g_{t,i}). Clipping
and summing then use :func:`clip_and_sum_materialised`.

This file also holds :class:`ActivationCapture`, the hook machinery shared with the
ghost engine (:mod:`.ghost`).

Assumptions (checked where possible): dimension 0 of every hooked layer's input and
output is the batch; a hooked layer does not mix examples (no BatchNorm); a parameter
is used only inside the forward of the module that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_dp.mechanism.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_and_sum_materialised,
    register_engine,
)

_BATCH_MIXING = (_BatchNorm, nn.RNNBase)


@dataclass
class Record:
    """One call of a hooked layer: its inputs and, after backward, the output gradient."""

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
    """

    name: str
    module: nn.Module
    records: list[Record] = field(default_factory=list)
    reduced: dict[str, Tensor] = field(default_factory=dict)

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


def direct_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs owned directly by ``module`` that require grad."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


class ActivationCapture:
    """Forward hooks that keep each hooked layer's inputs and output gradients.

    Only calls made with grad enabled whose output requires grad are recorded; calls
    that never see a backward (e.g. an extra forward for logging) are dropped by
    :meth:`completed`. Inputs are detached views: no copy beyond what autograd keeps.

    A layer attached with a :data:`RecordReducer` is reduced as soon as each call's output
    gradient arrives (:meth:`LayerCalls.reduce`): its inputs and output gradient are released
    during backward instead of being held until the clipping step.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._calls: dict[int, LayerCalls] = {}

    def attach(self, layers: Sequence[tuple[str, nn.Module]],
               reducer_for: Callable[[nn.Module], Optional[RecordReducer]] = lambda m: None) -> None:
        """Register a forward hook on every ``(name, module)``; ``reducer_for(module)`` picks
        the layers reduced during backward (default: none)."""
        self.detach()
        for name, module in layers:
            calls = LayerCalls(name, module)
            self._calls[id(module)] = calls
            hook = self._hook(calls, reducer_for(module))
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    @staticmethod
    def _hook(calls: LayerCalls, reducer: Optional[RecordReducer]):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if not (torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad):
                return
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                return
            rec = Record(tuple(a.detach() if isinstance(a, Tensor) else a for a in args), dict(kwargs))
            calls.records.append(rec)
            if reducer is None:
                out.register_hook(rec.set_grad)
            else:
                out.register_hook(lambda g: calls.reduce(rec, g, reducer))

        return hook

    def completed(self) -> dict[int, LayerCalls]:
        """Layers with at least one call that received an output gradient (id(module) → calls)."""
        done = {}
        for key, calls in self._calls.items():
            recs = [r for r in calls.records if r.grad_out is not None]
            if recs or calls.reduced:
                done[key] = LayerCalls(calls.name, calls.module, recs, dict(calls.reduced))
        return done

    def any_recorded(self) -> bool:
        """Whether any hooked layer saw a forward since the last :meth:`clear`."""
        return any(c.records for c in self._calls.values())

    def clear(self) -> None:
        """Drop every captured tensor (called after each step)."""
        for calls in self._calls.values():
            calls.records.clear()
            calls.reduced.clear()

    def detach(self) -> None:
        """Remove the hooks and captured tensors."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._calls.clear()


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


def structural_problems(module: nn.Module) -> list[str]:
    """Layers no per-layer engine can handle: batch-mixing layers, parameters owned by a
    module that also has children (used outside a leaf forward)."""
    problems = []
    for name, sub in module.named_modules():
        own = direct_trainable(sub)
        if not own:
            continue
        label = f"{name or '<root>'} ({type(sub).__name__})"
        if isinstance(sub, _BATCH_MIXING):
            problems.append(f"{label}: mixes examples or is not batch-first")
        elif any(True for _ in sub.children()):
            problems.append(f"{label}: owns parameters and has child modules")
    return problems


def batch_size_of_calls(layers: dict[int, LayerCalls]) -> int:
    """The common dimension 0 of every captured output gradient (and reduced per-example grad);
    raises if they differ."""
    sizes = {c.name: {r.grad_out.shape[0] if r.grad_out.dim() else -1 for r in c.records}
             | {g.shape[0] for g in c.reduced.values()} for c in layers.values()}
    distinct = set().union(*sizes.values()) if sizes else set()
    if len(distinct) != 1:
        raise ValueError(
            f"Hooked layers disagree on the batch size (dimension 0 of their outputs): {sizes}. "
            "Per-example gradients need batch-first layer inputs; e.g. expand position indices "
            "to [batch, T] before an nn.Embedding instead of broadcasting a [T] or [1, T] lookup."
        )
    return distinct.pop()


def vmap_layer_grads(
    calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int
) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of one leaf layer,
    g_i = n · ∂⟨f(θ, x_i), δ_i⟩/∂θ, by vmap over examples, summed over the layer's calls."""
    params = {name: p.detach() for name, p in wanted}
    total: dict[str, Tensor] = {}
    for rec in calls.records:
        in_dims = tuple(0 if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == n else None for a in rec.args)
        batched = [d == 0 for d in in_dims]
        kwargs = rec.kwargs
        module = calls.module

        def inner(p: dict[str, Tensor], delta: Tensor, *args: Any) -> Tensor:
            args1 = tuple(a.unsqueeze(0) if b else a for a, b in zip(args, batched))
            out = functional_call(module, p, args1, kwargs)
            return (out.squeeze(0) * delta.to(out.dtype)).sum()

        delta = rec.grad_out * n
        out = vmap(grad(inner), in_dims=(None, 0, *in_dims))(params, delta, *rec.args)
        for k, v in out.items():
            total[k] = v if k not in total else total[k] + v
    return total


@register_engine
class FunctorchVmapEngine(GradSampleEngine):
    """Engine ``"vmap"``: per-layer ``torch.func`` vjp, vmapped over examples.

    General for any leaf module with parameters (see the module docstring), at the cost
    of materialising ``[n, *p.shape]`` per parameter. Tied parameters (one Parameter in
    several modules) get the sum of their owners' per-example grads.
    """

    name = "vmap"

    def __init__(self) -> None:
        self._capture = ActivationCapture()
        self._owners: dict[Tensor, list[tuple[nn.Module, str, str]]] = {}

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module that owns parameters."""
        self._owners = owners_of(module)
        leaves = [(n, m) for n, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))
                  and not any(True for _ in m.children())]
        self._capture.attach(leaves)

    def detach(self) -> None:
        """Remove hooks and captured tensors."""
        self._capture.detach()
        self._owners = {}

    def clip_and_sum(
        self,
        params: Sequence[nn.Parameter],
        max_grad_norm: float,
        scale: Optional[ParamMap] = None,
        with_squares: bool = False,
    ) -> ClippedBatch:
        """Materialise per-example grads layer by layer, then clip and sum (base.py)."""
        try:
            samples = self._grad_samples(params)
            return clip_and_sum_materialised(params, samples, max_grad_norm, scale, with_squares)
        finally:
            self._capture.clear()

    def _grad_samples(self, params: Sequence[nn.Parameter]) -> list[Tensor]:
        layers = self._capture.completed()
        if not layers:
            return [p.new_zeros((0, *p.shape)) for p in params]
        n = batch_size_of_calls(layers)
        per_layer: dict[int, dict[str, Tensor]] = {}
        samples = []
        for p in params:
            acc = None
            for mod, mname, pname in self._owners.get(p, []):
                if id(mod) not in layers:
                    continue
                if id(mod) not in per_layer:
                    calls = layers[id(mod)]
                    per_layer[id(mod)] = vmap_layer_grads(calls, direct_trainable(mod), n) if n else {}
                g = per_layer[id(mod)].get(pname, p.new_zeros((n, *p.shape)))
                acc = g if acc is None else acc + g
            if acc is None:
                raise ValueError(_missing_message(p, self._owners.get(p, [])))
            samples.append(acc)
        return samples

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Layers this engine cannot give per-example gradients for, as 'name (Type): why'."""
        return structural_problems(module)


def _missing_message(p: Tensor, owners: list[tuple[nn.Module, str, str]]) -> str:
    where = ", ".join(f"{m or '<root>'}.{a}" for _, m, a in owners) or "a module outside the attached one"
    return (
        f"No per-example gradient captured for the trainable parameter {where} (shape {tuple(p.shape)}) "
        "although other layers ran backward: it is unused in this step's loss or used outside its "
        "module's forward. Freeze it (requires_grad=False) or use it through a leaf module."
    )
