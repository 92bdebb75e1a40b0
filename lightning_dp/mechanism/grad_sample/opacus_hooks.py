"""Per-example gradients through Opacus' backward hooks (broadest layer coverage).

Opacus' ``GradSampleHooks`` attach to the module in place (no wrapper), so the
LightningModule keeps running its own ``training_step``. The hooks leave
``p.grad_sample`` on each parameter; this engine reads it, clips, sums and clears it,
so nothing per-example outlives :meth:`OpacusHooksEngine.clip_and_sum`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from opacus.grad_sample import GradSampleHooks
from torch import nn

from lightning_dp.mechanism.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_and_sum_materialised,
    register_engine,
)


@register_engine
class OpacusHooksEngine(GradSampleEngine):
    """Engine ``"opacus_hooks"``: Opacus' per-layer grad samplers, materialised."""

    name = "opacus_hooks"

    def __init__(self) -> None:
        self._hooks: Optional[GradSampleHooks] = None
        self._module: Optional[nn.Module] = None

    def attach(self, module: nn.Module) -> None:
        """Install Opacus' forward/backward hooks on ``module`` (mean-reduced loss)."""
        if self._hooks is not None:
            self.detach()
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="mean", strict=False)
        self._module = module

    def detach(self) -> None:
        """Remove the hooks and every ``grad_sample`` attribute."""
        if self._hooks is not None:
            self._hooks.remove_hooks()
            for p in self._module.parameters():  # type: ignore[union-attr]
                for attr in ("grad_sample", "_forward_counter", "_current_grad_sample"):
                    if hasattr(p, attr):
                        delattr(p, attr)
        self._hooks = None
        self._module = None

    def clip_and_sum(
        self,
        params: Sequence[nn.Parameter],
        max_grad_norm: float,
        scale: Optional[ParamMap] = None,
        with_squares: bool = False,
    ) -> ClippedBatch:
        """Clip Opacus' ``grad_sample`` per example and sum (then clear it)."""
        samples = [getattr(p, "grad_sample", None) for p in params]
        try:
            present = [s is not None for s in samples]
            if not any(present):
                samples = [p.new_zeros((0, *p.shape)) for p in params]
            elif not all(present):
                missing = [tuple(p.shape) for p, s in zip(params, samples) if s is None]
                raise RuntimeError(
                    f"No per-example gradient for trainable parameters of shapes {missing}. They are used "
                    "outside a layer with a registered grad sampler (e.g. a bare nn.Parameter in the "
                    "LightningModule) or not used in the loss. Freeze them (requires_grad=False) or move them "
                    "into a supported layer."
                )
            return clip_and_sum_materialised(params, samples, max_grad_norm, scale, with_squares)
        finally:
            for p in params:
                p.grad_sample = None

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Layers Opacus cannot give per-example gradients for, as 'name (Type)'."""
        problems = []
        for name, sub in module.named_modules():
            if any(p.requires_grad for p in sub.parameters(recurse=False)) and not GradSampleHooks.is_supported(sub):
                if not _functorch_can_handle(sub):
                    problems.append(f"{name or '<root>'} ({type(sub).__name__})")
        return problems


def _functorch_can_handle(module: nn.Module) -> bool:
    """Opacus falls back to torch.func for leaf modules with their own parameters."""
    return len(list(module.children())) == 0

