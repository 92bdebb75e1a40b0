"""Closed-form per-layer rules, registered by layer family (``@register_rule``), consulted by both per-layer engines.

A rule knows, for the layers it :meth:`~LayerRule.serves`, example i's gradient of their parameters from what the
capture keeps of each call (its input and the mean loss's output gradient δ):

- :meth:`~LayerRule.stats`: the ghost engine's :class:`~.layer_stats.LayerStats` (per-example squared norms, clipped
  sums on demand; ghost norms and book-keeping where the rule has them, Li et al. 2022 §4, Bu et al. 2023);
- :meth:`~LayerRule.grads`: the materialised per-example gradients ``[n, *p.shape]``, which the vmap engine takes
  instead of its per-example replay when :attr:`~LayerRule.for_vmap` (a closed form faster than the replay; under the
  calls' autocast when :attr:`~LayerRule.vmap_autocast`);
- :meth:`~LayerRule.record_grads`: one call's per-example gradients, for a rule whose layers the ghost engine reduces
  during backward (:attr:`~LayerRule.reduces`: its inputs and output gradient released as soon as it arrives);
- :meth:`~LayerRule.input_grad_only_forward`: a forward whose backward skips the weight gradients the rule supplies;
- :meth:`~LayerRule.dense`: the per-example gradients held whole where the rule forms them so anyway (the ghost
  engine clips several such layers in one pass, :mod:`.dense_pool`);
- :meth:`~LayerRule.serves_calls`: whether the rule serves the step's calls of a layer (by default: whether it serves
  the layer), for a family recognised also from how each call ran (an RNN's calls the unrolled rule covers,
  attention's projections found in autograd's record, an output verified as w ⊙ y + b);
- :meth:`~LayerRule.closed_form`: whether the ghost engine serves the layer without differentiating its registered
  parameters again (what FSDP2 needs of a layer whose parameters it shards: :func:`~.ghost.has_closed_form`).

Every per-layer decision of the engines reads this registry, in one place each: the ghost engine's stats
(:func:`~.ghost.stats_for`), its reductions during backward (:func:`~.ghost.reducer_for`), its book-keeping
forwards (:func:`~.ghost.input_grad_only_forward`) and what FSDP2 may shard (:func:`~.ghost.has_closed_form`); the
vmap engine's per-layer grads (:func:`~.functorch_vmap.vmap_layer_grads`, the rules with :attr:`~LayerRule.for_vmap`
only). A parametrized module is never served here (its trainable tensors are the parametrization's originals): both
engines replay it. A layer no rule serves is replayed per example (the per-layer vmap of :mod:`.functorch_vmap`).

**Precedence.** The first rule that serves a layer wins: rules are ordered by their module's place in
:data:`RULE_MODULES`, and within one module by registration (a rule registered from a module not listed there, a
test's or a user's, comes after the listed ones, in the order registered):

1. ``conv_rules``: ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and subclasses keeping torch's forward;
2. ``prelu_rule``: ``nn.PReLU`` (reduced during backward);
3. ``linear_rule``: ``nn.Linear`` (the class itself) and Hugging Face's ``Conv1D``;
4. ``embedding_rule``: ``nn.Embedding`` (the class itself, without ``scale_grad_by_freq``);
5. ``embedding_bag_rule``: ``nn.EmbeddingBag`` (the class itself) in mode sum or mean, on 2-D inputs or 1-D inputs
   with offsets;
6. ``norm_rule``: ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` with torch's forward (reduced during backward);
7. ``recurrent_rule``: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` whose calls the unrolled rule covers;
8. ``attention_projections``: ``nn.MultiheadAttention`` calls whose two projections were read from autograd's record;
9. ``elementwise_scale``: any layer whose every call was verified as w ⊙ y + b.

That is the order in which the ghost engine tried them before the registry (the registered convolutions and PReLU
first, then its own if-chain). The families are disjoint in practice (a layer of 1–8 is never verified as w ⊙ y + b,
except ``nn.RMSNorm``, whose torch forward is one multiplication by its weight: the norm rule serves it on ``ghost``).
The vmap engine consults only the rules with :attr:`~LayerRule.for_vmap`, in the same order (1, 2, 5, 7, 8, 9:
``nn.RMSNorm`` there takes the elementwise-scale rule, as before the registry; Linear, Embedding and the plain norm
layers are replayed). The rule modules register on first use (:func:`registered_rules`).
"""

from __future__ import annotations

import importlib
from typing import Callable, ClassVar, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls, Record
from lightning_dp.grad_sample.capture.own_tensors import is_parametrized
from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.layer_stats import LayerStats, MaterialisedStats
from lightning_dp.records.library_code import library_type

RULE_MODULES: tuple[str, ...] = (
    "lightning_dp.grad_sample.conv_rules",
    "lightning_dp.grad_sample.prelu_rule",
    "lightning_dp.grad_sample.linear_rule",
    "lightning_dp.grad_sample.embedding_rule",
    "lightning_dp.grad_sample.embedding_bag_rule",
    "lightning_dp.grad_sample.norm_rule",
    "lightning_dp.grad_sample.recurrent_rule",
    "lightning_dp.grad_sample.attention_projections",
    "lightning_dp.grad_sample.elementwise_scale",
)
"""The modules whose ``@register_rule`` classes make up the registry, in the order of precedence (module docstring;
imported by :func:`registered_rules`). A new layer family adds its rule file here."""

