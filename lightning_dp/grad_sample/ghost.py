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

Per layer, the cheaper of the ghost norm and materialising G_i is chosen. Each layer family's rule is a registered
:class:`~.rules.LayerRule` in a file of its own, consulted in one place each (:func:`stats_for`,
:func:`reducer_for`, :func:`input_grad_only_forward`, :func:`has_closed_form`; precedence: :mod:`.rules`):
Linear and Hugging Face's Conv1D (:mod:`.linear_rule`), Embedding (:mod:`.embedding_rule`), LayerNorm, GroupNorm
and RMSNorm (:mod:`.norm_rule`), convolutions of any dimension, plain and transposed (:mod:`.conv_rules`), PReLU
(:mod:`.prelu_rule`), torch's RNNs (:mod:`.recurrent_rule`), self-attention's projections
(:mod:`.attention_projections`) and layers verified as w ⊙ y + b (:mod:`.elementwise_scale`); any other leaf layer
with parameters, and every parametrized one, falls back to the per-layer vmap of :mod:`.functorch_vmap`.

Memory: book-keeping holds each Linear/Conv/Embedding layer's input and output gradient until
the clipped sums are taken. Normalisation layers are reduced to their [n, C] per-example grads
as soon as their output gradient arrives (:func:`reducer_for`), releasing input and output
gradient during backward (PReLU too); conv patch columns are unfolded a few examples at a time
(:func:`~.conv_rules.example_chunks`), never more than the layer's input in size.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_dp._lazy import lazy_exports
from lightning_dp.grad_sample.capture.engine_hooks import ReplacedForward, is_own_forward
from lightning_dp.grad_sample.capture.example_dims import time_major_layers
from lightning_dp.grad_sample.capture.own_tensors import is_parametrized, own_trainable
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.clipping.rule import ClipRule, as_rule
from lightning_dp.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_from_parts,
    sums_finite,
    register_engine,
)
from lightning_dp.grad_sample.ghost_units import unit_sq_norms
from lightning_dp.grad_sample.capture.activations import (
    ActivationCapture,
    LayerCalls,
    RecordReducer,
    direct_trainable,
    leaf_layers,
    owners_of,
)
from lightning_dp.grad_sample.dense_pool import DenseGrads, DenseMember
from lightning_dp.grad_sample.layer_groups import stack_small_layers
from lightning_dp.grad_sample.layer_stats import LayerStats, MaterialisedStats, UnusedStats
from lightning_dp.grad_sample.ghost_tied import cross_term, dense
from lightning_dp.grad_sample.functorch_vmap import (
    missing_message,
    step_batch_size,
    structural_problems,
    unused_in_step,
    vmap_layer_grads,
)
from lightning_dp.grad_sample.rules import LayerRule, rule_for, rule_for_calls
from lightning_dp.grad_sample.streamed_sums import StreamedSums
from lightning_dp.validators.example_dim import hidden_use_error


def _wanted(module: nn.Module, params: set[int]) -> dict[str, Tensor]:
    """``module``'s trainable parameters among ``params`` (their ``id``s: a tensor's hash is a Python call)."""
    return {n: p for n, p in direct_trainable(module) if id(p) in params}


def reducer_for(m: nn.Module) -> Optional[RecordReducer]:
    """The layers the ghost engine reduces during backward: those of a registered rule that reduces (the
    normalisation layers, PReLU)."""
    rule = rule_for(m)  # never a parametrized module
    return (lambda rec: rule.record_grads(m, rec)) if rule is not None and rule.reduces else None


def fallback_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Any other leaf layer: per-layer vmap (materialised)."""
    named = [(k, p) for k, p in wanted.items()]
    grads = vmap_layer_grads(calls, named, n)
    return MaterialisedStats({p: grads[k] for k, p in named}, scale)


def stats_for(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Dispatch one layer to the first registered rule serving its calls (:mod:`.rules`, in their precedence) or the
    vmap fallback."""
    if is_parametrized(calls.module):  # weights computed from originals: the layer replayed per example on them
        return fallback_stats(calls, wanted, n, scale, with_squares)
    rule = rule_for_calls(calls)
    if rule is not None:
        return rule.stats(calls, wanted, n, scale, with_squares)
    return fallback_stats(calls, wanted, n, scale, with_squares)


