"""Activation capture: what the per-layer engines record of each hooked layer's calls.

Shared machinery of the ``vmap`` and ``ghost`` engines (:mod:`.grad_sample`): a forward hook
keeps each call's inputs (keyword tensors included, bound to the layer's signature) and a
tensor hook on its output keeps the gradient of the mean loss w.r.t. that output, δ. From
(inputs, δ) an engine rebuilds or bounds each example's parameter gradient.

The capture also carries the first half of the engine contract (:class:`GradSampleEngine`):
the strategy tells it how many examples the sampler put in the step
(:meth:`ActivationCapture.begin_step`), and every call whose example dimension differs is
recorded as a mismatch (:func:`~lightning_dp.validators.example_dim.check_example_dim`
turns it into an error naming the layer) instead of being clipped per token or per time step.
An RNN called on a ``PackedSequence`` is recorded as called; its examples are the packed sequences
(:meth:`ActivationCapture._record_packed`).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten, tree_map

from lightning_dp.mode_free import mode_free
from lightning_dp.records.identity import IdentityMap
from lightning_dp.grad_sample.capture.attention_nodes import projection_candidate, record_projections
from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites, adds_up
from lightning_dp.grad_sample.capture.engine_hooks import EngineHook, feeds_parameters
from lightning_dp.grad_sample.capture.example_dims import (
    BATCH_FIRST,
    UNITS,
    ExampleDims,
    draws_randomness,
    example_dims,
    position_wise,
)
from lightning_dp.grad_sample.capture.finite import finite_copy, finite_fields
from lightning_dp.grad_sample.capture.own_tensors import own_trainable, plain_leaf
from lightning_dp.grad_sample.capture.recurrent_tape import RecurrentTape, tape_of
from lightning_dp.grad_sample.capture.root_parameters import RootParameters
from lightning_dp.validators.elementwise_scale import ScaledOperand, scale_candidate, scaled_operand
from lightning_dp.validators.example_dim import (
    ambiguous_layout_error,
    flattened_rows,
    packed_sequence_error,
    unbatched_call,
)
from lightning_dp.validators.example_layout import ROWS, example_minor_rows, examples_in
from lightning_dp.validators.layers import parametrized

TIME_MAJOR = ExampleDims(lambda key: 1, (1,))
"""Example dimensions of a position-wise layer inside a time-major container (before moving)."""


def autocast_state() -> Optional[tuple[str, torch.dtype]]:
    """The autocast in effect now, as (device type, dtype) (``None``: none): a layer replayed per example after the
    backward (outside the training step's autocast) must compute in the precision of its recorded call."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


@dataclass(eq=False)  # a call is itself: compared by identity (list.remove must not compare tensors)
class Record:
    """One call of a hooked layer: its inputs and, after backward, its output gradients.

    ``args`` are the call's arguments bound to the layer's ``forward`` signature (a keyword
    tensor ``leaf(x=h)`` arrives as ``args[0]``); ``kwargs`` the keyword-only ones.
    ``grad_outs[k]`` is the gradient reaching the k-th tensor of the output (``tree_flatten``
    order; ``None`` where none arrived); most layers have one output, ``grad_out``.
    """

    args: Optional[tuple[Any, ...]]  # None once the call was reduced (LayerCalls.reduce)
    kwargs: dict[str, Any]
    grad_outs: list[Optional[Tensor]] = field(default_factory=lambda: [None])
    rng: Optional[Any] = None  # random state before the call, for layers that draw (example_dims.draws_randomness)
    generation: int = 0  # the LayerCalls generation (step) the call belongs to
    output: Optional[Tensor] = None  # an RNN's output sequence (detached): its last layer's values (rnn_unrolled)
    flattened: bool = False  # example i's slice is laid out as the layer was called: flattened examples [n·m, …],
    # recorded as [n, m, …] (validators/example_dim.py), or a lookup without the examples repeated n times
    scaled: Optional[ScaledOperand] = None  # an output verified as w ⊙ y + b (validators/elementwise_scale.py)
    projections: Optional[Any] = None  # a self-attention call's projection nodes (attention_nodes.Projections)
    tape: Optional[RecurrentTape] = None  # an RNN call's forms, left by its backward (recurrent_tape.py)
    autocast: Optional[tuple[str, torch.dtype]] = field(default_factory=lambda: autocast_state())
    # (device type, dtype) of the autocast the call ran under: a replay per example runs under the same
    norm_stats: Optional[tuple[Tensor, Tensor]] = None  # a LayerNorm/GroupNorm call's own mean and 1/σ (norm_stats)

    @property
    def grad_out(self) -> Optional[Tensor]:
        """The gradient reaching the (first) output tensor."""
        return self.grad_outs[0]

    @grad_out.setter
    def grad_out(self, g: Optional[Tensor]) -> None:
        self.grad_outs[0] = g

    @property
    def has_grad(self) -> bool:
        """Whether any output gradient arrived."""
        return any(g is not None for g in self.grad_outs)

    def set_grad(self, g: Optional[Tensor], k: int = 0) -> None:
        """Tensor hook target: keep (accumulate, for retain_graph) output k's gradient. ``None``: no gradient reached
        it (a hook on an output of a custom autograd function whose other outputs were used) — nothing to keep."""
        if g is None:
            return
        g = g.detach()
        self.grad_outs[k] = g if self.grad_outs[k] is None else self.grad_outs[k] + g


RecordReducer = Callable[[Record], dict[str, Tensor]]
"""Per-example grads ``{parameter name: [n, *shape]}`` of one call, from its inputs and output grad."""


@dataclass
class LayerCalls:
    """Everything captured for one hooked layer during one step.

    ``records``: calls still holding their inputs (and, after backward, output grads).
    ``reduced``: for a layer with a reducer, the per-example grads of the calls already
    reduced during backward, summed over calls; those calls keep no tensors.
    ``mismatches``: output shapes of this step's calls whose example dimension was not the
    step's number of examples (nothing of those calls is kept).
    ``unbatched``: argument slots seen with a leading dimension other than the step's number of
    examples: never sliced per example afterwards (a [T, T] mask stays whole when T = n).
    ``unserved``: output shapes of this step's calls without the examples (lookups) whose output reached the
    loss otherwise than broadcast over the examples (:mod:`.broadcast_sites`): refused.
    """

    name: str
    module: nn.Module
    records: list[Record] = field(default_factory=list)
    reduced: dict[str, Tensor] = field(default_factory=dict)
    mismatches: list[tuple[int, ...]] = field(default_factory=list)
    unbatched: set[str] = field(default_factory=set)
    generation: int = 0
    unserved: list[tuple[int, ...]] = field(default_factory=list)

    @mode_free  # the norms' statistics are the engine's own arithmetic: not a user's torch mode's to answer
    def reduce(self, rec: Record, grad_out: Tensor, reducer: RecordReducer) -> None:
        """Fold call ``rec``, whose output gradient has arrived, into :attr:`reduced`; drop its tensors."""
        if rec.generation != self.generation:
            return  # the call's step was cleared already (a stale graph's backward): ignore it
        if rec.args is None:
            raise RuntimeError(
                f"{self.name}: a second gradient reached an output whose inputs were already released "
                "(backward twice through one graph, retain_graph=True). The ghost engine reduces "
                "normalisation layers during the first backward; use per_sample='vmap' for this.")
        at = next(i for i, r in enumerate(self.records) if r is rec)
        rec.grad_out = grad_out.detach()
        for pname, g in reducer(rec).items():
            self.reduced[pname] = self.reduced[pname] + g if pname in self.reduced else g
        del self.records[at]
        rec.args, rec.kwargs, rec.grad_out = None, {}, None

    def slot_dims(self, rec: Record, n: int) -> tuple[list[Any], dict[str, Any]]:
        """For each argument of ``rec``, the dimension vmap slices it along, per tensor (a pytree
        of ints and ``None``): the layer's example dimension (:mod:`.example_dims`) where the tensor
        holds n rows there and was never seen otherwise in this run (:attr:`unbatched`), else
        ``None`` (passed whole to every example: masks, tables)."""
        dims = example_dims(self.module)

        def of(key: str, a: Any) -> Any:
            d = dims.argument(key)

            def leaf(t: Any) -> Optional[int]:
                ok = isinstance(t, Tensor) and d is not None and t.dim() > d and t.shape[d] == n
                return d if ok and key not in self.unbatched else None

            return tree_map(leaf, a) if isinstance(a, (tuple, list)) else leaf(a)

        assert rec.args is not None
        return [of(str(i), a) for i, a in enumerate(rec.args)], {k: of(k, v) for k, v in rec.kwargs.items()}


def _detached(a: Any) -> Any:
    if isinstance(a, Tensor):
        return a.detach()
    if isinstance(a, PackedSequence):  # a tuple whose constructor takes its fields, not an iterable
        return a._replace(data=a.data.detach())
    if isinstance(a, (tuple, list)):
        return type(a)(_detached(v) for v in a)
    return a


def _tensors(a: Any) -> list[Tensor]:
    """The tensors in an argument or output (a tensor, or nested tuples/lists: LSTM's ``(h, c)``)."""
    if isinstance(a, Tensor):
        return [a]
    if isinstance(a, (tuple, list)):
        return [t for v in a for t in _tensors(v)]
    return []


def random_state(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """The global random state a call of ``module`` will draw from (CPU, and its CUDA device)."""
    device = next(module.parameters()).device
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _to_front(a: Any, n: Optional[int]) -> Any:
    """A time-major argument ``[T, B, …]`` as ``[B, T, …]`` (a view); anything else unchanged."""
    return a.movedim(1, 0) if isinstance(a, Tensor) and a.dim() > 1 and a.shape[1] == n else a


def is_unit(module: nn.Module) -> bool:
    """A module hooked as one layer with its children's parameters: :data:`~.example_dims.UNITS`, a module with a
    parametrization (:func:`~.validators.layers.parametrized`: its originals live in a ``parametrizations`` child),
    and a module that owns parameters and whose children are stateless (:func:`stateless`): a mixture-of-experts
    block's ``experts``, whose stacked ``gate_up_proj``/``down_proj`` it uses itself, with an ``act_fn`` child."""
    if isinstance(module, UNITS):
        return True
    if plain_leaf(module):  # no children, not parametrized (own_tensors.py): the common layer, answered at once
        return False
    if parametrized(module):
        return True
    children = list(module.children())
    return bool(children) and any(True for _ in module.parameters(recurse=False)) and all(map(stateless, children))


def stateless(module: nn.Module) -> bool:
    """No parameters, no buffers, no dropout and no batch normalisation anywhere inside (an activation function): a
    function of each example alone, drawing nothing."""
    return (not any(True for _ in module.parameters()) and not any(True for _ in module.buffers())
            and not any(isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm))
                        for m in module.modules()))