_RULES: list["LayerRule"] = []
_loaded = False


class LayerRule:
    """A layer family's closed-form per-example rule (module docstring). Subclasses implement :meth:`serves` and
    :meth:`record_grads` (materialised, per call) or :meth:`grads` or :meth:`stats` (ghost norms), or several."""

    name: ClassVar[str] = ""
    reduces: ClassVar[bool] = False
    """The ghost engine folds each call into its ``[n, *p.shape]`` grads as the call's output gradient arrives."""
    for_vmap: ClassVar[bool] = True
    """The vmap engine takes :meth:`grads` instead of replaying the layer per example (False: the rule serves the
    ghost engine only, and the vmap engine passes on to the next rule, or replays the layer)."""
    vmap_autocast: ClassVar[bool] = False
    """The vmap engine calls :meth:`grads` under the autocast the layer's calls ran under (``bf16-mixed``), as it
    runs its replay; by default in the weights' precision."""

    def serves(self, m: nn.Module) -> bool:
        """Whether ``m`` is a layer of this family, with the forward the rule was derived for (read when the engine
        attaches: :attr:`reduces`, :meth:`input_grad_only_forward`, :meth:`closed_form`)."""
        raise NotImplementedError

    def serves_calls(self, calls: LayerCalls) -> bool:
        """Whether the rule serves this step's calls of ``calls.module`` (read at the clipping, where :meth:`stats`
        or :meth:`grads` would be called). By default: whether it :meth:`serves` the layer. A family recognised
        from how each call ran overrides it (False: the next rule is asked, then the layer is replayed)."""
        return self.serves(calls.module)

    def closed_form(self, m: nn.Module) -> bool:
        """Whether the ghost engine serves ``m`` without differentiating its registered parameters again, so that
        FSDP2 may shard them (:func:`~.ghost.has_closed_form`); by default not (the layer keeps being refused under
        sharding until its rule is tested there)."""
        return False

    def record_grads(self, m: nn.Module, rec: Record) -> dict[str, Tensor]:
        """One call's per-example grads ``{parameter name: [n, *shape]}`` of ``m``'s trainable parameters."""
        raise NotImplementedError

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """Per-example grads of ``wanted``, summed over the layer's calls (and those already reduced); zeros for a
        parameter no gradient reached."""
        total = dict(calls.reduced)
        with torch.no_grad():
            for rec in calls.records:
                for key, g in self.record_grads(calls.module, rec).items():
                    total[key] = total[key] + g if key in total else g
        return {key: total[key] if key in total else p.new_zeros(n, *p.shape) for key, p in wanted}

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """The ghost engine's stats: by default the materialised :meth:`grads`."""
        grads = self.grads(calls, list(wanted.items()), n)
        return MaterialisedStats({p: grads[key] for key, p in wanted.items()}, scale)

    def input_grad_only_forward(self, m: nn.Module) -> Optional[Callable]:
        """A forward for ``m`` whose backward computes only the input gradient (None: keep the module's own)."""
        return None

    def dense(self, calls: LayerCalls, wanted: dict[str, Tensor],
              n: int) -> Optional[list[tuple[Tensor, Tensor, float]]]:
        """The layer's per-example gradients held whole, when the rule has them so for every wanted parameter (the
        ghost engine pools them, :mod:`.dense_pool`): ``(p, g [n, *p.shape], k)`` with example i's gradient k·g[i];
        None (the default) where its :meth:`stats` are another form (ghost norms, book-keeping)."""
        return None


def _rank(rule: LayerRule) -> int:
    """A rule's place in the precedence: its module's in :data:`RULE_MODULES`, after all of them if not listed."""
    module = type(rule).__module__ if library_type(type(rule)) else None  # a user's rule claiming a place: last
    return RULE_MODULES.index(module) if module in RULE_MODULES else len(RULE_MODULES)


def register_rule(cls: type[LayerRule]) -> type[LayerRule]:
    """Class decorator: add one instance of ``cls`` to the registry (a rule's class is registered once), at its
    place in the precedence (module docstring): a rule module imported before the others keeps its place."""
    if not any(type(r) is cls for r in _RULES):
        _RULES.append(cls())
        _RULES.sort(key=_rank)  # stable: registration order within a module, and among unlisted modules
    return cls


def registered_rules() -> list[LayerRule]:
    """Every registered rule, in the order of precedence (the modules of :data:`RULE_MODULES` imported on the first
    call)."""
    global _loaded
    if not _loaded:
        for module in RULE_MODULES:
            importlib.import_module(module)
        _loaded = True
    return list(_RULES)


def rule_for(m: nn.Module) -> Optional[LayerRule]:
    """The first registered rule serving ``m`` (:meth:`LayerRule.serves`), or None (also for a parametrized
    module)."""
    if is_parametrized(m):
        return None
    return next((r for r in registered_rules() if r.serves(m)), None)


def rule_for_calls(calls: LayerCalls, for_vmap: bool = False) -> Optional[LayerRule]:
    """The first registered rule serving the step's calls of ``calls.module`` (:meth:`LayerRule.serves_calls`),
    among those with :attr:`~LayerRule.for_vmap` when ``for_vmap``; None for a parametrized module."""
    if is_parametrized(calls.module):
        return None
    return next((r for r in registered_rules() if (r.for_vmap or not for_vmap) and r.serves_calls(calls)), None)
