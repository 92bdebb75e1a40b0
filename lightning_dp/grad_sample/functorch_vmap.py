"""Per-example gradients by per-layer ``torch.func.vmap`` (engine ``"vmap"``).

The strategy runs one ordinary backward of the *mean* loss, so the per-example loss is
never available to re-differentiate. What *is* available, per layer, is the layer's
input ``x`` (forward hook) and the gradient of the mean loss w.r.t. the layer's output
``δ`` (a tensor hook on the output). Because a layer acts on each example separately,
the per-example gradient of its parameters θ is the vector-Jacobian product

    g_i = n · ∂⟨f(θ, x_i), δ_i⟩ / ∂θ          (n = batch size, undoing the mean's 1/n)

which ``torch.func.vmap(torch.func.grad(...))`` evaluates for all i at once, for any
leaf module with parameters (docs/algorithms.md, "The mechanism": this is g_{t,i}). Clipping
and summing then use :func:`clip_and_sum_materialised`.

The hook machinery (:class:`~lightning_dp.grad_sample.capture.activations.ActivationCapture`) is shared
with the ghost engine (:mod:`.ghost`).

Assumptions, each verified (:mod:`lightning_dp.validators`): dimension 0 of every
hooked layer's output is the step's examples (every step); a hooked layer does not mix
examples (no BatchNorm: static check; anything else: the first step's probe); a parameter is
used only inside the forward of a module that owns it (the probe compares with autograd).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.overrides import TorchFunctionMode
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_dp._lazy import lazy_exports
from lightning_dp.engine_api import is_release
from lightning_dp.grad_sample.capture.activations import (
    ActivationCapture,
    LayerCalls,
    direct_trainable,
    is_unit,
    leaf_layers,
    owners_of,
)
from lightning_dp.grad_sample.capture.example_dims import example_dims, time_major_layers
from lightning_dp.grad_sample.attention import attention_grads, attention_supported
from lightning_dp.grad_sample.rnn_unrolled import recorded_input
from lightning_dp.grad_sample.rules import rule_for_calls
from lightning_dp.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_and_sum_materialised,
    mean_over_views,
    register_engine,
)
from lightning_dp.validators.example_dim import (
    check_example_dim,
    check_lookups_served,
    check_something_captured,
    example_dim_error,
    flattened_rnn_error,
    missing_gradient_error,
    random_replay_error,
    replay_shape_error,
)
from lightning_dp.validators.layers import parametrized, pruned

_BATCH_MIXING = (_BatchNorm,)


def structural_problems(module: nn.Module) -> list[str]:
    """Layers no per-layer engine can handle: a trainable BatchNorm in training mode (it mixes the examples). In
    eval mode its affine weights are served, and a later switch to training mode is refused when it runs
    (:mod:`~lightning_dp.validators.layers`). (Parameters owned by a module that also has children are
    served where the module broadcasts them over the examples:
    :mod:`~lightning_dp.grad_sample.capture.root_parameters`.)"""
    problems = []
    units: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(u + ".") for u in units):
            continue  # a unit's children are part of the unit (capture.is_unit)
        if is_unit(sub):
            units.append(name)
            continue
        own = [(pname, p) for pname, p in sub.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        label = f"{name or '<root>'} ({type(sub).__name__})"
        if isinstance(sub, _BATCH_MIXING) and sub.training:
            problems.append(f"{label}: mixes examples in training mode (keep it in eval, or use GroupNorm)")
    return problems


def _recorded_examples(rec: Any) -> int:
    """Dimension 0 of a call's (first) output gradient; for an RNN on a ``PackedSequence``, its number of
    sequences (its output gradient holds the rows of all of them)."""
    x = recorded_input(rec) if rec.args is not None else None
    if isinstance(x, PackedSequence):
        return int(x.batch_sizes[0])
    return rec.grad_out.shape[0] if rec.grad_out is not None and rec.grad_out.dim() else -1


def batch_size_of_calls(layers: dict[int, LayerCalls]) -> int:
    """The common dimension 0 of every captured output gradient (and reduced per-example grad),
    for engines used without :meth:`~GradSampleEngine.begin_step`; raises if they differ."""
    sizes = {c.name: {_recorded_examples(r) for r in c.records}
             | {g.shape[0] for g in c.reduced.values()} for c in layers.values()}
    distinct = set().union(*sizes.values()) if sizes else set()
    if len(distinct) != 1:
        raise example_dim_error({name: [(s,) for s in v] for name, v in sizes.items()}, None)
    return distinct.pop()


def step_batch_size(capture: ActivationCapture, layers: dict[int, LayerCalls]) -> int:
    """The step's number of examples n, verified: every captured call's example dimension is n
    (:mod:`~lightning_dp.validators.example_dim`), and n > 0 examples left some trace.
    Without :meth:`~ActivationCapture.begin_step`, n is inferred (and must agree across layers)."""
    n = capture.expected
    check_example_dim(capture.mismatched(), n)
    check_lookups_served(capture.unserved(), n)
    check_something_captured(bool(layers) or bool(capture.roots.grads), n)
    if n is None:
        return batch_size_of_calls(layers) if layers else 0
    return n


def _unsqueezed(value: Any, dims: Any) -> Any:
    """``value`` with each tensor given back the example dimension vmap removed (``dims``: a pytree
    of ints and ``None`` shaped like ``value``)."""
    if isinstance(dims, int):
        return value.unsqueeze(dims)
    if isinstance(dims, (tuple, list)):
        return type(value)(_unsqueezed(v, d) for v, d in zip(value, dims))
    return value


@contextmanager
def recomputable(module: nn.Module) -> Iterator[None]:
    """The layer as torch.func can re-run it per example, same values and gradients: an Embedding's
    ``max_norm`` renormalised the rows in the forward already (in place) and ``sparse`` changes only the
    gradient's format; an InstanceNorm in training uses the instance's statistics, and its running
    buffers (updated in place) are left out of the re-run. A pruned layer's weight (``weight_orig ⊙ weight_mask``,
    set as an attribute by its forward pre-hook, which the re-run calls on the replayed originals) is put back."""
    saved: dict[str, Any] = {}
    if isinstance(module, nn.Embedding):
        saved = {"max_norm": module.max_norm, "sparse": module.sparse}
        module.max_norm, module.sparse = None, False
    elif isinstance(module, _InstanceNorm) and module.training and module.track_running_stats:
        saved = {"running_mean": module.running_mean, "running_var": module.running_var}
        module.running_mean = module.running_var = None
    if pruned(module):
        saved.update({h._tensor_name: module.__dict__.get(h._tensor_name) for h in module._forward_pre_hooks.values()
                      if isinstance(getattr(h, "_tensor_name", None), str)})
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class _TransformedRequiresGrad(TorchFunctionMode):
    """Entered inside the per-example replay (:func:`_layer_grads`' ``inner``): a forward hook that marks the layer's
    output as requiring grad (Hugging Face's ``gradient_checkpointing_enable()`` puts one on the input embeddings, so
    that a reentrant checkpoint has an input that requires grad) runs in the replay too, where torch.func refuses
    ``requires_grad_`` on the tensors it transforms (it differentiates them already). There ``t.requires_grad_(True)``
    returns ``t`` unchanged where ``t`` is a tensor torch.func transforms; every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is Tensor.requires_grad_ and args and isinstance(args[0], Tensor)
                and bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
                and torch._C._functorch.is_functorch_wrapped_tensor(args[0])):
            return args[0]
        return func(*args, **kwargs)