def direct_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs owned directly by ``module`` that require grad (for a unit, all of
    its parameters, with dotted names)."""
    if not isinstance(module, UNITS) and plain_leaf(module):  # not a unit: its own table (own_tensors.py)
        return own_trainable(module)
    return [(n, p) for n, p in module.named_parameters(recurse=is_unit(module)) if p.requires_grad]


def _inside(name: str, units: list[str]) -> bool:
    return any(name.startswith(u + ".") for u in units)


def leaf_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """What per-layer engines hook: units, and the leaf modules outside units that own parameters."""
    out: list[tuple[str, nn.Module]] = []
    units: list[str] = []
    for name, m in module.named_modules():
        if _inside(name, units):
            continue
        if is_unit(m):
            units.append(name)
            out.append((name, m))
        elif (any(True for _ in m.parameters(recurse=False)) and not any(True for _ in m.children())
              and not isinstance(m, HOLDERS)):
            out.append((name, m))
    return out


HOLDERS: tuple[type[nn.Module], ...] = (nn.ParameterDict, nn.ParameterList)
"""Modules that hold parameters but have no forward (PEFT's IA3 keeps its scaling vectors in a ``ParameterDict``
its layer reads): never hooked; their parameters are read directly (:mod:`.root_parameters`)."""


def owners_of(module: nn.Module) -> dict[Tensor, list[tuple[nn.Module, str, str]]]:
    """Map each parameter to the (module, module name, attribute) pairs that own it; a unit owns
    its children's parameters (attribute ``"out_proj.weight"``)."""
    owners: dict[Tensor, list[tuple[nn.Module, str, str]]] = {}
    units: list[str] = []
    for mname, sub in module.named_modules(remove_duplicate=False):
        if _inside(mname, units):
            continue
        unit = is_unit(sub)
        if unit:
            units.append(mname)
        for pname, p in sub.named_parameters(recurse=unit):
            lst = owners.setdefault(p, [])
            if all(e[0] is not sub for e in lst):
                lst.append((sub, mname, pname))
    for p, lst in owners.items():  # an alias in a parent (Opacus' DPLSTM renames its cells' weights) is no use
        layers = [e for e in lst if is_unit(e[0]) or not any(True for _ in e[0].children())]
        if layers and len(layers) < len(lst):
            owners[p] = layers
    return owners


