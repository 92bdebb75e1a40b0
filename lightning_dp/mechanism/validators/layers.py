"""Model checks that must pass before a private step is possible.

Per-example clipping bounds one example's influence only if the example's gradient
depends on that example alone. Layers that mix examples within a batch (BatchNorm)
break that. (Layers without a per-example gradient rule are each engine's
``unsupported_layers``; ``nn.MultiheadAttention`` and the RNNs are served by ``vmap``/``ghost``.)
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

def batch_mixing_layers(module: nn.Module) -> list[str]:
    """Error messages for layers whose output for one example depends on the others."""
    errors = []
    for name, sub in module.named_modules():
        if isinstance(sub, _BatchNorm):
            errors.append(
                f"layer '{name}' ({type(sub).__name__}) normalises with batch statistics, so one example "
                f"changes every other example's gradient and per-example clipping no longer bounds it. "
                f"Replace it with nn.GroupNorm(num_groups, {sub.num_features}) (or LayerNorm); "
                "opacus.validators.ModuleValidator.fix(model) does this automatically."
            )
    return errors


def validate_module(module: nn.Module) -> list[str]:
    """All problems that prevent private training of ``module`` (empty list if none)."""
    return batch_mixing_layers(module)
