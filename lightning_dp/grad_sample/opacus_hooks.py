"""Per-example gradients through Opacus' backward hooks (broadest layer coverage).

Opacus' ``GradSampleHooks`` attach to the module in place (no wrapper), so the
LightningModule keeps running its own ``training_step``. The hooks leave
``p.grad_sample`` on each parameter; this engine reads it, clips, sums and clears it,
so nothing per-example outlives :meth:`OpacusHooksEngine.clip_and_sum`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.parametrize import ParametrizationList

from lightning_dp._warnings import OUTPUT_HOOK_NOTICE, output_hook_notice_quieted  # noqa: F401  (re-exported)
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.grad_sample.capture.activations import HOLDERS
from lightning_dp.grad_sample.capture.engine_hooks import EngineCallable, EngineHook

from lightning_dp.grad_sample.base import (
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    clip_and_sum_materialised,
    mean_over_views,
    register_engine,
)
from lightning_dp.validators.example_dim import check_example_dim, check_something_captured
from lightning_dp.validators.layers import parametrized

if TYPE_CHECKING:
    from opacus.grad_sample import GradSampleHooks


@register_engine
class OpacusHooksEngine(GradSampleEngine):
    """Engine ``"opacus_hooks"``: Opacus' per-layer grad samplers, materialised."""

    name = "opacus_hooks"
    supports_padding = True
    supports_views = True
    owned_attributes = frozenset({"activations", "max_batch_len", "autograd_grad_sample_hooks", "_forward_counter",
                                  "norm_sample", "grad_sample", "_current_grad_sample"})

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
        self._hooks = _grad_sample_hooks()(module, batch_first=True, loss_reduction="mean", strict=False)
        self._module = module
        _detachable(module, self._hooks)
        for name, sub in module.named_modules():
            if any(p.requires_grad for p in sub.parameters(recurse=False)):
                self._watch.append(sub.register_forward_pre_hook(EngineHook(self._follow_mode)))
                self._watch.append(sub.register_forward_hook(EngineHook(self._verify_call(name or "<root>")),
                                                             with_kwargs=True))

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
        self._expected = None if num_examples is None else num_examples * self.views_per_example
        self._mismatched.clear()
        if self._module is None:
            return
        _prepared_again(self._module)
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
            samples = mean_over_views(samples, self.views_per_example)
            return clip_and_sum_materialised(params, samples, max_grad_norm, scale, with_squares,
                                             self.padding_rows)
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
        """Layers Opacus cannot give exact per-example gradients for, as 'name (Type): why'
        (tests/grad_sample/test_engines_agree.py finds them against a per-example loop)."""
        problems = []
        for name, sub in _opacus_hooked(module):
            why = _opacus_wrong(sub)
            if why is not None and not name and not any(isinstance(m, _BatchNorm) for m in sub.modules()):
                why = _own_parameters_read_outside(sub) or why  # the root refused: the likelier reason, if it holds any
            if why is not None:
                problems.append(f"{name or '<root>'} ({type(sub).__name__}): {why}")
        return problems