def _sliced(value: Any, dims: Any, i: int, keep: bool = True) -> Any:
    """Example i of ``value``, per the pytree of example dimensions ``dims``: the dimension kept (``[1, …]``), or
    with ``keep=False`` removed (a flattened call's ``[n, m, …]`` record gives example i's ``[m, …]`` rows, the
    layout the layer was called with)."""
    if isinstance(dims, int):
        return value.narrow(dims, i, 1) if keep else value.select(dims, i)
    if isinstance(dims, (tuple, list)):
        return type(value)(_sliced(v, d, i, keep) for v, d in zip(value, dims))
    return value


def loop_layer_grads(
    calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int
) -> dict[str, Tensor]:
    """The per-example grads of :func:`vmap_layer_grads` by one small backward per example, for
    layers torch.func cannot vmap (the RNNs' fused kernels; data-dependent shapes). Same slicing and the same
    formula; a call on flattened examples is replayed on example i's ``[m, …]`` rows as they were laid out."""
    dims = example_dims(calls.module)
    total: dict[str, Tensor] = {}
    with torch.enable_grad():
        params = {name: p.detach().requires_grad_(True) for name, p in wanted}
        for rec in calls.records:
            arg_dims, kw_dims = calls.slot_dims(rec, n)
            present = [(k, dims.output(k)) for k, g in enumerate(rec.grad_outs) if g is not None]
            keep = not rec.flattened
            rows: list[tuple[Tensor, ...]] = []
            for i in range(n):
                args = tuple(_sliced(a, d, i, keep) for a, d in zip(rec.args, arg_dims))
                kwargs = {k: _sliced(v, kw_dims[k], i, keep) for k, v in rec.kwargs.items()}
                leaves = tree_flatten(functional_call(calls.module, params, args, kwargs))[0]
                dot = sum((leaves[k] * _sliced(rec.grad_outs[k], d, i, keep).to(leaves[k].dtype)).sum()
                          for k, d in present)
                rows.append(torch.autograd.grad(dot, list(params.values()), allow_unused=True))
            _add_rows(total, params, rows, n)
    return total


