"""Ghost norms + book-keeping: clipped sums without per-example gradients (engine ``"ghost"``).

For a layer that is linear in its weight W ∈ R^{out×in} (Linear; a convolution on its patches),
example i's weight gradient is G_i = n Σ_t δ_{i,t} a_{i,t}ᵀ, with a the layer input, δ the
output gradient of the *mean* loss (hence the factor n = batch size) and t over tokens or
spatial positions. Li et al. ("Large language models can be strong DP learners", §4,
ghost clipping) give its norm without forming G_i:

    ‖G_i‖² = Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') · n²         cost n·T²·(in+out)
    ‖G_i‖² = ‖δ_i‖² ‖a_i‖² · n²                          T = 1 (plain Linear)

and Bu et al.'s book-keeping turns the clipped sum into one contraction of the stored
(a, δ), with no second backward:

    Σ_i c_i G_i = (c ⊙ n δ)ᵀ a,     c_i = min(1, C/‖g_i‖)   (docs/algorithms.md, clip_C)

Per layer, the cheaper of the ghost norm and materialising G_i (cost n·T·in·out, memory
n·in·out) is chosen. Scale-then-privatize (docs/algorithms.md §4) needs ‖s⊙G_i‖: exact in
closed form for T = 1 (Σ_{o,j} s²_{oj} δ²_o a²_j) and for Embedding; otherwise that layer
materialises. Σ_i c_i s⊙G_i = s ⊙ Σ_i c_i G_i stays one contraction. LayerNorm, GroupNorm
and RMSNorm materialise their small per-example grads in closed form; the registered rules of
:mod:`.rules` serve their families (convolutions of any dimension, plain and transposed:
:mod:`.conv_rules`; PReLU: :mod:`.prelu_rule`); any other leaf layer with parameters falls
back to the per-layer vmap of :mod:`.functorch_vmap`.

Memory: book-keeping holds each Linear/Conv/Embedding layer's input and output gradient until
the clipped sums are taken. Normalisation layers are reduced to their [n, C] per-example grads
as soon as their output gradient arrives (:func:`reducer_for`), releasing input and output
gradient during backward (PReLU too); conv patch columns are unfolded a few examples at a time
(:func:`~.conv_rules.example_chunks`), never more than the layer's input in size.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample.capture.engine_hooks import ReplacedForward, is_own_forward
from lightning_dp.grad_sample.capture.example_dims import time_major_layers
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.clipping.rule import ClipRule, as_rule
from lightning_dp.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_from_parts,
    register_engine,
)
from lightning_dp.grad_sample.ghost_units import unit_sq_norms
from lightning_dp.grad_sample.capture.activations import (
    ActivationCapture,
    LayerCalls,
    Record,
    RecordReducer,
    direct_trainable,
    leaf_layers,
    owners_of,
)
from lightning_dp.grad_sample.elementwise_scale import scale_layer_grads, scale_served
from lightning_dp.grad_sample.attention_projections import projection_forms
from lightning_dp.grad_sample.ghost_recurrent import recurrent_served, recurrent_stats
from lightning_dp.grad_sample.linear_forms import form_stats
from lightning_dp.grad_sample.recurrent_forward import taped_forward
from lightning_dp.grad_sample.layer_groups import stack_small_layers
from lightning_dp.grad_sample.layer_stats import (
    LayerStats,
    MaterialisedStats,
    UnusedStats,
    WeightBiasStats,
    bookkept_product,
    gram_sq_norms,
    prefer_ghost,
    sq_norms,
)
from lightning_dp.grad_sample.ghost_tied import Dense, Lookup, LowRank, Representation, cross_term, dense
from lightning_dp.grad_sample.functorch_vmap import (
    missing_message,
    step_batch_size,
    structural_problems,
    unused_in_step,
    vmap_layer_grads,
)
from lightning_dp.grad_sample.conv_rules import sharding_served
from lightning_dp.grad_sample.rules import rule_for
from lightning_dp.grad_sample.streamed_sums import StreamedSums
from lightning_dp.validators.layers import parametrized

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def prefer_ghost_embedding(T: int, V: int) -> bool:
    """Embedding: ghost norm (n·T²·d multiply-adds, an [n, T, T] buffer) unless scattering
    into [n, V, d] is both cheaper and small: T² > 16·V (one scattered element costs about as
    much as 16–20 multiply-adds; measured on CPU, V = 64–256, T = 64) and V ≤ 8·T (the
    scatter buffer at most 8× the output gradient). A 50k vocabulary at T = 512 thus takes the
    ghost norm (a [n, V, d] buffer would be 9.9 GB at n = 64, d = 768); position tables
    (V = T) scatter."""
    return T * T <= 16 * V or V > 8 * T


class LinearFormStats(WeightBiasStats):
    """A layer with per-example weight grad n Σ_t δ_t a_tᵀ (+ bias grad n Σ_t δ_t).

    ``a``: [n, T, in]; ``d``: [n, T, out], the mean-loss output gradient; ``k`` = n multiplies
    it (folded into the norms and the clip factors instead of copying ``d``).
    """

    def __init__(self, a: Tensor, d: Tensor, k: float, weight: Optional[Tensor], bias: Optional[Tensor],
                 scale: Optional[ParamMap], with_squares: bool, transposed: bool = False) -> None:
        self.a, self.d, self.k, self.weight, self.bias = a, d, k, weight, bias
        self.transposed = transposed  # the weight is stored [in, out] (Hugging Face's Conv1D)
        sw = None if scale is None or weight is None else scale[weight]
        self.sw = None if sw is None else (sw.t() if transposed else sw).reshape(d.shape[2], a.shape[2])
        self.sb = None if scale is None or bias is None else scale[bias]
        self.G: Optional[Tensor] = None
        n, T = a.shape[0], a.shape[1]
        sq = a.new_zeros(n)
        if weight is not None:
            self.weight_sq = self._weight_sq_norms(T, with_squares)
            sq = sq + self.weight_sq
        if bias is not None:
            self.db = d.sum(1) if self.sb is None else d.sum(1) * self.sb
            sq = sq + self.db.pow(2).sum(1)
        self.sq_norms = sq * (k * k)

    def _weight_sq_norms(self, T: int, with_squares: bool) -> Tensor:
        a, d, sw = self.a, self.d, self.sw
        if T == 1:
            a1, d1 = a[:, 0], d[:, 0]
            if sw is None:
                return torch.linalg.vector_norm(a1, dim=1).pow(2) * torch.linalg.vector_norm(d1, dim=1).pow(2)
            return ((d1 * d1) @ (sw * sw) * (a1 * a1)).sum(1)
        if sw is None and not with_squares and prefer_ghost(T, a.shape[2], d.shape[2]):
            return gram_sq_norms(a, d)
        G = torch.bmm(d.transpose(1, 2), a)
        self.G = G if sw is None else G * sw
        return sq_norms(self.G)

    def _as_weight(self, w: Tensor) -> Tensor:
        return w.t() if self.transposed else w.reshape(self.weight.shape)

    def _low_rank(self) -> Optional[Representation]:
        if self.sw is not None:
            return None
        return LowRank(self.a, self.d, self.k) if self.transposed else LowRank(self.d, self.a, self.k)

    def _bookkept_weight_sum(self, c: Tensor) -> Tensor:
        """Σ_i c_i G_i without G: one book-keeping contraction (c ⊙ δ)ᵀa over all n·T tokens."""
        w = bookkept_product(self.a, self.d, c)
        return w if self.sw is None else w * self.sw

    def _bookkept_weight_squares(self, c2: Tensor) -> Tensor:
        """Σ_i c_i² G_i² without G: only for T = 1, where G_i² = (δ_i²)(a_i²)ᵀ."""
        w = (self.d[:, 0].pow(2) * c2[:, None]).t() @ self.a[:, 0].pow(2)
        return w if self.sw is None else w * self.sw.pow(2)


class EmbeddingStats(LayerStats):
    """nn.Embedding: per-example grad n Σ_t onehot(x_t) δ_tᵀ. Ghost norm
    Σ_{t,t'} [x_t = x_t'] (s²_{x_t} ⊙ δ_t)·δ_t' (exact with scale), or scatter into [n, V, d]
    when :func:`prefer_ghost_embedding` says so (or squares are wanted)."""

    def __init__(self, idx: Tensor, d: Tensor, weight: Tensor, scale: Optional[ParamMap], with_squares: bool) -> None:
        self.idx, self.d, self.weight = idx, d, weight
        self.s = None if scale is None else scale[weight]
        self.G: Optional[Tensor] = None
        n, T = idx.shape
        V = weight.shape[0]
        if with_squares or not prefer_ghost_embedding(T, V):
            G = self._scatter()
            self.G = G if self.s is None else G * self.s
            self.sq_norms = sq_norms(self.G)
        else:
            ds = d if self.s is None else d * self.s.pow(2)[idx]
            same = (idx[:, :, None] == idx[:, None, :]).to(d.dtype)
            self.sq_norms = (torch.bmm(ds, d.transpose(1, 2)) * same).sum((1, 2))

    def _scatter(self) -> Tensor:
        n, T = self.idx.shape
        V, dim = self.weight.shape
        flat = (torch.arange(n, device=self.idx.device)[:, None] * V + self.idx).reshape(-1)
        G = self.d.new_zeros(n * V, dim).index_add_(0, flat, self.d.reshape(-1, dim))
        return G.view(n, V, dim)

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i · g_i per parameter, for per-example clip factors c."""
        dim = self.weight.shape[1]
        w = self.d.new_zeros(self.weight.shape)
        w.index_add_(0, self.idx.reshape(-1), (self.d * c[:, None, None]).reshape(-1, dim))
        return {self.weight: w if self.s is None else w * self.s}

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² · g_i² per parameter, for squared clip factors c2."""
        return {self.weight: torch.tensordot(c2, self.G.pow(2), dims=1)}

    def representation(self, p: Tensor) -> Optional[Representation]:
        """The scattered G, or the lookup form Σ_t onehot(x_t) δ_tᵀ (unscaled layers)."""
        if self.G is not None:
            return Dense(self.G)
        return Lookup(self.idx, self.d) if self.s is None else None


def _as_float(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype) if t.dtype != like.dtype else t


def _cat(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Concatenate calls of one layer along the token axis (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _wanted(module: nn.Module, params: set) -> dict[str, Tensor]:
    return {n: p for n, p in direct_trainable(module) if p in params}


def linear_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """nn.Linear: inputs [n, *, in] flattened to [n, T, in]; calls concatenated along T."""
    m = calls.module
    a = _cat([_as_float(r.args[0], m.weight).reshape(n, -1, m.in_features) for r in calls.records])
    d = _cat([_as_float(r.grad_out, m.weight).reshape(n, -1, m.out_features) for r in calls.records])
    return LinearFormStats(a, d, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares)


def is_hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): y = x W + b with W stored [in, out]; a Linear in all but layout."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, Tensor) and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1])


def hf_conv1d_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Hugging Face's Conv1D: the Linear rule on [n, T, in] inputs, weight transposed."""
    m = calls.module
    d_in, d_out = m.weight.shape
    a = _cat([_as_float(r.args[0], m.weight).reshape(n, -1, d_in) for r in calls.records])
    d = _cat([_as_float(r.grad_out, m.weight).reshape(n, -1, d_out) for r in calls.records])
    return LinearFormStats(a, d, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares, transposed=True)