def _opacus_hooked(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The modules Opacus' hooks serve (its ``iterate_submodules``): each module owning a trainable
    parameter; one without an Opacus rule is served by torch.func together with its whole subtree."""
    if any(p.requires_grad for p in module.parameters(recurse=False)):
        yield prefix, module
        if _rule_of(module) is None:
            return
    for name, child in module.named_children():
        yield from _opacus_hooked(child, f"{prefix}.{name}" if prefix else name)


def _own_parameters_read_outside(root: nn.Module) -> Optional[str]:
    """Why the model's own parameters (on the root, beside its layers) are not Opacus': no layer's forward reads them
    (a loss weight, a temperature used in ``training_step``), and Opacus sees a parameter only through a layer's
    call (its fallback would replay the whole root's forward); None for a root without layers or with a rule."""
    if _rule_of(root) is not None or next(root.children(), None) is None:
        return None
    names = [name for name, p in root.named_parameters(recurse=False) if p.requires_grad]
    return (f"holds parameters of its own ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) beside its "
            "layers, read outside any layer's forward (a loss weight such as uncertainty weighting's log-variances "
            "applied to each example's loss, a temperature, a learned token): Opacus sees a parameter only through a "
            "layer's call; served by 'ghost' and 'vmap' (per_sample='ghost'), or move them into a leaf module")


def _rule_of(module: nn.Module) -> Optional[object]:
    """Opacus' own per-example rule for this exact type (subclasses go to torch.func), or None."""
    return _grad_sample_hooks().GRAD_SAMPLERS.get(type(module))


def _opacus_wrong(module: nn.Module) -> Optional[str]:
    """Why Opacus' per-example gradients for a module it hooks would be wrong (or crash), else None."""
    if any(isinstance(m, _BatchNorm) for m in module.modules()):
        return "normalises with batch statistics: mixes examples"
    if isinstance(module, HOLDERS):
        return (f"an nn.{type(module).__name__} has no forward: Opacus' hooks never see its parameters' use by the "
                "module that reads them (x @ self.ws[i], F.linear(x, self.ws[i])); served by 'ghost' and 'vmap' "
                "(per_sample='ghost'), or keep the weight in a layer (nn.Linear)")
    if parametrized(module) or isinstance(module, ParametrizationList):
        return ("computes its weight from a parametrization (weight_norm, spectral_norm, orthogonal) or a pruning mask "
                "(torch.nn.utils.prune, ModelPruning): Opacus' rules would give the computed weight a gradient, not "
                "its originals; served by 'vmap' and 'ghost'")
    if _rule_of(module) is not None:
        return _rule_wrong(module)
    if isinstance(module, nn.RNNBase):
        return ("Opacus' torch.func fallback takes one output sliced at dimension 0 (h_n is [L, B, H]); "
                "served by 'vmap' and 'ghost'")
    if any(True for _ in module.buffers()):
        return "Opacus' torch.func fallback refuses layers with buffers"
    if _takes_more_than_one_argument(module):
        return "Opacus' torch.func fallback re-runs the layer on its first positional input only"
    return None


def _rule_wrong(module: nn.Module) -> Optional[str]:
    """Configurations Opacus' own rules ignore (found by the engine equality suite)."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.padding_mode != "zeros":
        return f"Opacus' conv rule pads with zeros, not '{module.padding_mode}'"
    if isinstance(module, nn.Embedding):
        if module.padding_idx is not None:
            return "Embedding with padding_idx: Opacus' rule gives the padding row a gradient"
        if module.scale_grad_by_freq:
            return "Embedding with scale_grad_by_freq: Opacus' rule ignores the frequency scaling"
    if isinstance(module, nn.EmbeddingBag):
        return ("Opacus' EmbeddingBag rule counts a token repeated within a bag once, and ignores padding_idx, "
                "per_sample_weights, include_last_offset and 2-D inputs; served by 'vmap' and 'ghost'")
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine and module.bias is None:
        return "LayerNorm(bias=False): Opacus' rule reads the missing bias"
    return None


def _takes_more_than_one_argument(module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts a second argument (or ``*args``/``**kwargs``): whether the call
    passed one cannot be seen statically, so any such layer is refused. Except torch's ConvTranspose, whose
    ``output_size`` only picks the output's shape (a re-run without it fails loudly, never silently)."""
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return False
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return len(params) > 1 or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _detachable(module: nn.Module, hooks: "GradSampleHooks") -> None:
    """What Opacus leaves on the model, made to pickle and copy as the user's module
    (:mod:`~lightning_dp.grad_sample.capture.engine_hooks`): its hooks as :class:`EngineHook`, the per-example function
    its torch.func fallback keeps on a layer (``ft_compute_sample_grad``, a closure) as an :class:`EngineCallable`, and
    its list of hook handles on the root taken off the model (Opacus keeps its own reference and removes the hooks from
    it; a module pickled with the list would refuse Opacus' hooks later: "Trying to add hooks twice")."""
    for handle in getattr(hooks, "autograd_grad_sample_hooks", ()):
        registered = handle.hooks_dict_ref()
        if registered is not None and handle.id in registered:
            registered[handle.id] = EngineHook(registered[handle.id])
    for sub in module.modules():
        prepared = sub.__dict__.get("ft_compute_sample_grad")
        if prepared is not None and not isinstance(prepared, EngineCallable):
            sub.__dict__["ft_compute_sample_grad"] = EngineCallable(prepared)
    module.__dict__.pop("autograd_grad_sample_hooks", None)


def _prepared_again(module: nn.Module) -> None:
    """Opacus prepares its torch.func fallback of a layer without a rule (``ft_compute_sample_grad``: a deep copy of
    the layer, a learnable-prototype model's root with its ``torch.cdist``) when it attaches, before it hooks the layer.
    A restore of the user's state by the first step's checks drops it when they took their snapshot while another
    engine was attached (``per_sample='auto'`` tries 'ghost' first): Opacus would prepare it again in the backward,
    copying the layer with its hooks, and torch's backward-hook Function fails under ``vmap`` ("must override the
    setup_context staticmethod"). Prepared again here, every hook of the layer's subtree set aside meanwhile."""
    from lightning_dp._opacus import import_opacus

    for _, sub in _opacus_hooked(module):
        if _rule_of(sub) is not None or "ft_compute_sample_grad" in sub.__dict__:
            continue
        tables = [(m, name, m.__dict__[name]) for m in sub.modules() for name in _HOOK_DICTS]
        for m, name, table in tables:
            m.__dict__[name] = type(table)()
        try:
            import_opacus("opacus.grad_sample.functorch").prepare_layer(sub, batch_first=True)
        finally:
            for m, name, table in tables:
                m.__dict__[name] = table
        sub.__dict__["ft_compute_sample_grad"] = EngineCallable(sub.__dict__["ft_compute_sample_grad"])


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _grad_sample_hooks() -> Any:
    """Opacus' ``GradSampleHooks``, imported on first use (``import lightning_dp.grad_sample`` stays Opacus-free)."""
    from lightning_dp._opacus import import_opacus  # keeps the root logger's format (see there)

    return import_opacus("opacus.grad_sample").GradSampleHooks