def _explicit_cell_state(rec: Any, module: nn.Module, n: int) -> None:
    """An ``nn.RNNCell``/``GRUCell``/``LSTMCell`` called without a state (``cell(x)``, the first step of a loop
    over time) makes its zeros from the input's size, which under vmap is one example's: the call is recorded with
    the zeros it used, ``[n, H]`` (both of them for an LSTM cell), so each example gets its row."""
    if not isinstance(module, nn.RNNCellBase) or rec.args is None or not rec.args:
        return
    x = rec.args[0]
    if (len(rec.args) > 1 and rec.args[1] is not None) or rec.kwargs.get("hx") is not None or x.dim() != 2:
        return
    zeros = x.new_zeros(x.shape[0], module.hidden_size)
    rec.args = (x, (zeros, zeros) if isinstance(module, nn.LSTMCell) else zeros, *rec.args[2:])
    rec.kwargs.pop("hx", None)


_LOOP_INSTEAD = ("dynamic shape", "data-dependent", ".item()",
                 "is not possible because there exists a Tensor `other` in extra_args that has more elements")
"""What vmap says when it cannot batch a layer that a loop over examples can replay: shapes or control flow that
depend on the data (``torch.nonzero``, ``if expert_idx == n:``, ``.item()``), and an in-place write of per-example
values into a tensor made without the examples (``torch.zeros(T, E).scatter_(1, idx, logits)``: a router's scores;
on CUDA also topk's own backward)."""


def _data_dependent(err: RuntimeError) -> bool:
    """Whether vmap refused a layer for a reason of :data:`_LOOP_INSTEAD` (the exact per-example loop serves it)."""
    text = str(err)
    return any(reason in text for reason in _LOOP_INSTEAD)


