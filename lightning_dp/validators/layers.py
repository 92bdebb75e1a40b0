"""Model checks that must pass before a private step is possible.

Per-example clipping bounds one example's influence only if the example's gradient
depends on that example alone, and the noise covers everything released only if the
forward writes nothing from the data into the model. Layers that mix examples within a
batch (BatchNorm in training mode, ``scale_grad_by_freq``) break the first; layers that update their own weights
or buffers from the batch (Embedding(max_norm), running statistics) break the second. (Layers without a
per-example gradient rule are each engine's ``unsupported_layers``; ``nn.MultiheadAttention`` and the RNNs are
served by ``vmap``/``ghost``.)

Most checks are static (:func:`validate_module`, before training). Two depend on how a layer is *called*, so
:func:`install_call_checks` (run by :func:`validate_module`) puts a forward pre-hook on those layers, active while
the model is attached to a private step, that refuses the call before it runs:

- a BatchNorm running in training mode (any ``model.train()`` call, by the user's code or by Lightning before 2.2
  at the start of fit, switches a frozen BatchNorm back to batch statistics): :func:`batchnorm_training_error`;
- an ``nn.EmbeddingBag(mode="max")`` called on a flat 1-D input with ``offsets``: :func:`embedding_bag_offsets_error`
  (modes sum and mean are served there);
- Opacus' ``DPLSTM``/``DPGRU``/``DPRNN`` called on a ``PackedSequence``: :func:`opacus_packed_error` (torch's own RNN,
  which is served there, is named).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.rnn import PackedSequence
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_dp.errors import PrivacyConfigurationError


def batch_mixing_layers(module: nn.Module) -> list[str]:
    """Error messages for layers whose output or gradient for one example depends on the others whatever their
    mode. (A BatchNorm with running statistics mixes examples only in training mode: refused when it runs so,
    by :func:`install_call_checks`.)"""
    errors = []
    for name, sub in module.named_modules():
        if isinstance(sub, _BatchNorm) and (not sub.track_running_stats or sub.running_mean is None
                                            or sub.running_var is None):
            errors.append(
                f"layer '{name}' ({type(sub).__name__}(track_running_stats=False)) normalises with batch statistics "
                f"in training and in eval mode, so one example changes every other example's gradient and "
                f"per-example clipping no longer bounds it. Replace it with nn.GroupNorm(num_groups, "
                f"{sub.num_features}) (or LayerNorm); opacus.validators.ModuleValidator.fix(model) does this "
                "automatically.")
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.scale_grad_by_freq:
            errors.append(
                f"layer '{name}' ({type(sub).__name__}(scale_grad_by_freq=True)) divides each row's gradient by "
                "how often its index occurs in the whole batch, so one example's tokens scale every other "
                "example's gradient and per-example clipping no longer bounds it. Use scale_grad_by_freq=False.")
    return errors


def sparse_gradient_layers(module: nn.Module) -> list[str]:
    """Error messages for layers that produce sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): the private step clips dense per-example gradients and releases a dense sum,
    noise on every coordinate of every row (a row no example looked up gets noise too, or the release would show
    which rows were sampled), so a sparse gradient has nothing to gain and the checks that compare gradients cannot
    read one."""
    errors = []
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            errors.append(
                f"layer '{name}' ({type(sub).__name__}(sparse=True)) produces sparse gradients, which the private "
                "step does not support: the released gradient is dense anyway (noise is added to every coordinate "
                "of every row, looked up or not, or the release would show which rows the batch used). Use "
                f"{type(sub).__name__}(..., sparse=False) and a dense optimizer (torch.optim.Adam or SGD instead of "
                "torch.optim.SparseAdam).")
    return errors


def sparse_optimizer_error(optimizer: Any, module: Optional[nn.Module] = None) -> Optional[PrivacyConfigurationError]:
    """The refusal of ``torch.optim.SparseAdam`` (None for any other optimizer): it takes sparse gradients only, and
    the private step releases dense ones (:func:`sparse_gradient_layers`), naming ``module``'s sparse layers."""
    if not isinstance(optimizer, torch.optim.SparseAdam):
        return None
    layers = [f"'{name}' ({type(sub).__name__}(sparse=True))" for name, sub in
              (module.named_modules() if module is not None else ())
              if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse]
    named = f" (layer {', '.join(layers)})" if layers else ""
    return PrivacyConfigurationError(
        f"torch.optim.SparseAdam takes sparse gradients only{named}, and the private step does not support sparse "
        "gradients: the gradient it releases is dense (noise is added to every coordinate of every row, looked up or "
        "not, or the release would show which rows the batch used). Use a dense optimizer such as torch.optim.Adam, "
        "with nn.Embedding(..., sparse=False). Nothing was released.")