_SIGNATURES: dict[Any, inspect.Signature] = {}


def bind_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call with every argument that can be positional made positional,
    in the order of ``module.forward``'s signature: ``leaf(x=h)`` and ``leaf(h)`` record alike."""
    if not kwargs:
        return args, kwargs
    fn = getattr(module.forward, "__func__", module.forward)
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(module.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs  # the call itself will raise the user's error
    return tuple(bound.args), dict(bound.kwargs)


def _aliased(out: Any, leaves: list, live: list[int]) -> tuple[Any, list]:
    """The output handed to the model, and its tensors, where each hooked tensor receives exactly the gradient of
    the model's uses of it. Three ways a hook on the layer's own output tensor would see something else:

    - a view modified in place later (``q = self.q(h); q /= s``; F.linear on ``[B, T, d]`` returns a view) never
      fires its hook: the model gets an alias that is not a view;
    - of several outputs, one computed from another inside the forward (a router returning its logits and the top-k
      weights taken from them) receives the gradient of that inner use too, and the per-example formula
      Σ_k ⟨f_k(θ, x_i), δ_k,i⟩ would count it twice: every live tensor of a multi-tensor output is handed over as a
      fresh alias, whose gradient comes from the model's uses alone;
    - a layer that returns a leaf tensor (its own parameter, ``def forward(self): return self.table``) would have the
      hook put on the parameter itself, where it stays for every later step: the model gets an alias of it.

    ``aten._unsafe_view`` makes the alias without a copy."""
    if isinstance(out, Tensor):
        leaf = out.grad_fn is None and out.requires_grad and not torch.compiler.is_compiling()
        if out._base is None and not leaf:
            return out, leaves
        out = torch.ops.aten._unsafe_view(out, out.shape)
        return out, [out]
    flat, spec = tree_flatten(out)
    for k in live:
        flat[k] = torch.ops.aten._unsafe_view(flat[k], flat[k].shape)
    return tree_unflatten(flat, spec), flat


NORMALISATIONS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm)
"""Layers whose calls keep the statistics they normalised with (:func:`norm_stats`)."""

_NORM_NODES = ("NativeLayerNormBackward0", "NativeGroupNormBackward0")


def norm_stats(out: Any) -> Optional[tuple[Tensor, Tensor]]:
    """The mean and 1/σ a layer norm or group norm call normalised with (``[*, 1]`` per row of a layer norm,
    ``[N, G]`` per example and group of a group norm), as torch's kernel saved them for its backward: the per-example
    gradient of the layer's weight needs the normalised input again, (x − μ)·(1/σ), which is then one elementwise
    pass instead of a second normalisation (:func:`~lightning_dp.grad_sample.norm_rule.normalised`). Kept for
    batch-first calls only (a time-major or flattened call's statistics are laid out as the call, not as recorded).
    None for an output not made by torch's kernel (a subclass's own forward, a traced or compiled call)."""
    node = out.grad_fn if isinstance(out, Tensor) else None
    if node is None or type(node).__name__ not in _NORM_NODES:
        return None
    try:  # detached: a saved output unpacks with the node as its grad_fn, and a record holding that node (whose hooks
        # hold the record) would keep the step's whole graph alive, a cycle through C++ that Python never collects
        return node._saved_result1.detach(), node._saved_result2.detach()
    except (AttributeError, RuntimeError):  # another torch's node layout, or its saved tensors already released
        return None


def _leaf_inputs(args: Any, kwargs: Any) -> list[Tensor]:
    """The tensors a call takes that are leaves requiring grad (an input made to require grad: a saliency map, FGSM's
    x0)."""
    flat = [*args, *kwargs.values()]
    if not all(isinstance(a, (Tensor, int, float, bool, str)) or a is None for a in flat):
        flat, _ = tree_flatten(flat)  # nested arguments (LSTM's (h, c)); plain ones skip the pytree walk (≈ 15 µs)
    return [t for t in flat if isinstance(t, Tensor) and t.is_leaf and t.requires_grad]


def _rnn_output(module: nn.Module, out: Any, tape: Optional[RecurrentTape]) -> Optional[Tensor]:
    """What a record keeps of an RNN call's output sequence (its last layer's values, which the unrolled rule need not
    recompute): a copy, since the model may change the output in place (``out.mul_(mask)``: torch's own backward
    allows it) and the alias it is handed shares the storage. None for other layers, and for a call whose backward
    leaves its forms on a ``tape`` (the rule reads no values then; should the tape be spent, it recomputes)."""
    if not isinstance(module, nn.RNNBase) or tape is not None or not isinstance(out, Tensor):
        return None
    return out.detach().clone()