def replay_by_loop(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """:func:`loop_layer_grads` for a layer vmap cannot run because its shapes or control flow depend on the data (a
    mixture-of-experts block routing tokens with ``torch.nonzero``): exact, one small backward per example. The
    replay must be the step's computation, so it may not draw random numbers (checked: the generators' states
    before and after; refused if they moved)."""
    devices = sorted({p.device for _, p in wanted if p.device.type == "cuda"}, key=str)
    before = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    grads = loop_layer_grads(calls, wanted, n)
    after = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    if not all(torch.equal(a, b) for a, b in zip(before, after)):
        raise random_replay_error(calls.name, calls.module)
    return grads


def _add_rows(total: dict[str, Tensor], params: dict[str, Tensor], rows: list[tuple[Optional[Tensor], ...]],
              n: int) -> None:
    """Add n·[g_1; …; g_n] (example i's gradients ``rows[i]``, zero where a parameter got none) to ``total``."""
    for j, (name, p) in enumerate(params.items()):
        g = torch.stack([r[j] if r[j] is not None else torch.zeros_like(p) for r in rows]) * n
        total[name] = g if name not in total else total[name] + g


def _is_packed(rec: Any) -> bool:
    return isinstance(recorded_input(rec), PackedSequence)


def packed_loop_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """:func:`loop_layer_grads` for an RNN whose calls include some on a ``PackedSequence`` the unrolled rule does not
    serve (a subclass of torch's RNNs): example i is packed alone from its own ℓ_i steps (the batch's order:
    ``unsorted_indices``) with its own initial state, and g_i = n · ∂(⟨out_i, δ_i⟩ + ⟨h_n,i, δh_i⟩ + …)/∂θ,
    δ_i its rows of the packed output gradient."""
    padded = [r for r in calls.records if not _is_packed(r)]
    total = loop_layer_grads(replace(calls, records=padded), wanted, n) if padded else {}
    with torch.enable_grad():
        params = {name: p.detach().requires_grad_(True) for name, p in wanted}
        for rec in (r for r in calls.records if _is_packed(r)):
            x = recorded_input(rec)
            seq, lengths = pad_packed_sequence(x, batch_first=True)
            g_out = rec.grad_outs[0]
            d_seq = None if g_out is None else pad_packed_sequence(x._replace(data=g_out), batch_first=True)[0]
            hx = rec.args[1] if len(rec.args) > 1 else rec.kwargs.get("hx")
            rows: list[tuple[Tensor, ...]] = []
            for i in range(n):
                ell = int(lengths[i])
                alone = pack_padded_sequence(seq[i:i + 1, :ell], lengths[i:i + 1], batch_first=True)
                out = functional_call(calls.module, params, (alone, _sliced(hx, _hidden_dims(hx), i)))
                leaves = [out[0].data, *tree_flatten(out[1])[0]]
                dot = sum((leaves[k] * (d_seq[i, :ell] if k == 0 else g.narrow(1, i, 1)).to(leaves[k].dtype)).sum()
                          for k, g in enumerate(rec.grad_outs) if g is not None)
                rows.append(torch.autograd.grad(dot, list(params.values()), allow_unused=True))
            _add_rows(total, params, rows, n)
    return total


def _hidden_dims(hx: Any) -> Any:
    """Example dimension of an RNN's initial state (``[L, n, H]``, or LSTM's pair of them)."""
    return None if hx is None else [1, 1] if isinstance(hx, (tuple, list)) else 1


def replayed_layer_grads(
    calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int
) -> dict[str, Tensor]:
    """Per-example grads of a layer whose call drew random numbers (attention dropout): the whole
    batch is recomputed from the call's recorded random state (the same masks), and one backward
    batched over examples (``is_grads_batched``) gives g_i = n·∂⟨f(θ, x)_i, δ_i⟩/∂θ with example i's
    output gradient alone in row i. Exact; costs n output-sized gradients and a batched backward.
    Torch's ``nn.MultiheadAttention`` (attention dropout) does not come here: :func:`vmap_layer_grads`
    sends it to :func:`~.attention.attention_grads` (the same replay, one ordinary backward), except
    with ``add_bias_kv``."""
    dims = example_dims(calls.module)
    total: dict[str, Tensor] = {}
    device = next(calls.module.parameters()).device
    with torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        params = {name: p.detach().requires_grad_(True) for name, p in wanted}
        for rec in calls.records:
            cpu_state, cuda_state = rec.rng if rec.rng is not None else (torch.get_rng_state(), None)
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            leaves = tree_flatten(functional_call(calls.module, params, rec.args, rec.kwargs))[0]
            present = [(k, dims.output(k)) for k, g in enumerate(rec.grad_outs) if g is not None]
            outputs, per_example = [], []
            for k, d in present:
                g = rec.grad_outs[k].movedim(d, 0)  # [n, ...]
                eye = torch.eye(n, dtype=g.dtype, device=g.device).view(n, n, *([1] * (g.dim() - 1)))
                per_example.append((eye * g.unsqueeze(0)).movedim(1, d + 1) * n)  # row i: δ_i only
                outputs.append(leaves[k])
            grads = torch.autograd.grad(outputs, list(params.values()), per_example, is_grads_batched=True,
                                        allow_unused=True)
            for (name, p), g in zip(params.items(), grads):
                g = torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device) if g is None else g
                total[name] = g if name not in total else total[name] + g
    return total