def unnoised_state_layers(module: nn.Module) -> list[str]:
    """Error messages for layers whose forward writes data-dependent state that the noise never covers
    (the released weights or buffers would reveal the batch). The first step's probe also catches any
    such write at run time (:class:`~lightning_dp.validators.kept_state.StateFingerprint`)."""
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


_LEGACY_REPARAMETRIZATIONS = (
    (WeightNorm, "torch.nn.utils.weight_norm", "torch.nn.utils.remove_weight_norm(layer, {name!r})", "weight_norm"),
    (SpectralNorm, "torch.nn.utils.spectral_norm", "torch.nn.utils.remove_spectral_norm(layer, {name!r})",
     "spectral_norm"),
)


def parametrized(module: nn.Module) -> bool:
    """Whether ``module`` computes some of its tensors from others by ``torch.nn.utils.parametrize`` (weight_norm,
    orthogonal, a user's parametrization) or ``torch.nn.utils.prune`` (:func:`pruned`): the trainable tensors are the
    originals (``parametrizations.weight.original0``, …; ``weight_orig``), which no closed-form rule knows. Such a
    module is hooked as one unit (:func:`~lightning_dp.grad_sample.capture.activations.is_unit`) and its per-example
    gradients come from replaying it per example on its originals (the per-layer vmap, or one backward per example for
    an RNN), the parametrization (or the pruning mask) recomputed inside; the closed-form rules, the ghost engine's
    input-gradient-only forwards and the normalisation reducers all pass it by."""
    return parametrize.is_parametrized(module) or pruned(module)


def pruned(module: nn.Module) -> bool:
    """Whether ``module`` is pruned by ``torch.nn.utils.prune`` (Lightning's ``ModelPruning``): its ``weight`` is
    ``weight_orig ⊙ weight_mask``, recomputed by a forward pre-hook, and the trainable tensor is ``weight_orig`` (the
    same Parameter object ``weight`` was: an optimizer holding it trains on). Replayed per example like a
    parametrization (the hook recomputes the weight from the replayed original), example i's gradient of
    ``weight_orig`` is its gradient of ``weight`` times the mask; the mask, taken from the released weights'
    magnitudes, is post-processing. A pruned layer without buffers is not possible: the mask is one."""
    return bool(module._buffers) and any(isinstance(h, BasePruningMethod) for h in module._forward_pre_hooks.values())


def parametrized_layers(module: nn.Module) -> list[str]:
    """Error messages for reparametrizations no engine serves: the legacy ``torch.nn.utils.weight_norm``/
    ``spectral_norm`` forward pre-hooks (``weight`` recomputed from ``weight_g``/``weight_v`` or ``weight_orig`` on
    every call, and a module torch cannot deep-copy). The ``torch.nn.utils.parametrizations`` ones are served
    (:func:`parametrized`), the spectral norm too: its power iteration is held while the model is attached and run
    once per update, on the released weights (:mod:`~lightning_dp.power_iteration`)."""
    errors = []
    for name, sub in module.named_modules():
        for hook in sub._forward_pre_hooks.values():
            for kind, api, remove, served in _LEGACY_REPARAMETRIZATIONS:
                if isinstance(hook, kind):
                    errors.append(
                        f"layer '{name}' ({type(sub).__name__}) recomputes its '{hook.name}' in a forward pre-hook "
                        f"from other parameters ({api}, the legacy API before torch.nn.utils.parametrizations): no "
                        f"per-example engine differentiates through it. Remove it before training "
                        f"({remove.format(name=hook.name)}) and train the plain '{hook.name}', or use "
                        f"torch.nn.utils.parametrizations.{served}, which is served.")
    return errors


def lazy_layers(module: nn.Module) -> list[str]:
    """Error messages for lazy layers not yet materialised (``nn.LazyLinear``, ``nn.LazyConv2d``): their parameters
    have no shape until a first forward, which would be a private step's, so no engine can hook them, no ledger can
    record them and the optimizer holds placeholders."""
    from torch.nn.parameter import UninitializedParameter

    return [f"layer '{name}' ({type(sub).__name__}) is lazy and not yet materialised: its parameters get their shape "
            "at the first forward. Materialise it before fit with one forward on a public input of the right shape "
            "(model(torch.zeros(1, *input_shape)) in __init__), or give the layer its input size (nn.Linear(d, k))."
            for name, sub in module.named_modules()
            if any(isinstance(p, UninitializedParameter) for p in sub.parameters(recurse=False))]


