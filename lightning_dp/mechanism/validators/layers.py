"""Model checks that must pass before a private step is possible.

Per-example clipping bounds one example's influence only if the example's gradient
depends on that example alone, and the noise covers everything released only if the
forward writes nothing from the data into the model. Layers that mix examples within a
batch (BatchNorm) break the first; layers that update their own weights or buffers from
the batch (Embedding(max_norm), running statistics) break the second. (Layers without a per-example gradient rule are each engine's
``unsupported_layers``; ``nn.MultiheadAttention`` and the RNNs are served by ``vmap``/``ghost``.)
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

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


def unnoised_state_layers(module: nn.Module) -> list[str]:
    """Error messages for layers whose forward writes data-dependent state that the noise never covers
    (the released weights or buffers would reveal the batch). The first step's probe also catches any
    such write at run time (:func:`~lightning_dp.mechanism.validators.probe.state_fingerprint`)."""
    errors = []
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None:
            errors.append(
                f"layer '{name}' ({type(sub).__name__}(max_norm={sub.max_norm})) renormalises, in place and outside "
                "the gradient, the rows each batch looks up: the released weights would show which tokens were "
                "sampled. Use max_norm=None (normalise in the forward instead, e.g. F.normalize(emb(x), dim=-1)).")
        if isinstance(sub, _InstanceNorm) and sub.track_running_stats:
            errors.append(
                f"layer '{name}' ({type(sub).__name__}) tracks running statistics of the training batches in its "
                "buffers, released with the model without noise. Use track_running_stats=False (instance "
                "statistics in training and evaluation).")
    return errors


def parametrized_layers(module: nn.Module) -> list[str]:
    """Error messages for layers whose weights are computed by ``torch.nn.utils.parametrize`` (weight_norm,
    spectral_norm, orthogonal): the trainable tensors are the parametrization's originals, which no engine
    differentiates per example yet."""
    return [
        f"layer '{name}' ({type(sub).__name__}) has parametrized tensors {sorted(sub.parametrizations.keys())} "
        "(torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal, ...): no per-example engine "
        "differentiates through a parametrization yet. Remove it (torch.nn.utils.parametrize."
        "remove_parametrizations(layer, name)), or normalise in the forward instead."
        for name, sub in module.named_modules() if parametrize.is_parametrized(sub)
    ]


def validate_module(module: nn.Module) -> list[str]:
    """All problems that prevent private training of ``module`` (empty list if none)."""
    return batch_mixing_layers(module) + unnoised_state_layers(module) + parametrized_layers(module)