def embedding_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """nn.Embedding: indices [n, *] flattened to [n, T]; padding_idx rows get no gradient."""
    m = calls.module
    idx = torch.cat([r.args[0].reshape(n, -1) for r in calls.records], 1)
    d = torch.cat([_as_float(r.grad_out, m.weight).reshape(n, -1, m.embedding_dim) for r in calls.records], 1) * n
    if m.padding_idx is not None:
        d = d * (idx != m.padding_idx).unsqueeze(-1).to(d.dtype)
    return EmbeddingStats(idx, d, m.weight, scale, with_squares)


def norm_layer_record_grads(m: nn.Module, rec: Record) -> dict[str, Tensor]:
    """LayerNorm / GroupNorm / RMSNorm, one call: per-example grads n Σ δ⊙x̂ (weight) and
    n Σ δ (bias) of its trainable parameters, n = dimension 0 of the output gradient.

    The ghost engine reduces these layers during backward (:meth:`LayerCalls.reduce`): the
    grads are [n, C], far smaller than the input and output gradient they replace."""
    like = m.weight if m.weight is not None else rec.grad_out
    x, d = _as_float(rec.args[0], like), _as_float(rec.grad_out, like)
    if isinstance(m, nn.GroupNorm):
        # channels in dimension 1 of what the layer saw: [n, C, …], or [n, k, C, …] for a call on flattened rows
        # ([n·k, C, …] recorded per example), normalised row by row
        flat = rec.flattened and x.dim() > 2
        xhat = F.group_norm(x.flatten(0, 1) if flat else x, m.num_groups, eps=m.eps).view(x.shape)
        dims = tuple(k for k in range(1, x.dim()) if k != (2 if flat else 1))
    else:
        k = len(m.normalized_shape)
        if isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(x, m.normalized_shape, eps=m.eps)
        else:
            xhat = F.rms_norm(x, m.normalized_shape, eps=m.eps)
        dims = tuple(range(1, x.dim() - k))
    n = d.shape[0]
    grads = {}
    for pname, p in m._parameters.items():  # a plain norm layer's own (direct_trainable, without its module walk)
        if p is None or not p.requires_grad:
            continue
        g = d * xhat if pname == "weight" else d
        grads[pname] = (g.sum(dims) if dims else g) * n
    return grads