def complex_parameters(module: nn.Module) -> list[str]:
    """Error messages for trainable complex-valued parameters (``nn.Parameter(torch.randn(4, 2, dtype=torch.cfloat))``
    of a spectral layer): the engines compute real per-example gradients and norms, and the Gaussian noise is drawn
    per real coordinate; a complex parameter would be clipped by a norm that is not its own."""
    return [f"parameter '{name}' is complex ({p.dtype}): the per-example gradients, their norms and the noise are "
            "defined here for real parameters. Hold it as a real parameter with a last dimension of 2 and view it "
            "as complex in the forward (self.w = nn.Parameter(torch.view_as_real(w0)); torch.view_as_complex(self.w)"
            " inside an nn.Module's forward): its real and imaginary parts are then clipped and noised as two "
            "coordinates each."
            for name, p in module.named_parameters() if p.requires_grad and p.is_complex()]


def validate_module(module: nn.Module) -> list[str]:
    """All problems that prevent private training of ``module`` (empty list if none). Also installs the
    call-time checks of :func:`install_call_checks`, active while ``module`` is attached to a private step."""
    install_call_checks(module)
    return (lazy_layers(module) + batch_mixing_layers(module) + unnoised_state_layers(module)
            + sparse_gradient_layers(module) + parametrized_layers(module) + complex_parameters(module))


# ---------------------------------------------------------------------- call-time checks
def batchnorm_training_error(name: str, module: nn.Module) -> PrivacyConfigurationError:
    """A BatchNorm ran in training mode during private training."""
    return PrivacyConfigurationError(
        f"layer '{name}' ({type(module).__name__}) ran in training mode during private training: it normalises "
        "with the batch's statistics, so one example changes every other example's output and gradient "
        "(per-example clipping no longer bounds it), and it writes the batch's statistics into its running_mean/"
        "running_var buffers, released without noise. The step was stopped before its release. Put it in eval mode "
        "for the whole fit (running statistics frozen: a per-example affine map, whose weights may still train): "
        f"e.g. self.{name or '<layer>'}.eval() at the end of __init__ (Lightning keeps a module's mode), and again "
        "in on_train_epoch_start if your code calls model.train(). Or replace it with "
        f"nn.GroupNorm(num_groups, {getattr(module, 'num_features', 'C')}) (or LayerNorm); "
        "opacus.validators.ModuleValidator.fix(model) does this automatically.")


def embedding_bag_offsets_error(name: str, module: nn.Module) -> PrivacyConfigurationError:
    """An ``nn.EmbeddingBag(mode="max")`` called on a flat 1-D input (bags packed end to end, ``offsets``): its
    gradient goes to each dimension's arg-max row, which no rule computes from the call (modes sum and mean are
    served on the packed input: :mod:`~lightning_dp.grad_sample.embedding_bag_rule`)."""
    return PrivacyConfigurationError(
        f"layer '{name}' ({type(module).__name__}(mode='max')) was called on a 1-D input with offsets (the bags of "
        "all examples packed end to end in one tensor): its gradient goes to each dimension's arg-max row, which the "
        "per-example engines cannot split by example from a packed call. The step was stopped before its release. "
        "Use mode='sum' or mode='mean' (served on the packed input with offsets, per_sample_weights too), or call "
        "it on a 2-D [B, L] input, one bag per row, padding the shorter bags with padding_idx "
        f"({type(module).__name__}(..., mode='max', padding_idx=p): padded entries are left out of the max).")


def opacus_recurrent(module: nn.Module) -> Optional[str]:
    """The torch RNN that replaces an Opacus DP RNN (``opacus.layers.DPLSTM`` → ``"LSTM"``, ``DPGRU`` → ``"GRU"``,
    ``DPRNN`` → ``"RNN"``), or None for any other module (read from the class, without importing Opacus)."""
    if not type(module).__module__.startswith("opacus."):
        return None
    names = [cls.__name__ for cls in type(module).__mro__]
    if "DPRNNBase" not in names:
        return None
    return next((kind for dp, kind in (("DPLSTM", "LSTM"), ("DPGRU", "GRU"), ("DPRNN", "RNN")) if dp in names), "LSTM")


