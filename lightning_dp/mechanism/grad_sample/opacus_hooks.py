"""Per-example gradients through Opacus' backward hooks (broadest layer coverage).

Opacus' ``GradSampleHooks`` attach to the module in place (no wrapper), so the
LightningModule keeps running its own ``training_step``. The hooks leave
``p.grad_sample`` on each parameter; this engine reads it, clips, sums and clears it,
so nothing per-example outlives :meth:`OpacusHooksEngine.clip_and_sum`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError

from lightning_dp.mechanism.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_and_sum_materialised,
    register_engine,
)
from lightning_dp.mechanism.validators.example_dim import check_example_dim, check_something_captured


@register_engine
class OpacusHooksEngine(GradSampleEngine):
    """Engine ``"opacus_hooks"``: Opacus' per-layer grad samplers, materialised."""

    name = "opacus_hooks"

    def __init__(self) -> None:
        self._hooks: Optional[GradSampleHooks] = None
        self._module: Optional[nn.Module] = None
        self._watch: list = []
        self._expected: Optional[int] = None
        self._mismatched: dict[str, list[tuple[int, ...]]] = {}

    def attach(self, module: nn.Module) -> None:
        """Install Opacus' forward/backward hooks on ``module`` (mean-reduced loss), and our own
        forward hooks that verify each call (example dimension, no keyword tensors)."""
        if self._hooks is not None:
            self.detach()
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="mean", strict=False)
        self._module = module
        for name, sub in module.named_modules():
            if any(p.requires_grad for p in sub.parameters(recurse=False)):
                self._watch.append(sub.register_forward_pre_hook(self._follow_mode))
                self._watch.append(sub.register_forward_hook(self._verify_call(name or "<root>"), with_kwargs=True))

    def _follow_mode(self, module: nn.Module, args: tuple) -> None:
        """Opacus captures activations only in training mode but runs its backward hook in any mode: a
        ``validation_step`` that differentiates (eval mode) would crash it. Its hooks follow the layer's mode."""
        assert self._hooks is not None
        self._hooks.hooks_enabled = module.training

    def _verify_call(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            if not torch.is_grad_enabled():
                return
            if any(isinstance(v, Tensor) for v in kwargs.values()):
                # Opacus' hooks see positional inputs only: its backward hook would fail or be wrong
                raise PrivacyConfigurationError(
                    f"Layer '{name}' was called with keyword tensor arguments, which Opacus' hooks do not see (its "
                    "per-example gradients would be wrong): use per_sample='vmap' or 'ghost' (both bind keyword "
                    "tensors), or call the layer positionally.")
            n = self._expected
            if n is not None and isinstance(out, Tensor) and (out.dim() == 0 or out.shape[0] != n):
                self._mismatched.setdefault(name, []).append(tuple(out.shape))

        return hook

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Drop anything an earlier forward left in Opacus' hooks; verify the coming calls."""
        self._expected = num_examples
        self._mismatched.clear()
        if self._module is None:
            return
        for sub in self._module.modules():
            if hasattr(sub, "activations"):
                sub.activations = []
            if hasattr(sub, "max_batch_len"):
                del sub.max_batch_len
        for p in self._module.parameters():
            p.grad_sample = None
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
            if hasattr(p, "_current_grad_sample"):
                p._current_grad_sample = None

    def detach(self) -> None:
        """Remove the hooks and every ``grad_sample`` attribute."""
        for handle in self._watch:
            handle.remove()
        self._watch = []
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
            self._verify(samples)
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

    def _verify(self, samples: list) -> None:
        """The engine contract (base.py): example dimension n everywhere, something captured when n > 0
        (keyword tensors are refused in the forward hook)."""
        n = self._expected
        mismatched = dict(self._mismatched)
        if n is not None:
            shapes = [tuple(s.shape) for s in samples if s is not None and s.shape[0] != n]
            if shapes:
                mismatched.setdefault("(per-example gradients)", []).extend(shapes)
        check_example_dim(mismatched, n)
        check_something_captured(any(s is not None for s in samples), n)

    def unsupported_layers(self, module: nn.Module) -> list[str]:
        """Layers Opacus cannot give per-example gradients for, as 'name (Type)'."""
        problems = []
        for name, sub in module.named_modules():
            if any(p.requires_grad for p in sub.parameters(recurse=False)) and not GradSampleHooks.is_supported(sub):
                if not _functorch_can_handle(sub):
                    problems.append(f"{name or '<root>'} ({type(sub).__name__})")
        return problems


def _functorch_can_handle(module: nn.Module) -> bool:
    """Opacus falls back to torch.func for leaf modules with their own parameters, batch-first ones only
    (it slices dimension 0: an RNN's ``h_n`` is ``[L, B, H]`` whatever ``batch_first`` says)."""
    return len(list(module.children())) == 0 and not isinstance(module, nn.RNNBase)