def norm_layer_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """LayerNorm / GroupNorm / RMSNorm: the calls reduced during backward plus any still held."""
    per_name = dict(calls.reduced)
    for r in calls.records:
        for pname, g in norm_layer_record_grads(calls.module, r).items():
            per_name[pname] = per_name[pname] + g if pname in per_name else g
    return MaterialisedStats({p: per_name[k] for k, p in wanted.items()}, scale)


def is_plain_norm(m: nn.Module) -> bool:
    """LayerNorm / GroupNorm / RMSNorm with the torch forward (a subclass that permutes inside its
    forward, timm's channels-first LayerNorm2d, normalises another axis: per-layer vmap instead)."""
    return any(isinstance(m, kind) and type(m).forward is kind.forward for kind in _NORMS)


def reducer_for(m: nn.Module) -> Optional[RecordReducer]:
    """The layers the ghost engine reduces during backward: normalisation layers, and those of a registered rule
    that reduces (PReLU)."""
    if parametrized(m):
        return None
    if is_plain_norm(m):
        return lambda rec: norm_layer_record_grads(m, rec)
    rule = rule_for(m)
    return (lambda rec: rule.record_grads(m, rec)) if rule is not None and rule.reduces else None


def fallback_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Any other leaf layer: per-layer vmap (materialised)."""
    named = [(k, p) for k, p in wanted.items()]
    grads = vmap_layer_grads(calls, named, n)
    return MaterialisedStats({p: grads[k] for k, p in named}, scale)


def stats_for(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Dispatch one layer to its specialised rule (ghost / closed form) or the vmap fallback."""
    m = calls.module
    if parametrized(m):  # weights computed from originals: the layer replayed per example on them
        return fallback_stats(calls, wanted, n, scale, with_squares)
    rule = rule_for(m)  # the registered rules (rules.py): convolutions, PReLU
    if rule is not None:
        return rule.stats(calls, wanted, n, scale, with_squares)
    if type(m) is nn.Linear:
        return linear_stats(calls, wanted, n, scale, with_squares)
    if is_hf_conv1d(m):
        return hf_conv1d_stats(calls, wanted, n, scale, with_squares)
    if type(m) is nn.Embedding and not m.scale_grad_by_freq:
        return embedding_stats(calls, wanted, n, scale, with_squares)
    if is_plain_norm(m):
        return norm_layer_stats(calls, wanted, n, scale, with_squares)
    if recurrent_served(calls):
        return recurrent_stats(calls, wanted, n, scale, with_squares)
    forms = projection_forms(calls, list(wanted.items()), n) if isinstance(m, nn.MultiheadAttention) else None
    if forms is not None:
        return form_stats(forms, wanted, n, scale, with_squares)
    if scale_served(calls):
        grads = scale_layer_grads(calls, list(wanted.items()), n)
        return MaterialisedStats({p: grads[k] for k, p in wanted.items()}, scale)
    return fallback_stats(calls, wanted, n, scale, with_squares)