def opacus_packed_error(name: str, module: nn.Module) -> PrivacyConfigurationError:
    """Opacus' DP RNN called on a ``PackedSequence``: its cells' linear layers see each time step's rows of the packed
    batch (as many as the sequences that long), which no engine maps back to examples; torch's RNN is served there."""
    kind = opacus_recurrent(module) or "LSTM"
    return PrivacyConfigurationError(
        f"layer '{name or '<root>'}' (opacus.layers.DP{kind}) was called on a PackedSequence: its cells run one "
        "time step at a time on the packed rows of the sequences still running, so its linear layers never see one "
        f"row per example, and no engine can split their gradients by example. Nothing was released. Replace "
        f"opacus.layers.DP{kind} by torch.nn.{kind} (the same constructor arguments): lightning_dp serves "
        f"torch.nn.{kind} on a PackedSequence exactly, and faster (the DP layers were Opacus' way to hook an RNN; "
        "the per-example engines here do not need them).")


ATTACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""The modules attached to a private step right now (:meth:`~lightning_dp.privacy.private_step.PrivateStep.attach`
adds, ``detach`` discards): the call checks below act only on their calls."""


def _attached(root: nn.Module) -> bool:
    return root in ATTACHED


class _CallCheck:
    """A forward pre-hook on one layer of ``root``: checks each call while ``root`` is attached to a private step
    (:data:`ATTACHED`); once ``root`` has been attached and is detached
    again, the hook removes itself. A copy of the model (``copy.deepcopy``) gets hooks that follow the copy; a
    pickled model, inactive ones."""

    def __init__(self, name: str, root: Optional[nn.Module]) -> None:
        self.name = name
        self._root = None if root is None else weakref.ref(root)
        self._seen = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        root = None if self._root is None else self._root()
        if root is None:
            return None
        if not _attached(root):
            if self._seen:
                _remove(module, self)
            return None
        self._seen = True
        self.check(module, args, kwargs)
        return None

    def check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> "_CallCheck":
        root = None if self._root is None else self._root()
        return type(self)(self.name, None if root is None else memo.get(id(root)))

    def __reduce__(self) -> tuple:
        return type(self), (self.name, None)


class _BatchNormMode(_CallCheck):
    """Refuses a BatchNorm forward in training mode (batch statistics, running statistics written from the
    batch), with or without gradients."""

    def check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training:
            raise batchnorm_training_error(self.name, module)


class _EmbeddingBagInput(_CallCheck):
    """Refuses a differentiated ``nn.EmbeddingBag(mode="max")`` call on a 1-D input with ``offsets`` (the engines
    re-run such a layer per example on ``[1, …]`` slices, without offsets; modes sum and mean have a rule)."""

    def check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
        if (module.mode == "max" and isinstance(x, torch.Tensor) and x.dim() == 1 and offsets is not None
                and torch.is_grad_enabled()
                and any(p.requires_grad for p in module.parameters())):
            raise embedding_bag_offsets_error(self.name, module)


class _OpacusRecurrentInput(_CallCheck):
    """Refuses a differentiated call of Opacus' DP RNN on a ``PackedSequence`` (:func:`opacus_packed_error`)."""

    def check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        if (isinstance(x, PackedSequence) and torch.is_grad_enabled()
                and any(p.requires_grad for p in module.parameters())):
            raise opacus_packed_error(self.name, module)


def install_call_checks(root: nn.Module) -> None:
    """Forward pre-hooks on the layers of ``root`` whose use depends on the call (module docstring); any such
    hooks of an earlier call are replaced."""
    for name, sub in root.named_modules():
        for hook in [h for h in sub._forward_pre_hooks.values() if isinstance(h, _CallCheck)]:
            _remove(sub, hook)
        check: Optional[type[_CallCheck]] = (
            _BatchNormMode if isinstance(sub, _BatchNorm) else
            _EmbeddingBagInput if isinstance(sub, nn.EmbeddingBag) else
            _OpacusRecurrentInput if opacus_recurrent(sub) is not None else None)
        if check is not None:
            sub.register_forward_pre_hook(check(name, root), with_kwargs=True)


def _remove(module: nn.Module, hook: Any) -> None:
    for key in [k for k, h in module._forward_pre_hooks.items() if h is hook]:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
