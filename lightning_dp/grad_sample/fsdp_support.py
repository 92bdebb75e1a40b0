"""What the ghost engine cannot serve once FSDP2 shards a model: layers without a closed-form rule, parameters read
outside a leaf (:class:`~lightning_dp.sharding.fsdp_layout.FSDPLayout` asks, through the sharded strategy)."""

from __future__ import annotations

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from lightning_dp.grad_sample.capture.activations import direct_trainable, is_unit, leaf_layers
from lightning_dp.grad_sample.capture.own_tensors import is_parametrized
from lightning_dp.grad_sample.ghost import has_closed_form
from lightning_dp.sharding.fsdp_layout import layer_class


def engine_problems(module: nn.Module) -> list[str]:
    """What the ghost engine cannot serve once FSDP2 shards ``module``: layers without a closed-form rule of
    their own (the per-layer vmap fallback differentiates the registered, now sharded, parameters) and
    parameters read directly by a module with children (captured by identity, which FSDP2 swaps)."""
    problems = []
    leaves = {id(m) for _, m in leaf_layers(module)}
    for name, m in module.named_modules():
        own = direct_trainable(m)
        if not own or isinstance(m, ParametrizationList):  # (a parametrization's originals: its layer is named)
            continue
        label = f"{name or '<root>'} ({layer_class(m).__name__})"
        if id(m) not in leaves and not is_unit(m):
            problems.append(f"{label} reads its own parameter(s) {', '.join(n for n, _ in own)} directly: under "
                            "sharding move each into a leaf layer (e.g. an nn.Embedding or a Linear) or freeze it")
        elif not has_closed_form(m):
            problems.append(f"layer {label} has no closed-form per-example rule in the ghost engine (only Linear, "
                            "Conv2d, Embedding, LayerNorm/GroupNorm/RMSNorm and Hugging Face's Conv1D do): under "
                            "sharding the per-layer vmap fallback cannot run; freeze or replace it"
                            + (" (a torch.nn.utils.parametrizations weight_norm, spectral_norm or orthogonal layer is "
                               "served by DPStrategy, unsharded)" if is_parametrized(m) else ""))
    return problems