def has_closed_form(m: nn.Module) -> bool:
    """Whether :func:`stats_for` serves ``m`` by a rule of its own (not the per-layer vmap fallback, which
    differentiates the layer's registered parameters again: not possible when FSDP2 shards them)."""
    return not parametrized(m) and (type(m) is nn.Linear or is_hf_conv1d(m) or sharding_served(m)
                                    or is_plain_norm(m) or (type(m) is nn.Embedding and not m.scale_grad_by_freq))


class _LinearInputGradOnly(torch.autograd.Function):
    """F.linear whose backward computes only the input gradient (book-keeping, Bu et al.):
    the weight/bias gradients come from :class:`LinearFormStats`, so the ordinary backward
    leaves ``p.grad`` untouched instead of spending a matmul on the non-private gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        # ctx-style forward (no setup_context): autograd then skips an inspect.signature per call.
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        if x.dim() <= 2:
            return F.linear(x, weight, bias)
        # F.linear on [..., d] returns a view of its 2-D product, and autograd forbids in-place ops on a view
        # a custom Function returns (`q = self.q(h); q /= s`: Longformer, LED, Swinv2). Reshaped the way
        # aten::linear's own autograd path does it (_unsafe_view: same storage, not tracked as a view).
        out = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, g: Tensor):
        (weight,) = ctx.saved_tensors
        gx = (g @ weight.to(g.dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return gx, None, None


def _linear_forward(self: nn.Linear, input: Tensor) -> Tensor:  # noqa: A002  (nn.Linear's own name: keyword calls)
    if torch._C._are_functorch_transforms_active():  # replayed inside vmap (a PEFT DoRA layer calls its base layer)
        return F.linear(input, self.weight, self.bias)
    return _LinearInputGradOnly.apply(input, self.weight, self.bias)


def _rnn_forward(self: nn.RNNBase, *args, **kwargs):
    """Served calls (:mod:`.recurrent_forward`): torch's fused forward whose backward is the unrolled rule's, the
    weights' forms left for the clipping. Otherwise the module's own forward on its weights detached: the kernel's
    backward then computes only the input and initial-state gradients (the weights' clipped sums come from
    :mod:`.ghost_recurrent`). Only the registered ``nn.Parameter`` objects are detached: a replay that substitutes
    plain tensors (``functional_call`` in the per-example loop or the dropout replay) differentiates them as usual;
    and nothing is detached where no input of the call requires grad (an RNN on the data itself: its output would
    not require grad, and no gradient would reach the hooks). The module's list of weights is first brought up to
    date with its attributes (as its own forward does): restored afterwards, it then matches the references torch
    keeps to tell a later ``functional_call`` apart."""
    update = getattr(self, "_update_flat_weights", None)
    if update is not None:
        update()
    taped = taped_forward(self, args, kwargs)
    if taped is not None:
        return taped
    inputs = [t for a in (*args, *kwargs.values()) for t in tree_flatten(a)[0] if isinstance(t, Tensor)]
    if not any(t.requires_grad for t in inputs):
        return type(self).forward(self, *args, **kwargs)
    flat = self._flat_weights
    self._flat_weights = [w.detach() if isinstance(w, nn.Parameter) else w for w in flat]
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        self._flat_weights = flat


def input_grad_only_forward(m: nn.Module):
    """The book-keeping forward for ``m`` (Linear, torch's convolutions and RNNs), or None (also for a parametrized
    module: its weight's gradient must reach the originals)."""
    if parametrized(m):
        return None
    if type(m) is nn.Linear:
        return _linear_forward
    rule = rule_for(m)
    if rule is not None:
        return rule.input_grad_only_forward(m)
    if type(m) in (nn.LSTM, nn.GRU, nn.RNN):
        return _rnn_forward
    return None


@register_engine
class GhostEngine(GradSampleEngine):
    """Engine ``"ghost"``: ghost norms and one book-keeping contraction per layer (module docstring).

    Args:
        skip_param_grads: book-keeping proper: Linear and convolution layers run a forward whose
            backward skips their weight/bias gradients (``p.grad`` is left as it was, e.g.
            None, after ``loss.backward()``; the engine's clipped sums replace it). Saves the matmul the
            ordinary backward spends on the non-private gradient. ``False`` keeps the
            module's own forward and the usual ``p.grad``. Not for double backward.

    Attributes:
        stream_sums: return the clipped sums as a :class:`~.streamed_sums.StreamedSums` (each layer's
            contraction run when its parameters are first read, its captured tensors released then), so a
            consumer reading one parameter at a time never holds a model-sized gradient (the sharded
            privatizer). Not with ``with_squares``. Off by default.
    """

    stream_sums: bool = False

    name = "ghost"
    supports_padding = True

    def __init__(self, skip_param_grads: bool = True) -> None:
        self.skip_param_grads = skip_param_grads
        self._capture = ActivationCapture()
        self._owners: dict[Tensor, list] = {}
        self._patched: list[nn.Module] = []

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module that owns parameters (and patch Linear/convolution forwards, see class doc)."""
        self.detach()
        self._owners = owners_of(module)
        leaves = leaf_layers(module)
        self._capture.attach(leaves, reducer_for, frozenset(time_major_layers(module)), root=module)
        if self.skip_param_grads:
            for _, m in leaves:
                fwd = input_grad_only_forward(m)
                if fwd is not None and is_own_forward(m) and self._sole_owner(m):
                    m.forward = ReplacedForward(fwd, m)
                    self._patched.append(m)

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Drop earlier captures; verify this step's calls against ``num_examples``."""
        self._capture.begin_step(num_examples)

    def _sole_owner(self, m: nn.Module) -> bool:
        return all(len(self._owners[p]) == 1 for p in m.parameters(recurse=False))

    def detach(self) -> None:
        """Remove hooks, captured tensors and patched forwards."""
        self._capture.detach()
        for m in self._patched:
            if "forward" in m.__dict__:
                del m.forward
        self._patched = []
        self._owners = {}

    def clip_and_sum(
        self,
        params: Sequence[nn.Parameter],
        max_grad_norm: Union[float, ClipRule],
        scale: Optional[ParamMap] = None,
        with_squares: bool = False,
    ) -> ClippedBatch:
        """Norms per layer (ghost or materialised), clip factors, one contraction per layer."""
        self._capture.end_backward()
        try:
            with self._capture.suspended():
                return self._clip_and_sum(params, max_grad_norm, scale, with_squares)
        finally:
            self._capture.clear()

    def _clip_and_sum(self, params, max_grad_norm, scale, with_squares) -> ClippedBatch:
        rule = as_rule(max_grad_norm)
        layers = self._capture.completed()
        n = step_batch_size(self._capture, layers)
        if n == 0:
            zeros = {p: torch.zeros_like(p) for p in params}
            sq = {p: torch.zeros_like(p) for p in params} if with_squares else None
            return ClippedBatch(zeros, sq, torch.zeros(0, device=params[0].device if params else None), 0)
        ran = {p: self._owners_that_ran(p, layers) for p in params}
        shared = [p for p in params if len(ran[p]) > 1 and not self._capture.roots.owns(p)]
        whole = not (rule.per_parameter or rule.grouped)  # one factor per example from its whole norm
        stackable = whole and scale is None and not with_squares and not self.stream_sums and not shared
        stats, groups = self._layer_stats(params, layers, n, scale, with_squares, ran, stackable)
        if not whole:  # per-parameter norms or units' norms: every layer's own stats (never stacked)
            return self._clip_by_rule(params, rule, stats, ran, shared, layers, n, scale, with_squares)
        reps = {p: self._representations(p, ran[p], stats, layers, n, scale, with_squares, set(params))
                for p in shared}
        parts = [st.sq_norms for st in [*stats.values(), *groups]]
        for p, rs in reps.items():  # tied weights: ‖Σ_A G^A‖² = Σ_A ‖G^A‖² + 2 Σ_{A<B} ⟨G^A, G^B⟩ (ghost_tied.py)
            parts += [2 * cross_term(a, b, p.shape[0]) for j, a in enumerate(rs) for b in rs[j + 1:]]
        pad = self.padding_rows
        norms, c = clip_from_parts(parts, rule, pad)  # summed over layers in float64; the policy's factors; padding: 0
        if self.stream_sums and not with_squares:
            keys = {p: [id(p)] if id(p) in stats else list(dict.fromkeys(id(mod) for mod, _, _ in ran[p]))
                    for p in params}  # stats by parameter: root-owned and unused ones
            return ClippedBatch(StreamedSums(params, stats, keys, c), None,  # type: ignore[arg-type]
                                norms[:n - pad].detach(), n - pad)
        sums: dict[Tensor, Tensor] = {}
        squares: Optional[dict[Tensor, Tensor]] = {} if with_squares else None
        for st in [*stats.values(), *groups]:
            for p, v in st.sums(c).items():  # a tied weight gets every owner's contraction
                sums[p] = sums[p] + v if p in sums else v
            if squares is not None:
                squares.update(st.squares(c * c))
        if squares is not None:  # squares do not add over owners: (Σ_A G^A)² from the materialised total
            for p, rs in reps.items():
                total = sum(dense(r, p.shape[0]) for r in rs)
                squares[p] = torch.tensordot(c * c, total * total, dims=1).reshape(p.shape)
        return ClippedBatch({p: sums[p] for p in params},
                            None if squares is None else {p: squares[p] for p in params}, norms[:n - pad].detach(),
                            n - pad)

    def _clip_by_rule(self, params, rule: ClipRule, stats: dict[int, LayerStats], ran: dict, shared: list,
                      layers: dict[int, LayerCalls], n: int, scale, with_squares: bool) -> ClippedBatch:
        """Per-parameter norms (per-layer clipping) or norms of units of several examples (users), then the
        factors per example (per parameter) in each layer's own contraction (:mod:`.ghost_units`)."""
        if with_squares:
            raise PrivacyConfigurationError("a second moment (independent_moments) is not served with per-layer "
                                            "clipping or user-level units: use flat clipping of examples with it")
        pad = self.padding_rows
        if pad and rule.grouped:
            raise PrivacyConfigurationError("padding rows (fixed_batch_size) belong to no unit: not served with "
                                            "units of several examples (privacy_unit=Users)")
        members: dict[int, list[Tensor]] = {}
        for p in params:
            for key in ([id(p)] if id(p) in stats else []) + [id(mod) for mod, _, _ in ran[p] if id(mod) in stats]:
                members.setdefault(key, []).append(p)
        if rule.grouped:
            sq = self._unit_sq_norms(params, rule, stats, ran, layers, n, scale)
        else:
            sq = self._param_sq_norms(params, stats, members, ran, shared, layers, n, scale)
        used = sq if rule.per_parameter else sq.sum(0)
        f = rule.example_factors(used)
        if pad:  # padding rows (fixed_batch_size): factor exactly 0, out of the norms and the count
            f = f.clone()
            f[..., n - pad:] = 0.0
            used = used[..., :n - pad]
        row = {p: k for k, p in enumerate(params)}  # by identity (a tensor's == is elementwise)
        sums: dict[Tensor, Tensor] = {}
        for key, st in stats.items():
            parts = (st.sums_by_param({p: f[row[p]] for p in members.get(key, [])})
                     if rule.per_parameter else st.sums(f))
            for p, v in parts.items():
                sums[p] = sums[p] + v if p in sums else v
        zero = {p: torch.zeros_like(p) for p in params if p not in sums}
        return ClippedBatch({p: sums[p] if p in sums else zero[p] for p in params}, None,
                            rule.unit_norms(used).detach(), n - pad)

    def _param_sq_norms(self, params, stats: dict[int, LayerStats], members: dict[int, list[Tensor]], ran: dict,
                        shared: list, layers: dict[int, LayerCalls], n: int, scale) -> Tensor:
        """Each example's squared norm per parameter ``[P, n]``: the layers' parts, a layer holding only their
        total materialised, tied parameters' cross terms added."""
        wanted = set(params)
        reps = {p: self._representations(p, ran[p], stats, layers, n, scale, False, wanted) for p in shared}
        total = {p: params[0].new_zeros(n, dtype=torch.float32) for p in params}
        for key, ps in members.items():
            parts = stats[key].param_sq_norms(ps)
            if parts is None:
                calls = layers[key]
                stats[key] = fallback_stats(calls, _wanted(calls.module, wanted), n, scale, False)
                parts = stats[key].param_sq_norms(ps)
            for p in ps:
                total[p] = total[p] + parts[p]
        for p, rs in reps.items():
            total[p] = total[p] + 2 * sum(cross_term(a, b, p.shape[0]) for j, a in enumerate(rs) for b in rs[j + 1:])
        return torch.stack([total[p] for p in params])

    def _unit_sq_norms(self, params, rule: ClipRule, stats: dict[int, LayerStats], ran: dict,
                       layers: dict[int, LayerCalls], n: int, scale) -> Tensor:
        """Each unit's squared norm of its summed gradient per parameter ``[P, u]`` (:mod:`.ghost_units`)."""
        assert rule.groups is not None
        units, wanted = rule.num_units(), set(params)
        out = []
        for p in params:
            if id(p) in stats:
                reps = [stats[id(p)].representation(p)]
            else:
                reps = self._representations(p, ran[p], stats, layers, n, scale, False, wanted)
            reps = [r for r in reps if r is not None]  # a parameter the step never read: zero
            out.append(unit_sq_norms(reps, rule.groups, units, p.shape[0]) if reps
                       else params[0].new_zeros(units, dtype=torch.float32))
        return torch.stack(out)

    def _layer_stats(self, params, layers: dict[int, LayerCalls], n: int, scale, with_squares,
                     ran: dict[Tensor, list], stackable: bool) -> tuple[dict[int, LayerStats], list[LayerStats]]:
        """One :class:`LayerStats` per module owning a wanted parameter (a tied weight: each owner), and, when
        ``stackable`` (no scale, no squares, no streaming, no tied weight), the groups of small layers of one shape
        that are clipped together instead (:mod:`.layer_groups`)."""
        wanted_set = set(params)
        stats: dict[int, LayerStats] = {}
        modules: dict[int, nn.Module] = {}
        roots = self._capture.roots
        for p in params:
            owners = [] if roots.owns(p) else ran[p]
            direct = roots.direct(p, bool(owners))  # read outside any layer (root_parameters.py)
            if direct is not None:
                stats[id(p)] = MaterialisedStats({p: direct}, scale)
                continue
            if not owners:  # no captured use: unused in this step (zero), or refused
                if not unused_in_step(p):
                    raise missing_message(p, self._owners.get(p, []))
                stats[id(p)] = UnusedStats(p, n)
                continue
            for mod, _, _ in owners:
                modules.setdefault(id(mod), mod)
        wanted = {key: _wanted(mod, wanted_set) for key, mod in modules.items()}
        groups: list[LayerStats] = []
        if stackable:
            groups, served = stack_small_layers({key: (layers[key], wanted[key]) for key in modules}, n)
            modules = {key: mod for key, mod in modules.items() if key not in served}
        for key in modules:
            stats[key] = stats_for(layers[key], wanted[key], n, scale, with_squares)
        return stats, groups

    def _owners_that_ran(self, p: Tensor, layers: dict[int, LayerCalls]) -> list[tuple[nn.Module, str, str]]:
        """The owners of ``p`` whose calls were captured this step. An owner that did not run adds nothing
        (BART's ``shared`` embedding, tied to both stacks' ``embed_tokens``, is never called); a use the hooks
        missed is the first step's probe's to catch (Σ_i g_i against autograd's gradient)."""
        return [o for o in self._owners.get(p, []) if id(o[0]) in layers]

    def _representations(self, p: Tensor, owners: list[tuple[nn.Module, str, str]], stats: dict[int, LayerStats],
                         layers: dict[int, LayerCalls], n: int, scale, with_squares, wanted_set: set) -> list:
        """Each owner's per-example gradient of tied ``p`` in a form :func:`cross_term` reads; an owner
        whose rule has none (conv ghost norms, scaled layers) is materialised (its stats replaced)."""
        out = []
        for mod, _, _ in owners:
            rep = stats[id(mod)].representation(p)
            if rep is None:
                stats[id(mod)] = fallback_stats(layers[id(mod)], _wanted(mod, wanted_set), n, scale, with_squares)
                rep = stats[id(mod)].representation(p)
            out.append(rep)
        return out

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Structural problems (tied weights are served: their norms' cross terms, ghost_tied.py)."""
        return structural_problems(module)