def vmap_layer_grads(
    calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int
) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of one layer: the first registered rule with
    :attr:`~.rules.LayerRule.for_vmap` serving its calls (:mod:`.rules`, in their precedence: convolutions, PReLU,
    torch's RNNs, self-attention's projections, layers verified as w ⊙ y + b; never a parametrized layer), else
    :func:`_layer_grads`'s replay. Which rule a layer family gets is the registry's alone; what is left here is how
    the layer is replayed: under the autocast its calls ran under (``bf16-mixed``: a replay outside it would meet
    bfloat16 inputs with float32 weights; a rule with :attr:`~.rules.LayerRule.vmap_autocast` too, the others in the
    weights' precision)."""
    rule = rule_for_calls(calls, for_vmap=True)  # never a parametrized module
    if rule is not None and not rule.vmap_autocast:
        return rule.grads(calls, wanted, n)
    state = next((rec.autocast for rec in calls.records if rec.autocast is not None), None)
    with nullcontext() if state is None else torch.autocast(state[0], dtype=state[1]):
        return rule.grads(calls, wanted, n) if rule is not None else _layer_grads(calls, wanted, n)


def _layer_grads(
    calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int
) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of one layer no registered rule serves,
    g_i = n · Σ_k ∂⟨f_k(θ, x_i), δ_{k,i}⟩/∂θ over the layer's output tensors k, by vmap over
    examples, summed over the layer's calls.

    Inputs and output gradients are sliced at the layer's example dimension
    (:mod:`~lightning_dp.grad_sample.capture.example_dims`: ``[T, B, d]`` for ``batch_first=False``
    attention and RNNs); arguments that do not hold one row per example (masks, tables) are
    passed whole to every example (:meth:`LayerCalls.slot_dims`).

    What is decided here is only how a layer is replayed, where vmap cannot run it as it is: a parametrized RNN and
    an RNN's calls the unrolled rule does not cover (fused kernels torch.func cannot vmap: one small backward per
    example, :func:`loop_layer_grads`; a ``PackedSequence`` packed example by example, :func:`packed_loop_grads`; on
    flattened examples, refused), torch's ``nn.MultiheadAttention`` whose projections were not read from autograd's
    record (:mod:`.attention`: one batched forward and backward, attention dropout replayed from the call's random
    state), a call that drew random numbers (:func:`replayed_layer_grads`), an RNN cell called without a state,
    and shapes or control flow that depend on the data (:func:`replay_by_loop`)."""
    module = calls.module
    plain = not parametrized(module)  # else weights computed from originals: only a replay on the originals knows them
    if not plain and isinstance(module, nn.RNNBase):
        return loop_layer_grads(calls, wanted, n)
    if (plain and isinstance(module, nn.MultiheadAttention)
            and all(attention_supported(module, r) for r in calls.records)):
        return attention_grads(calls, wanted, n)
    if isinstance(module, nn.RNNBase) and any(_is_packed(rec) for rec in calls.records):
        return packed_loop_grads(calls, wanted, n)
    if isinstance(module, nn.RNNBase) and any(rec.flattened for rec in calls.records):
        raise flattened_rnn_error(calls.name, module)  # its rows are not one example's: no per-example replay
    if any(rec.rng is not None for rec in calls.records):
        return replayed_layer_grads(calls, wanted, n)
    if isinstance(calls.module, nn.RNNBase):
        return loop_layer_grads(calls, wanted, n)
    params = {name: p.detach() for name, p in wanted}
    dims = example_dims(calls.module)
    total: dict[str, Tensor] = {}
    for rec in calls.records:
        _explicit_cell_state(rec, calls.module, n)
        arg_dims, kw_dims = calls.slot_dims(rec, n)
        keys = list(rec.kwargs)
        values = [*rec.args, *(rec.kwargs[k] for k in keys)]
        slot_dims = [*arg_dims, *(kw_dims[k] for k in keys)]
        present = [(k, dims.output(k)) for k, g in enumerate(rec.grad_outs) if g is not None]
        n_args, module = len(rec.args), calls.module
        # No argument follows the examples (Perceiver's latents.expand(batch_size, …) from an int): a call that
        # returns all n rows gives example i row i of it.
        whole = all(d is None for d in slot_dims)
        # A call on flattened examples ([n·m, …], recorded as [n, m, …]) is replayed on example i's [m, …] rows as
        # they were laid out (a layer that takes [tokens, d] — a mixture of experts — sees [tokens, d]).
        flat = rec.flattened

        def inner(p: dict[str, Tensor], deltas: tuple[Tensor, ...], i: Tensor, *vals: Any) -> Tensor:
            vals1 = list(vals) if flat else [_unsqueezed(v, d) for v, d in zip(vals, slot_dims)]
            with _TransformedRequiresGrad():
                out = functional_call(module, p, tuple(vals1[:n_args]), dict(zip(keys, vals1[n_args:])))
            leaves = tree_flatten(out)[0]
            # all n rows, unless the output is already the example's gradient's shape (a call without arguments
            # returning a table whose first dimension happens to be n: the whole table is example i's)
            rows = [leaves[k].index_select(d, i.view(1))
                    if whole and leaves[k].shape[d] == n > 1 and leaves[k].shape != delta.shape else leaves[k]
                    for (k, d), delta in zip(present, deltas)]
            rows = [row if flat and not whole else row.squeeze(d) for row, (_, d) in zip(rows, present)]
            for row, delta in zip(rows, deltas):  # the replay is example i's call: its output has δ_i's shape
                if row.shape != delta.shape:
                    raise replay_shape_error(calls.name, tuple(row.shape), tuple(delta.shape))
            return sum((row * delta.to(row.dtype)).sum() for row, delta in zip(rows, deltas))

        deltas = tuple(rec.grad_outs[k] * n for k, _ in present)
        in_dims = (None, tuple(d for _, d in present), 0, *slot_dims)
        index = torch.arange(n, device=deltas[0].device if deltas else None)
        with recomputable(module):
            try:
                out = vmap(grad(inner), in_dims=in_dims)(params, deltas, index, *values)
            except RuntimeError as err:
                if not _data_dependent(err):
                    raise
                return replay_by_loop(calls, wanted, n)
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
    supports_padding = True
    supports_views = True

    def __init__(self) -> None:
        self._capture = ActivationCapture()
        self._owners: dict[Tensor, list[tuple[nn.Module, str, str]]] = {}

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module that owns parameters."""
        self._owners = owners_of(module)
        self._capture.attach(leaf_layers(module), time_major=frozenset(time_major_layers(module)), root=module)

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Drop earlier captures; verify this step's calls against ``num_examples`` (× the views per example)."""
        self._capture.begin_step(None if num_examples is None else num_examples * self.views_per_example)

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
        self._capture.end_backward()
        try:
            with self._capture.suspended():
                samples = mean_over_views(self._grad_samples(params), self.views_per_example)
            return clip_and_sum_materialised(params, samples, max_grad_norm, scale, with_squares,
                                             self.padding_rows)
        finally:
            self._capture.clear()

    def _grad_samples(self, params: Sequence[nn.Parameter]) -> list[Tensor]:
        layers = self._capture.completed()
        n = step_batch_size(self._capture, layers)
        roots = self._capture.roots
        if not layers and not roots.grads:
            return [p.new_zeros((0, *p.shape)) for p in params]
        per_layer: dict[int, dict[str, Tensor]] = {}
        samples = []
        for p in params:
            ran = not roots.owns(p) and any(id(mod) in layers for mod, _, _ in self._owners.get(p, []))
            direct = roots.direct(p, ran)  # read outside any layer (root_parameters.py)
            if direct is not None or roots.owns(p):
                samples.append(direct if direct is not None else unused_grads(p, n, self._owners.get(p, [])))
                continue
            acc = None
            for mod, mname, pname in self._owners.get(p, []):
                if id(mod) not in layers:
                    continue
                if id(mod) not in per_layer:
                    calls = layers[id(mod)]
                    per_layer[id(mod)] = vmap_layer_grads(calls, direct_trainable(mod), n) if n else {}
                g = per_layer[id(mod)].get(pname, p.new_zeros((n, *p.shape)))
                acc = g if acc is None else acc + g
            samples.append(unused_grads(p, n, self._owners.get(p, [])) if acc is None else acc)
        return samples

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Layers this engine cannot give per-example gradients for, as 'name (Type): why'."""
        return structural_problems(module)


def unused_in_step(p: Tensor) -> bool:
    """Whether no gradient reached ``p`` in this backward, for a parameter none of whose captured calls received an
    output gradient: autograd left ``p.grad`` unset (or zero). A parameter the loss never reads (a Hugging Face
    pooler under an LM head, a spare head, a mask token) then has exactly zero per-example gradients. One that is
    read where no hook sees it (a functional call on an idle layer's weight) has a gradient autograd accumulated
    into ``p.grad``: that is refused (:func:`missing_message`). A layer whose forward the ghost engine replaced by
    an input-gradient-only function never fills ``p.grad``; its use is seen by the hook on its output instead,
    which fires whenever a gradient reaches that output, in-place changes included (the capture hands the model
    a tensor that is not a view: a hook on a view is lost when the view is modified in place). A ``p.grad`` that is
    still the previous release, as written (:func:`~lightning_dp.engine_api.is_release`: a parameter in no optimizer
    group, which no ``zero_grad`` clears), is the library's own output, not a gradient of this step."""
    return p.grad is None or is_release(p.grad) or not bool(p.grad.any())


def unused_grads(p: Tensor, n: Optional[int], owners: list[tuple[nn.Module, str, str]]) -> Tensor:
    """Zero per-example gradients ``[n, *p.shape]`` for a parameter with no captured use that no gradient
    reached (:func:`unused_in_step`); otherwise the refusal of :func:`missing_message`."""
    if not unused_in_step(p):
        raise missing_message(p, owners)
    return p.new_zeros((n or 0, *p.shape))


def missing_message(p: Tensor, owners: list[tuple[nn.Module, str, str]]) -> Exception:
    """The error for a trainable parameter with no captured use (see :func:`missing_gradient_error`)."""
    where = ", ".join(f"{m or '<root>'}.{a}" for _, m, a in owners) or "a module outside the attached one"
    return missing_gradient_error(where, tuple(p.shape))


__getattr__ = lazy_exports(__name__, {
    "form_grads": "lightning_dp.grad_sample.linear_forms",
    "projection_forms": "lightning_dp.grad_sample.attention_projections",
    "rule_for": "lightning_dp.grad_sample.rules", "scale_layer_grads": "lightning_dp.grad_sample.elementwise_scale",
    "scale_served": "lightning_dp.grad_sample.elementwise_scale",
    "unrolled_rnn_grads": "lightning_dp.grad_sample.rnn_unrolled",
    "unrolled_supported": "lightning_dp.grad_sample.rnn_unrolled"
})
"""Names this module held before they moved (read access by the old name; new code imports their homes)."""
