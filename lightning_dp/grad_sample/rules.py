"""Closed-form per-layer rules, registered by layer family (``@register_rule``), consulted by both per-layer engines.

A rule knows, for the layers it :meth:`~LayerRule.serves`, example i's gradient of their parameters from what the
capture keeps of each call (its input and the mean loss's output gradient δ):

- :meth:`~LayerRule.stats`: the ghost engine's :class:`~.layer_stats.LayerStats` (per-example squared norms, clipped
  sums on demand; ghost norms and book-keeping where the rule has them, Li et al. 2022 §4, Bu et al. 2023);
- :meth:`~LayerRule.grads`: the materialised per-example gradients ``[n, *p.shape]``, which the vmap engine takes
  instead of its per-example replay when :attr:`~LayerRule.for_vmap` (a closed form faster than the replay);
- :meth:`~LayerRule.record_grads`: one call's per-example gradients, for a rule whose layers the ghost engine reduces
  during backward (:attr:`~LayerRule.reduces`: its inputs and output gradient released as soon as it arrives);
- :meth:`~LayerRule.input_grad_only_forward`: a forward whose backward skips the weight gradients the rule supplies.

The ghost engine keeps its own if-chain for Linear, Embedding, the normalisation layers, the RNNs and attention
(:func:`~.ghost.stats_for`) and consults this registry first, in one place; a parametrized module is never served
here (its trainable tensors are the parametrization's originals). The rule modules register on first use
(:data:`RULE_MODULES`).
"""

from __future__ import annotations

import importlib
from typing import Callable, ClassVar, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls, Record
from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.layer_stats import LayerStats, MaterialisedStats
from lightning_dp.validators.layers import parametrized

RULE_MODULES: tuple[str, ...] = (
    "lightning_dp.grad_sample.conv_rules",
    "lightning_dp.grad_sample.prelu_rule",
)
"""The modules whose ``@register_rule`` classes make up the registry (imported by :func:`registered_rules`)."""

_RULES: list["LayerRule"] = []
_loaded = False


class LayerRule:
    """A layer family's closed-form per-example rule (module docstring). Subclasses implement :meth:`serves` and
    :meth:`record_grads` (materialised, per call) or :meth:`stats` (ghost norms) or both."""

    name: ClassVar[str] = ""
    reduces: ClassVar[bool] = False
    """The ghost engine folds each call into its ``[n, *p.shape]`` grads as the call's output gradient arrives."""
    for_vmap: ClassVar[bool] = True
    """The vmap engine takes :meth:`grads` instead of replaying the layer per example."""

    def serves(self, m: nn.Module) -> bool:
        """Whether ``m`` is a layer of this family, with the forward the rule was derived for."""
        raise NotImplementedError

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


def register_rule(cls: type[LayerRule]) -> type[LayerRule]:
    """Class decorator: add one instance of ``cls`` to the registry (a rule's class is registered once)."""
    if not any(type(r) is cls for r in _RULES):
        _RULES.append(cls())
    return cls


def registered_rules() -> list[LayerRule]:
    """Every registered rule (the modules of :data:`RULE_MODULES` imported on the first call)."""
    global _loaded
    if not _loaded:
        for module in RULE_MODULES:
            importlib.import_module(module)
        _loaded = True
    return list(_RULES)


def rule_for(m: nn.Module) -> Optional[LayerRule]:
    """The registered rule serving ``m``, or None (also for a parametrized module)."""
    if parametrized(m):
        return None
    return next((r for r in registered_rules() if r.serves(m)), None)