def _contiguous_output_grad(module: nn.Module, args: tuple, out: Any) -> None:
    """Forward hook on every batch norm: its output's gradient reaches torch's backward contiguous. torch 2.13's CPU
    batch-norm backward returns wrong input, weight and bias gradients for a batch of one example whose output
    gradient has channels-last strides with a short batch stride (XCiT's ``flatten(2).transpose(1, 2)`` after its
    convolutional stem sends back exactly that): every batch of one — the probe's examples alone, a Poisson batch or
    a physical micro-batch of one — would get another example's-worth of error."""
    if isinstance(out, Tensor) and out.requires_grad:
        out.register_hook(lambda g: None if g.is_contiguous() else g.contiguous())


def grouped(a: Any, rows: int, n: int, minor: bool = False) -> Any:
    """Every tensor in ``a`` (nested tuples/lists too) with ``rows`` = n·m rows in dimension 0, as ``[n, m, …]``
    (a view where the layout allows): example i's rows together (:func:`~.validators.example_dim.flattened_rows`).
    ``minor``: the rows are example-minor, example i's are i, n + i, … (a reshape of ``[m, n, …]``:
    :func:`~.validators.example_layout.example_minor_rows`), regrouped by a transposed view."""
    if isinstance(a, Tensor):
        if a.dim() == 0 or a.shape[0] != rows:
            return a
        if minor:
            return a.reshape(rows // n, n, *a.shape[1:]).transpose(0, 1)
        return a.reshape(n, rows // n, *a.shape[1:])
    if isinstance(a, (tuple, list)):
        return type(a)(grouped(v, rows, n, minor) for v in a)
    return a


GENERAL = object()
"""What the capture's fast path for a common call returns for any other call: the general path records it."""


class ActivationCapture:
    """Forward hooks that keep each hooked layer's inputs and output gradients.

    Only calls made with grad enabled whose output requires grad are recorded; calls
    that never see a backward (e.g. an extra forward for logging) are dropped by
    :meth:`completed`. Inputs are detached views: no copy beyond what autograd keeps.

    A layer attached with a :data:`RecordReducer` is reduced as soon as each call's output
    gradient arrives (:meth:`LayerCalls.reduce`): its inputs and output gradient are released
    during backward instead of being held until the clipping step.

    :meth:`begin_step` (n) clears whatever an earlier forward left behind and makes every call
    check its example dimension against n.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._calls: dict[int, LayerCalls] = {}
        self.expected: Optional[int] = None
        self._suspended = False
        # per layer, kept across detach/attach (LayerCalls.unbatched); by identity: a layer replaced since (a fine-
        # tuning callback) is freed, and a new one taking its id is not judged by its calls (records/identity.py)
        self._unbatched: IdentityMap[set[str]] = IdentityMap()
        self._rng: Optional[Any] = None
        self._flattened: set[int] = set()  # row counts n·m verified as flattened examples in this step
        self._anchors: dict[Any, int] = {}  # autograd node of a layer output this step → its rows (n, or n·m flattened)
        self._layouts: dict[Any, int] = {}  # autograd node of a layer output this step → its example dim (≠ 0)
        self._time_major: IdentityMap[bool] = IdentityMap()  # layers proven time-major in this run (_time_major_call)
        # layers once called without an example dimension (kept for the run), with the ranks of those calls
        self._lookups: IdentityMap[set[tuple[int, ...]]] = IdentityMap()
        self._lookups_alone: IdentityMap[set[tuple[int, ...]]] = IdentityMap()  # seen unbatched at n = 1 only
        self._lookup_ids: set[int] = set()  # id of every layer in _lookups or _lookups_alone (plain_call's test)
        self.plain_calls = True  # the common call's fast path (_hook's plain_call; False: every call the general way)
        self._sites: Optional[BroadcastSites] = None  # this step's broadcast sites (broadcast_sites.py)
        self._rowless: set[tuple] = set()  # calls on followed tensors once seen without the examples (for the run)
        self.roots = RootParameters(lambda: None if self._suspended else self.expected, self.follow)
        self._params: dict[int, Tensor] = {}  # the parameters this step's recorded calls used (FSDP2: unsharded)
        self._feeding: dict[int, bool] = {}  # graph task id → whether it computes any of their gradients
        self._root_params: list[Tensor] = []  # the model's trainable parameters (read directly by its modules too)
        self._inputs: dict[int, Tensor] = {}  # the leaves requiring grad the recorded calls take as inputs
        self._scale_checked: Callable[[nn.Module], bool] = lambda m: True  # attach's

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """No recording while engines re-run a layer themselves (vmap's ``functional_call``)."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    def attach(self, layers: Sequence[tuple[str, nn.Module]],
               reducer_for: Callable[[nn.Module], Optional[RecordReducer]] = lambda m: None,
               time_major: frozenset[int] = frozenset(), root: Optional[nn.Module] = None,
               scale_checked: Callable[[nn.Module], bool] = lambda m: True) -> None:
        """Register a forward hook on every ``(name, module)``; ``reducer_for(module)`` picks
        the layers reduced during backward (default: none); layers whose ``id`` is in ``time_major``
        are position-wise layers called on ``[T, B, …]`` (:func:`~.example_dims.time_major_layers`).
        With ``root``, ``[1, …]`` parameters read directly in its non-leaf modules are captured too
        (:mod:`.root_parameters`). ``scale_checked(module)``: whether its calls are verified as w ⊙ y + b
        (:attr:`Record.scaled`, read by the elementwise-scale rule only; default: every layer's), a walk of the
        call's autograd nodes that an engine whose own rule serves the layer whatever its calls skips."""
        self.detach()
        self._scale_checked = scale_checked
        self._root_params = [] if root is None else [p for p in root.parameters() if p.requires_grad]
        if root is not None:
            covered = {id(m) for _, layer in layers for m in layer.modules()}
            hooked = {id(layer) for _, layer in layers}
            self.roots.attach(root, lambda m: id(m) in covered, lambda m: id(m) in hooked)
            self._handles.extend(m.register_forward_hook(EngineHook(_contiguous_output_grad))
                                 for m in root.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
        for name, module in layers:
            calls = LayerCalls(name, module, unbatched=self._unbatched.setdefault(module, set()))
            self._calls[id(module)] = calls
            hook = self._hook(calls, reducer_for(module), id(module) in time_major)
            self._handles.append(module.register_forward_hook(EngineHook(hook), with_kwargs=True))
            if isinstance(module, (*UNITS, nn.RNNBase)):
                self._handles.append(module.register_forward_pre_hook(EngineHook(self._remember_rng)))
            dims = TIME_MAJOR if id(module) in time_major else example_dims(module)
            if dims is not BATCH_FIRST:
                self._handles.append(module.register_forward_pre_hook(EngineHook(self._sites_at(dims)),
                                                                      with_kwargs=True))

    def _sites_at(self, dims: ExampleDims) -> Callable[[nn.Module, tuple, dict], Optional[tuple[tuple, dict]]]:
        """Forward pre-hook of a layer whose arguments hold the examples elsewhere than in dimension 0 (RNNs,
        time-major attention and position-wise layers): a followed argument with the step's n examples in its
        example dimension is a broadcast site (:meth:`~.broadcast_sites.BroadcastSites.at_layer`: a learned RNN
        initial state ``[L, 1, H]`` expanded over the batch in dimension 1)."""

        def at(sites: BroadcastSites, key: str, a: Any) -> Any:
            d = dims.argument(key)
            return a if not d else tree_map(lambda t: sites.at_layer(t, d) if isinstance(t, Tensor) else t, a)

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            sites = self._sites
            if sites is None or not sites.following or self._suspended:
                return None
            followed_args = tuple(at(sites, str(i), a) for i, a in enumerate(args))
            return followed_args, {k: at(sites, k, v) for k, v in kwargs.items()}

        return pre

    def _remember_rng(self, module: nn.Module, args: tuple) -> None:
        self._rng = random_state(module) if draws_randomness(module) and not self._suspended else None

    def begin_step(self, num_examples: Optional[int]) -> None:
        """Drop everything captured so far; calls from now on belong to a step of ``num_examples``."""
        self.clear()
        self.expected = num_examples

    def _hook(self, calls: LayerCalls, reducer: Optional[RecordReducer], time_major: bool = False):
        dims = TIME_MAJOR if time_major else example_dims(calls.module)
        params = [p for _, p in calls.module.named_parameters(recurse=is_unit(calls.module))]
        scale_weight = scale_candidate(calls.module) if self._scale_checked(calls.module) else None
        position = position_wise(calls.module)  # may be served time-major where proven (_time_major_call)
        # a batch-first layer that is not a unit or an RNN: its common call can take plain_call (decided per call)
        batch_first = dims is BATCH_FIRST and not isinstance(calls.module, (*UNITS, nn.RNNBase))
        normalisation = isinstance(calls.module, NORMALISATIONS)

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            if self._sites is not None:
                self._sites.pause_if_idle()
            if self._suspended or not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
                return None
            sites = self._sites  # none, or idle: nothing followed, the mode left (aside and carry do nothing)
            if batch_first and self.plain_calls and (sites is None or not (sites.active or sites.following)):
                done = plain_call(module, args, kwargs, out)
                if done is not GENERAL:
                    return done
            with self._sites_aside():  # the checks below are the capture's own torch calls: not the model's
                return record(module, args, kwargs, out)

        def plain_call(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            """What :func:`record` does with the common call, without its general tests, or :data:`GENERAL` for any
            other call. The common call: positional tensor arguments only, one output tensor requiring grad with
            the step's n ≥ 2 examples in dimension 0 (not also in dimension 1 of a position-wise layer's ≥ 3-D
            output), of a layer never seen called as a lookup, while no tensor is followed to its broadcast sites.
            For it every test of :func:`record` is decided by those facts alone, with the outcome written out below:
            not packed, not time-major (:meth:`_time_major_call` returns at its shape test), not one row and not a
            lookup (:func:`~.validators.example_dim.unbatched_call` is False with n in the output's dimension 0, and
            the layer has no remembered lookup ranks), not flattened rows (the rows are n), no mismatch; the
            arguments are noted unbatched by :meth:`_note_unbatched`'s test, and the scaled operand, the norm
            statistics, the alias, the anchor, the parameters, the leaf inputs, the record and the output's hook are
            the same (``tests/grad_sample/capture/test_capture.py`` compares both paths' captures)."""
            n = self.expected
            if (kwargs or n is None or n < 2 or not isinstance(out, Tensor) or not out.requires_grad
                    or out.dim() == 0 or out.shape[0] != n or (position and out.dim() >= 3 and out.shape[1] == n)
                    or id(module) in self._lookup_ids or not all(isinstance(a, Tensor) for a in args)):
                return GENERAL
            for i, a in enumerate(args):
                if a.dim() == 0 or a.shape[0] != n:
                    calls.unbatched.add(str(i))
            scaled = None if scale_weight is None else scaled_operand(scale_weight, out, list(args))
            stats = norm_stats(out) if normalisation else None
            out, _ = _aliased(out, [out], [0])
            if out.grad_fn is not None:
                self._anchors[out.grad_fn] = n
            self._params.update((id(p), p) for _, p in direct_trainable(module))
            self._inputs.update((id(t), t) for t in args if t.is_leaf and t.requires_grad)
            rec = Record(tuple(a.detach() for a in args), {}, [None], None, calls.generation, None, False, scaled,
                         None, None, norm_stats=stats)
            calls.records.append(rec)
            if reducer is not None:
                out.register_hook(lambda g: None if self._mapping() or self._aside() else calls.reduce(rec, g, reducer))
            else:
                out.register_hook(lambda g: None if self._mapping() or self._aside() else rec.set_grad(g))
            return out

        def record(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            leaves = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
            live = [k for k, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not live:
                return None
            n = self.expected
            args, kwargs = bind_call(module, args, kwargs)
            if any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values())):
                self._record_packed(calls, args, kwargs, leaves, n)
                return None
            inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
            # A call without the examples (T5's [T, T] buckets) or on one row of them (Hugging Face's [1, T] position
            # ids; PEFT's prompt embedding, later .repeat(B, 1, 1)): its output is followed to where it meets the
            # examples, never expanded before the model sees it (that would change every shape computed from it).
            tm = time_major or (position and self._time_major_call(calls, inputs, leaves, live, n))
            cdims = TIME_MAJOR if tm else dims
            one_row = (n is not None and n > 1 and isinstance(out, Tensor) and out.dim() > 0 and out.shape[0] == 1
                       and dims.output(0) == 0 and not tm)
            if one_row or (n is not None and not tm and self._is_lookup(module, inputs, out, n, dims)):
                out, aliases = _aliased(out, leaves, live)
                self._carry_followed(leaves, aliases)
                self._record_lookup(calls, args, kwargs, out, n, inputs)
                return out
            rows, minor = (None, False) if tm else self._flattened_rows(inputs, leaves, live, n, dims)
            if minor and isinstance(module, nn.RNNBase):
                rows, minor = None, False  # its rule reads example-major rows: refused below
            # flattened examples: record [n, m, …] (validators/example_dim.py); an RNN's call stays on its n·m rows,
            # its rule sums each example's (rnn_unrolled.py)
            flat_rnn = rows is not None and isinstance(module, nn.RNNBase)
            if rows is not None and not flat_rnn:
                args, kwargs = grouped(args, rows, n, minor), {k: grouped(v, rows, n, minor) for k, v in kwargs.items()}
            if n is not None:
                wrong = [k for k in live if leaves[k].dim() <= cdims.output(k) or leaves[k].shape[cdims.output(k)] != n]
                if wrong and rows is None:
                    calls.mismatches.extend(tuple(leaves[k].shape) for k in wrong)
                    return None
                if not flat_rnn:
                    self._note_unbatched(calls, args, kwargs, n, cdims)
            if tm:  # position-wise layer on [T, B, …]: record it batch-first (views)
                args = tuple(_to_front(a, n) for a in args)
                kwargs = {k: _to_front(v, n) for k, v in kwargs.items()}
            scaled = (None if scale_weight is None or rows is not None or tm
                      else scaled_operand(scale_weight, out, inputs))
            projections = (record_projections(module, args[0], leaves[0], self._mapping)
                           if n is not None and rows is None and projection_candidate(module, args, kwargs) else None)
            tape = tape_of(leaves[0]) if isinstance(module, nn.RNNBase) else None  # before the aliases replace it
            # a batch-first call's own statistics (before the aliases replace its output), in the layout recorded
            stats = norm_stats(leaves[0]) if isinstance(module, NORMALISATIONS) and not tm and rows is None else None
            out, aliases = _aliased(out, leaves, live)
            self._carry_followed(leaves, aliases)
            leaves = aliases
            if n is not None and not tm and not minor:  # outputs with the examples (or verified rows) in dimension 0
                self._anchors.update((leaves[k].grad_fn, rows or n) for k in live
                                     if dims.output(k) == 0 and leaves[k].grad_fn is not None)
            if n is not None and rows is None:  # outputs with the examples in another dimension (example_layout.py)
                self._layouts.update((leaves[k].grad_fn, cdims.output(k)) for k in live
                                     if cdims.output(k) != 0 and leaves[k].grad_fn is not None)
            self._params.update((id(p), p) for _, p in direct_trainable(module))
            self._inputs.update((id(t), t) for t in _leaf_inputs(args, kwargs))
            rec = Record(_detached(tuple(args)), {k: _detached(v) for k, v in kwargs.items()}, [None] * len(leaves),
                         self._rng if draws_randomness(module) else None, calls.generation,
                         _rnn_output(module, leaves[0], tape), rows is not None, scaled,
                         projections, tape, norm_stats=stats)
            calls.records.append(rec)
            front = ((lambda g: g.movedim(1, 0)) if tm else (lambda g: g) if rows is None or flat_rnn
                     else (lambda g: grouped(g, rows, n, minor)))
            if reducer is not None and len(leaves) == 1:
                out.register_hook(lambda g: None if self._mapping() or self._aside()
                                  else calls.reduce(rec, front(g), reducer))
            else:
                for k in live:
                    leaves[k].register_hook(lambda g, k=k: None if self._mapping() or self._aside()
                                            else rec.set_grad(front(g), k))
            return out

        return hook

    def _record_packed(self, calls: LayerCalls, args: tuple, kwargs: dict, leaves: list, n: Optional[int]) -> None:
        """Record an RNN's call on a ``PackedSequence`` as it was made (the packed input kept), its output
        gradients in a padded call's slots: the packed output's data (rows of all examples, sorted by length;
        :mod:`~.grad_sample.rnn_unrolled` maps them back to examples), h_n, c_n. The examples are the packed
        sequences, verified against the step's n. Any other layer on a ``PackedSequence``, and an RNN drawing
        inter-layer dropout masks, is refused (:func:`~.validators.example_dim.packed_sequence_error`)."""
        module = calls.module
        if not isinstance(module, nn.RNNBase) or (module.training and module.dropout and module.num_layers > 1):
            raise packed_sequence_error(calls.name, module)
        packed = args[0] if args else kwargs["input"]
        outputs = [leaves[0], *leaves[4:]]  # tree_flatten: data, batch_sizes, sorted, unsorted indices, h_n(, c_n)
        if n is not None and int(packed.batch_sizes[0]) != n:
            calls.mismatches.append(tuple(outputs[1].shape))
            return
        tape = tape_of(outputs[0])
        rec = Record(_detached(tuple(args)), {k: _detached(v) for k, v in kwargs.items()}, [None] * len(outputs),
                     None, calls.generation, _rnn_output(module, outputs[0], tape), tape=tape)
        calls.records.append(rec)
        self._params.update((id(p), p) for p in module.parameters() if p.requires_grad)
        for k, t in enumerate(outputs):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda g, k=k: None if self._aside() else rec.set_grad(g, k))

    def _is_lookup(self, module: nn.Module, inputs: list[Tensor], out: Any, n: int, dims: ExampleDims) -> bool:
        """A call with no example dimension at all (:func:`~.validators.example_dim.unbatched_call`); a call of
        a layer once seen so, with inputs and output of the same ranks, stays one for the run (a later step whose n
        happens to equal T must not slice [T, T]). Calls of other ranks are classified afresh: PEFT's DoRA calls its
        LoRA layers on an identity matrix [d, d] (a lookup) and on the batch [B, T, d]."""
        if not isinstance(out, Tensor) or dims.output(0) != 0 or isinstance(module, (*UNITS, nn.RNNBase)):
            return False
        ranks = (*(t.dim() for t in inputs), out.dim())
        if ranks in self._lookups.get(module, ()):
            return True
        # the cheap test first: a call with the examples in some dimension (every batched call) is no lookup whatever
        # the walks below say (they only ever answer False, and read nothing they change), so they run only for a
        # call that would otherwise be taken for one
        if not (ranks in self._lookups_alone.get(module, ()) or unbatched_call(inputs, out, n)):
            return False
        if any(t.dim() > 0 and (t.shape[0] in self._flattened or flattened_rows(t, n, self._anchors)
                                or example_minor_rows(t, n, self._layout) is not None) for t in inputs):
            return False  # flattened examples ([T] rows of one example at n = 1): _flattened_rows serves them
        # at n = 1 every row is the one example's, so a call on rows merged by a copy (SwinV2's heads) looks
        # unbatched there: remembered for the run only when seen with n > 1; at n = 1 until evidence of rows
        (self._lookups if n > 1 else self._lookups_alone).setdefault(module, set()).add(ranks)
        self._lookup_ids.add(id(module))  # never plain_call's again (a freed layer's id reused: the general path)
        return True

    def _record_lookup(self, calls: LayerCalls, args: tuple, kwargs: dict, out: Tensor, n: int,
                       inputs: Sequence[Tensor] = ()) -> None:
        """Record an unbatched lookup as a batched call, output gradients gathered per example at the sites where
        the model broadcasts the output (:mod:`.broadcast_sites`). Inputs become n rows (views): a call without any
        example dimension has every tensor repeated in a new dimension 0; a ``[1, …]`` call (output ``[1, …]``)
        has its ``[1, …]`` tensors expanded there, and the others (``input_ids`` already ``[n, T]``, an unbatched
        ``[T]``) kept as they are, so the per-example replay sees what example i's call would have. ``inputs``: the
        call's tensors; a followed one (a lookup on another's output: an MLP over a coordinate table) links ``out``
        to its sources, whatever the layer's forward did inside (a custom autograd Function the sites do not see)."""
        one = out.dim() > 0 and out.shape[0] == 1

        def grown(t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t
            if one:
                return t.expand(n, *t.shape[1:]) if t.dim() > 0 and t.shape[0] == 1 else t
            return t.expand(n, *t.shape)

        def rows(a: Any) -> Any:
            return tree_map(grown, a)

        # without any example dimension, example i's call is the whole call as made: replayed as laid out, like rows
        # of flattened examples (a Conv1d takes no extra leading dimension); a [1, …] call's 1 is the example's own
        rec = Record(_detached(rows(tuple(args))), {k: _detached(rows(v)) for k, v in kwargs.items()}, [None],
                     None, calls.generation, flattened=not one)
        calls.records.append(rec)
        shape = tuple(out.shape)

        def deliver(per_example: Optional[Tensor], total: Tensor) -> None:
            if rec.generation != calls.generation:
                return
            if per_example is None or not adds_up(per_example, total):
                calls.records.remove(rec)
                calls.unserved.append(shape)  # used otherwise than broadcast over the examples: refused
                return
            rec.set_grad(per_example.reshape(n, *shape[1:]) if one else per_example)

        self.follow(out, n, deliver, inputs)

    def follow(self, t: Tensor, n: int, deliver: Callable[[Optional[Tensor], Tensor], None],
               inputs: Sequence[Tensor] = ()) -> None:
        """Gather example i's gradient of ``t`` (no example dimension) where the model broadcasts it over this
        step's n examples (:mod:`.broadcast_sites`); ``deliver(rows or None, total)`` after backward."""
        if self._sites is None or self._sites.n != n:
            self._close_sites()
            self._sites = BroadcastSites(n, lambda: self._flattened, lambda: self._anchors, self._rowless)
        self._sites.follow(t, deliver, inputs)

    def _sites_aside(self) -> ContextManager[None]:
        """The broadcast sites' mode left while the capture records a call (:meth:`.BroadcastSites.aside`)."""
        return self._sites.aside() if self._sites is not None else nullcontext()

    def _carry_followed(self, before: list, after: list) -> None:
        """The aliases the model is handed in place of a layer's outputs are followed where the outputs were (the
        aliases are made while the sites' mode is aside)."""
        if self._sites is not None:
            self._sites.carry(before, after)

    def _aside(self) -> bool:
        """Whether the backward now running computes no gradient of the parameters of this step's recorded calls: a
        ``torch.autograd.grad`` with respect to the input (FGSM's ∂L/∂x), whose output gradients are no part of the
        gradients the release clips; the hooks ignore it (:func:`~.engine_hooks.feeds_parameters`). Decided once per
        backward, over every recorded call's parameters (the ghost engine's patched layers keep theirs out of the
        graph; another layer's, or the same layer's in another call, are in it)."""
        task = torch._C._current_graph_task_id()
        if task not in self._feeding:
            params = {**self._params, **{id(p): p for p in self._root_params}}
            self._feeding[task] = feeds_parameters(list(params.values()), list(self._inputs.values()))
        return not self._feeding[task]

    def _mapping(self) -> bool:
        """Whether the backward now running is a broadcast site's nested one (:mod:`.broadcast_sites`), which a
        layer on the way from a followed tensor to its source (a time-major attention, x + attn(x)) must ignore."""
        return self._sites is not None and self._sites.mapping

    def end_backward(self) -> None:
        """The step's backward is over (every site has delivered): leave the broadcast-site mode, so the engine's
        clipping runs outside it."""
        self._close_sites()

    def _close_sites(self) -> None:
        """Leave this step's broadcast-site mode (end of step, detach, or a step of another size)."""
        if self._sites is not None:
            self._sites.close()
            self._sites = None

    def _flattened_rows(self, inputs: list[Tensor], leaves: list, live: list[int], n: Optional[int],
                        dims: ExampleDims) -> tuple[Optional[int], bool]:
        """The row count n·m (m > 1) of a call on flattened examples, else ``None``: every live output has
        that many rows at its example dimension (0, or an RNN's 1 for h_n), and an argument is a verified flattening of
        ``[n, …]``
        (:func:`~.validators.example_dim.flattened_rows`) or an earlier call of the step had that many; and whether
        the rows are example-minor instead (an argument made by a reshape of ``[m, n, …]`` whose dimension 1 is proven
        to hold the examples, :func:`~.validators.example_layout.example_minor_rows`; not for an RNN, whose rule reads
        example-major rows; never matched by count)."""
        if not n or any(leaves[k].dim() <= dims.output(k) for k in live) or dims.output(live[0]) != 0:
            return None, False
        rows = leaves[live[0]].shape[0]  # an RNN's h_n/c_n hold them in dimension 1 (its ExampleDims)
        if rows <= n or rows % n or any(leaves[k].shape[dims.output(k)] != rows for k in live):
            return None, False
        own = [t for t in inputs if t.dim() > 0 and t.shape[0] == rows]
        if any(flattened_rows(t, n, self._anchors) for t in own):
            self._flattened.add(rows)
            return rows, False
        if any(example_minor_rows(t, n, self._layout) == rows // n for t in own):
            return rows, True
        return (rows if rows in self._flattened else None), False

    def _layout(self, node: Any) -> Optional[int]:
        """Where a layer output of this step holds the examples (:data:`~.validators.example_layout.Layout`): its
        example dimension, :data:`~.validators.example_layout.ROWS` for flattened rows, ``None`` for any other node."""
        found = self._layouts.get(node)
        if found is not None:
            return found
        rows = self._anchors.get(node)
        return None if rows is None else 0 if rows == self.expected else ROWS

    def _time_major_call(self, calls: LayerCalls, inputs: list[Tensor], leaves: list, live: list[int],
                         n: Optional[int]) -> bool:
        """Whether a position-wise layer (:func:`position_wise`) was called time-major, ``[T, B, …]``, as proven by
        :func:`~.validators.example_layout.examples_in` on its input: dimension 1 holds the step's n examples (a
        transpose of a batch-first tensor, the output of a time-major attention or RNN or of another layer proven so).
        Walked only where dimension 0 of the outputs is not n (otherwise refused) or where both dimensions are n
        (T = B: the layout must be told apart); there a layer once proven time-major whose layout nothing decides is
        refused (:func:`~.validators.example_dim.ambiguous_layout_error`), and any other stays batch-first."""
        module = calls.module
        if n is None or not live:
            return False
        outs = [leaves[k] for k in live]
        if any(t.dim() < 3 or t.shape[1] != n for t in outs):
            return False
        x = next((t for t in inputs if t.dim() >= 2 and tuple(t.shape[:2]) == tuple(outs[0].shape[:2])), None)
        if x is None:
            return False
        ambiguous = all(t.shape[0] == n for t in outs)
        verdict = examples_in(x, 1, n, self._layout)
        if verdict:
            self._time_major[module] = True
            return True
        if ambiguous and verdict is None and module in self._time_major:
            raise ambiguous_layout_error(calls.name, tuple(outs[0].shape), n)
        return False

    @staticmethod
    def _note_unbatched(calls: LayerCalls, args: tuple, kwargs: dict, n: int, dims: ExampleDims) -> None:
        for key, a in (*((str(i), a) for i, a in enumerate(args)), *kwargs.items()):
            tensors = [a] if isinstance(a, Tensor) else _tensors(a)
            if not tensors:
                continue
            d = dims.argument(key)
            if d is not None and any(t.dim() <= d or t.shape[d] != n for t in tensors):
                calls.unbatched.add(key)

    def make_finite(self) -> None:
        """Every captured tensor holding an inf or a NaN replaced by a copy with those entries 0 (:mod:`.finite`):
        the ghost engine's second pass over a step where an example's gradient was not finite."""
        memo: dict[int, Any] = {}
        for calls in self._calls.values():
            for rec in calls.records:
                finite_fields(rec, memo)
            calls.reduced = finite_copy(calls.reduced, memo)
        self.roots.grads = finite_copy(self.roots.grads, memo)

    def completed(self) -> dict[int, LayerCalls]:
        """Layers with at least one call that received an output gradient (id(module) → calls)."""
        done = {}
        for key, calls in self._calls.items():
            recs = [r for r in calls.records if r.has_grad]
            if recs or calls.reduced:
                done[key] = LayerCalls(calls.name, calls.module, recs, dict(calls.reduced),
                                       list(calls.mismatches), calls.unbatched)
        return done

    def mismatched(self) -> dict[str, list[tuple[int, ...]]]:
        """Layer name → output shapes of this step's calls whose example dimension was wrong."""
        return {c.name: list(c.mismatches) for c in self._calls.values() if c.mismatches}

    def unserved(self) -> dict[str, list[tuple[int, ...]]]:
        """Layer name → output shapes of this step's lookups whose output was not only broadcast over the
        examples."""
        return {c.name: list(c.unserved) for c in self._calls.values() if c.unserved}

    def any_recorded(self) -> bool:
        """Whether any hooked layer saw a forward since the last :meth:`clear`."""
        return any(c.records for c in self._calls.values())

    def clear(self) -> None:
        """Drop every captured tensor and end the step (called after each step): a forward after it is
        not checked against, or broadcast to, the finished step's batch size."""
        self.expected = None
        self._params.clear()
        self._inputs.clear()
        self._feeding.clear()
        self._flattened.clear()
        self._anchors.clear()
        self._layouts.clear()
        self._close_sites()
        self.roots.clear()
        for calls in self._calls.values():
            calls.records.clear()
            calls.reduced.clear()
            calls.mismatches.clear()
            calls.unserved.clear()
            calls.generation += 1

    def detach(self) -> None:
        """Remove the hooks and captured tensors."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._close_sites()
        self._calls.clear()
        self.roots.detach()
        self.expected = None