def served_by_class(m: nn.Module) -> bool:
    """Whether the rule :func:`stats_for` takes for ``m`` is decided by the layer alone, whatever its calls: the first
    registered rule serving it (:func:`~.rules.rule_for`) does not read the calls (its
    :meth:`~.rules.LayerRule.serves_calls` is the default). The capture then skips verifying its calls as w ⊙ y + b,
    which only the elementwise-scale rule, last in the precedence, would read (were it skipped for a layer that rule
    would have served, the layer would be replayed per example: the same gradients, slower)."""
    rule = rule_for(m)  # None for a parametrized module
    return rule is not None and type(rule).serves_calls is LayerRule.serves_calls


def has_closed_form(m: nn.Module) -> bool:
    """Whether :func:`stats_for` serves ``m`` by a rule of its own (not the per-layer vmap fallback, which
    differentiates the layer's registered parameters again: not possible when FSDP2 shards them): the registered
    rule serving it says so (:meth:`~.rules.LayerRule.closed_form`)."""
    rule = rule_for(m)  # never a parametrized module
    return rule is not None and rule.closed_form(m)


def input_grad_only_forward(m: nn.Module):
    """The book-keeping forward for ``m`` (Linear, torch's convolutions, PReLU and RNNs: the registered rule serving
    it), or None (also for a parametrized module: its weight's gradient must reach the originals)."""
    rule = rule_for(m)  # never a parametrized module
    return rule.input_grad_only_forward(m) if rule is not None else None


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
        self._owners_by_id: dict[int, list] = {}  # the same by id(p), read every step (a tensor's hash is Python)
        self._patched: list[nn.Module] = []
        self._left_out: Optional[Tensor] = None  # clip_and_sum's second pass: examples whose gradient was not finite

    def attach(self, module: nn.Module) -> None:
        """Hook every leaf module that owns parameters (and patch Linear/convolution forwards, see class doc)."""
        self.detach()
        self._owners = owners_of(module)
        self._owners_by_id = {id(p): owners for p, owners in self._owners.items()}
        leaves = leaf_layers(module)
        self._capture.attach(leaves, reducer_for, frozenset(time_major_layers(module)), root=module,
                             scale_checked=lambda m: not served_by_class(m))
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
        self._owners_by_id = {}

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
                batch = self._clip_and_sum(params, max_grad_norm, scale, with_squares)
                if sums_finite(batch, params):
                    return batch
                # an example's inf/NaN reached the contractions (0·inf): again on finite captures, without it
                self._capture.make_finite()
                self._left_out = ~torch.isfinite(batch.norms)
                again = self._clip_and_sum(params, max_grad_norm, scale, with_squares)
                return ClippedBatch(again.sums, again.square_sums,
                                    torch.where(self._left_out, batch.norms, again.norms), again.batch_size)
        finally:
            self._left_out = None
            self._capture.clear()

    def _without_left_out(self, factors: Tensor, rule: ClipRule, n: int) -> Tensor:
        """``factors`` ``[n]`` (``[P, n]``) with 0 for the examples (units) :meth:`clip_and_sum` leaves out: those
        whose gradient was not finite before the captures were made finite (they add nothing, as on every engine)."""
        if self._left_out is None:
            return factors
        rows = self._left_out if rule.groups is None else self._left_out[rule.groups.to(factors.device)]
        rows = torch.cat([rows, rows.new_zeros(n - rows.shape[0])])  # padding rows: 0 already
        return torch.where(rows, torch.zeros((), dtype=factors.dtype, device=factors.device), factors)

    def _clip_and_sum(self, params, max_grad_norm, scale, with_squares) -> ClippedBatch:
        rule = as_rule(max_grad_norm)
        layers = self._capture.completed()
        n = step_batch_size(self._capture, layers)
        if n == 0:
            zeros = {p: torch.zeros_like(p) for p in params}
            sq = {p: torch.zeros_like(p) for p in params} if with_squares else None
            return ClippedBatch(zeros, sq, torch.zeros(0, device=params[0].device if params else None), 0)
        ran = {p: self._owners_that_ran(p, layers) for p in params}
        self._check_hidden_uses(layers)
        shared = [p for p in params if len(ran[p]) > 1 and not self._capture.roots.owns(p)]
        whole = not (rule.per_parameter or rule.grouped)  # one factor per example from its whole norm
        stackable = whole and scale is None and not with_squares and not self.stream_sums and not shared
        stats, groups = self._layer_stats(params, layers, n, scale, with_squares, ran, stackable)
        if not whole:  # per-parameter norms or units' norms: every layer's own stats (never stacked)
            return self._clip_by_rule(params, rule, stats, ran, shared, layers, n, scale, with_squares)
        reps = {p: self._representations(p, ran[p], stats, layers, n, scale, with_squares, {id(q) for q in params})
                for p in shared}
        parts = [st.sq_norms for st in [*stats.values(), *groups]]
        for p, rs in reps.items():  # tied weights: ‖Σ_A G^A‖² = Σ_A ‖G^A‖² + 2 Σ_{A<B} ⟨G^A, G^B⟩ (ghost_tied.py)
            parts += [2 * cross_term(a, b, p.shape[0]) for j, a in enumerate(rs) for b in rs[j + 1:]]
        pad = self.padding_rows
        norms, c = clip_from_parts(parts, rule, pad)  # summed over layers in float64; the policy's factors; padding: 0
        c = self._without_left_out(c, rule, n)
        if self.stream_sums and not with_squares:
            keys = {p: [id(p)] if id(p) in stats else list(dict.fromkeys(id(mod) for mod, _, _ in ran[p]))
                    for p in params}  # stats by parameter: root-owned and unused ones
            return ClippedBatch(StreamedSums(params, stats, keys, c), None,  # type: ignore[arg-type]
                                norms[:n - pad].detach(), n - pad)
        sums: dict[int, Tensor] = {}  # by id(p): a tensor's hash is a Python call
        squares: Optional[dict[Tensor, Tensor]] = {} if with_squares else None
        for st in [*stats.values(), *groups]:
            for p, v in st.sums(c).items():  # a tied weight gets every owner's contraction
                key = id(p)
                sums[key] = sums[key] + v if key in sums else v
            if squares is not None:
                squares.update(st.squares(c * c))
        if squares is not None:  # squares do not add over owners: (Σ_A G^A)² from the materialised total
            for p, rs in reps.items():
                total = sum(dense(r, p.shape[0]) for r in rs)
                squares[p] = torch.tensordot(c * c, total * total, dims=1).reshape(p.shape)
        return ClippedBatch({p: sums[id(p)] for p in params},
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
        f = self._without_left_out(f, rule, n)
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
        wanted = {id(q) for q in params}
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
        units, wanted = rule.num_units(), {id(q) for q in params}
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
        wanted_set = {id(q) for q in params}
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
        if not stackable:
            for key in modules:
                stats[key] = stats_for(layers[key], wanted[key], n, scale, with_squares)
            return stats, groups
        groups, served = stack_small_layers({key: (layers[key], wanted[key]) for key in modules}, n)
        pooled: list[DenseMember] = []  # the others' per-example gradients held whole: one pass for all (dense_pool)
        for key in modules:
            if key in served:
                continue
            calls = layers[key]
            rule = None if is_parametrized(calls.module) else rule_for_calls(calls)  # stats_for's dispatch
            whole = None if rule is None else rule.dense(calls, wanted[key], n)
            if whole is not None:
                pooled.extend(whole)
            elif rule is not None:
                stats[key] = rule.stats(calls, wanted[key], n, scale, with_squares)
            else:
                stats[key] = fallback_stats(calls, wanted[key], n, scale, with_squares)
        if pooled:
            groups = [*groups, DenseGrads(pooled, n)]  # a new list (stack_small_layers keeps its own)
        return stats, groups

    def _check_hidden_uses(self, layers: dict[int, LayerCalls]) -> None:
        """A layer whose forward was replaced (it fills no ``p.grad``) ran this step, yet autograd gave its parameter
        a gradient: a use no hook saw (an L2 penalty over ``module.parameters()``), which the per-example gradients
        would leave out. Exact, whatever the penalty's size (the probe's comparison misses a small one)."""
        for m in self._patched:
            if id(m) not in layers:
                continue
            for name, p in own_trainable(m):  # named_parameters(recurse=False) of a patched (plain) layer
                if not unused_in_step(p):
                    owners = self._owners.get(p, [])
                    raise hidden_use_error(", ".join(f"{o or '<root>'}.{a}" for _, o, a in owners) or name)

    def _owners_that_ran(self, p: Tensor, layers: dict[int, LayerCalls]) -> list[tuple[nn.Module, str, str]]:
        """The owners of ``p`` whose calls were captured this step. An owner that did not run adds nothing
        (BART's ``shared`` embedding, tied to both stacks' ``embed_tokens``, is never called); a use the hooks
        missed is the first step's probe's to catch (Σ_i g_i against autograd's gradient)."""
        return [o for o in self._owners_by_id.get(id(p), ()) if id(o[0]) in layers]

    def _representations(self, p: Tensor, owners: list[tuple[nn.Module, str, str]], stats: dict[int, LayerStats],
                         layers: dict[int, LayerCalls], n: int, scale, with_squares, wanted_set: set[int]) -> list:
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


__getattr__ = lazy_exports(__name__, {
    "Dense": "lightning_dp.grad_sample.ghost_tied", "EmbeddingStats": "lightning_dp.grad_sample.embedding_rule",
    "LinearFormStats": "lightning_dp.grad_sample.linear_rule", "Lookup": "lightning_dp.grad_sample.ghost_tied",
    "LowRank": "lightning_dp.grad_sample.ghost_tied", "Record": "lightning_dp.grad_sample.capture.activations",
    "Representation": "lightning_dp.grad_sample.ghost_tied",
    "WeightBiasStats": "lightning_dp.grad_sample.layer_stats",
    "_LinearInputGradOnly": "lightning_dp.grad_sample.linear_rule", "_NORMS": "lightning_dp.grad_sample.norm_rule",
    "_as_float": "lightning_dp.grad_sample.conv_rules", "_cat": "lightning_dp.grad_sample.linear_rule",
    "_linear_forward": "lightning_dp.grad_sample.linear_rule",
    "_rnn_forward": "lightning_dp.grad_sample.recurrent_rule",
    "bookkept_product": "lightning_dp.grad_sample.layer_stats",
    "embedding_stats": "lightning_dp.grad_sample.embedding_rule",
    "form_stats": "lightning_dp.grad_sample.linear_forms", "gram_sq_norms": "lightning_dp.grad_sample.layer_stats",
    "hf_conv1d_stats": "lightning_dp.grad_sample.linear_rule", "is_hf_conv1d": "lightning_dp.grad_sample.linear_rule",
    "is_plain_norm": "lightning_dp.grad_sample.norm_rule", "linear_stats": "lightning_dp.grad_sample.linear_rule",
    "norm_layer_record_grads": "lightning_dp.grad_sample.norm_rule",
    "prefer_ghost": "lightning_dp.grad_sample.layer_stats",
    "prefer_ghost_embedding": "lightning_dp.grad_sample.embedding_rule",
    "projection_forms": "lightning_dp.grad_sample.attention_projections",
    "recurrent_served": "lightning_dp.grad_sample.recurrent_rule",
    "recurrent_stats": "lightning_dp.grad_sample.recurrent_rule",
    "scale_layer_grads": "lightning_dp.grad_sample.elementwise_scale",
    "scale_served": "lightning_dp.grad_sample.elementwise_scale",
    "sharding_served": "lightning_dp.grad_sample.conv_rules", "sq_norms": "lightning_dp.grad_sample.layer_stats",
    "taped_forward": "lightning_dp.grad_sample.recurrent_forward"
})
"""Names this module held before they moved (read access by the old name; new code imports their homes)."""
