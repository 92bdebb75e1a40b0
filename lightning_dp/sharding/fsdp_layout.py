"""Where FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps a model's parameters, as the mechanism sees it.

Under FSDP2 every parameter of a sharded module is a ``DTensor`` placed ``Shard(0)`` on a 1-D
data-parallel mesh of W ranks: rank r holds rows [r·c, (r+1)·c) of the full tensor, c = ⌈rows/W⌉
(``torch.chunk``'s split; trailing ranks may hold fewer rows, or none). For each module's forward and
backward FSDP2 all-gathers the full ("unsharded") parameter into a separate leaf tensor, swaps it into
the module, and swaps the sharded ``DTensor`` back afterwards. What that means for the private step
(docs/algorithms.md, "The mechanism"):

- The per-example engine's captured activations and output gradients are full-size, so its per-example
  norms are whole-model norms, and its clipped sums Σ_i clip_C(g_i) are full-size tensors, keyed by
  the sharded parameters (the modules' attributes again when the sums are taken, after backward).
  :class:`~lightning_dp.sharding.privatizer.ShardedPrivatizer` reduce-scatters them into
  the shards (:meth:`FSDPLayout.rows`).
- FSDP2's own gradient reduce-scatter would communicate the autograd (unclipped, non-private)
  gradient of every parameter that has one: the ghost engine leaves Linear/Conv2d weights without
  one, but embeddings and normalisation layers get one. :meth:`FSDPLayout.seal` switches FSDP2's
  gradient reduction off for every sharded module, and :meth:`FSDPLayout.drop_autograd_grads`
  discards those gradients (as soon as they accumulate, from the first release on). The only
  collective that carries gradient information is the privatizer's reduce-scatter of clipped sums.
- The first step's probe compares the engine's sums with autograd's gradient, which exists only
  for the unsharded leaves: :meth:`FSDPLayout.autograd_params`.

The unsharded leaves are read from FSDP2's per-module state (``_get_fsdp_state``); torch creates
each once and reuses it for every later all-gather. Only that much of FSDP2's internals is read,
here and nowhere else.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, TypeVar

from torch import Tensor, nn

from lightning_dp._lazy import lazy_exports
from lightning_dp.errors import PrivacyConfigurationError


class Scaled(Protocol):
    """What :meth:`FSDPLayout.full_request` reads of a :class:`~lightning_dp.privacy.release.MechanismRequest` (a
    dataclass with a per-coordinate ``scale``), named by its shape so that this module needs nothing of the core."""

    scale: Optional[Mapping[Tensor, Tensor]]


R = TypeVar("R", bound=Scaled)


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to (FSDP2's ``FSDPModule``), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FSDPLayout:
    """The trainable parameters of ``module``, sharded by FSDP2 over one 1-D data-parallel mesh.

    Raises :class:`PrivacyConfigurationError` naming the fix when the layout is not one the sharded
    mechanism serves: nothing sharded, a trainable parameter left unsharded (its replicas would drift
    apart), tensor parallelism / HSDP / a custom ``shard_placement_fn`` (not ``Shard(0)`` on a 1-D
    mesh), or ``fully_shard`` applied to a leaf layer (the engine recognises layers by their class;
    FSDP2 replaces it).
    """

    def __init__(self, module: nn.Module, engine_problems: Callable[[nn.Module], list[str]] = lambda m: []) -> None:
        """Check ``module``'s sharding (and, by ``engine_problems``, what the engine cannot serve sharded: the
        strategy passes :func:`lightning_dp.grad_sample.fsdp_support.engine_problems`); refused naming each problem."""
        from torch.distributed.tensor import DTensor, Shard

        self.module = module
        self.modules = fsdp_modules(module)
        if not self.modules:
            raise PrivacyConfigurationError(
                "DPShardedStrategy found no module sharded by FSDP2: call "
                "torch.distributed.fsdp.fully_shard(block, mesh=self.device_mesh['data_parallel']) on each block and "
                "then on the root module in your LightningModule's configure_model (see docs/distributed.md, Sharded "
                "training).")
        problems = []
        mesh = None
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor):
                problems.append(f"trainable parameter {name} is not sharded: apply fully_shard to the root module too "
                                "(it takes every parameter no inner fully_shard took)")
            elif p.dim() == 0:
                problems.append(f"trainable parameter {name} is a scalar: FSDP2 cannot shard it by rows; make it a "
                                "tensor of shape [1]")
            elif p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                problems.append(f"parameter {name} is placed {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh: "
                                "only FSDP2's default Shard(0) over a 1-D data-parallel mesh is supported (no tensor "
                                "parallelism, no HSDP, no shard_placement_fn)")
            elif mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                problems.append(f"parameter {name} is sharded over another mesh than the other parameters")
        for name, m in module.named_modules():
            if m in self.modules and not any(True for _ in m.children()):
                problems.append(f"fully_shard was applied to the leaf layer {name or '<root>'} "
                                f"({layer_class(m).__name__}): apply it to the blocks that contain such layers "
                                "(e.g. each transformer block) and to the root module")
        problems += engine_problems(module)
        if problems:
            raise PrivacyConfigurationError("The model's sharding cannot be trained privately:\n- "
                                            + "\n- ".join(problems))
        if mesh is None:
            raise PrivacyConfigurationError("DPShardedStrategy: the model has no trainable parameter.")
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = int(mesh.get_local_rank())
        self.world_size = int(mesh.size())
        self._hooked: set[int] = set()
        self._sealed: Optional[Any] = None

    # ------------------------------------------------------------------ FSDP2 state
    def _fsdp_params(self) -> Iterator[Any]:
        """FSDP2's per-parameter records (``FSDPParam``) of every sharded module."""
        for m in self.modules:
            for group in _param_groups(m):
                yield from group.fsdp_params

    def sharded_parameters(self) -> list[tuple[str, Tensor]]:
        """(name, sharded parameter) of every sharded parameter: what the module holds between steps, whichever of
        the sharded and all-gathered tensors it holds now (the release boundary fingerprints these)."""
        names = {id(m): name for name, m in self.module.named_modules()}
        out = []
        for fp in self._fsdp_params():
            info = fp._module_info
            prefix = names.get(id(info.module), "")
            out.append((f"{prefix}.{info.param_name}" if prefix else info.param_name, fp.sharded_param))
        return out

    def seal(self) -> None:
        """Switch FSDP2's gradient reduce-scatter (and HSDP all-reduce) off for every sharded module, and
        from the end of the first forward on drop every autograd gradient of an unsharded leaf as it
        accumulates (FSDP2 creates the leaves in that forward): two locks on one door."""
        for m in self.modules:
            m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        if self._sealed is None:
            self._sealed = self.module.register_forward_hook(lambda *_: self._hook_leaves())

    def _hook_leaves(self) -> None:
        for fp in self._fsdp_params():
            u: Optional[nn.Parameter] = getattr(fp, "_unsharded_param", None)
            if u is not None and id(u) not in self._hooked and u.requires_grad:
                u.register_post_accumulate_grad_hook(_drop_grad)
                self._hooked.add(id(u))

    def reshard(self) -> None:
        """Free every all-gathered parameter, so that each module holds its sharded parameters again. FSDP2
        keeps the root's parameters unsharded after a forward without backward (validation, the sanity
        check): the private step must begin from the sharded state its parameter map is keyed by."""
        for m in self.modules:
            m.reshard()  # type: ignore[operator]

    def unseal(self) -> None:
        """Remove the forward hook of :meth:`seal` (FSDP2's gradient sync stays off; the leaves' hooks stay)."""
        if self._sealed is not None:
            self._sealed.remove()
            self._sealed = None

    def check_sealed(self) -> None:
        """Raise if anything switched FSDP2's gradient reduction back on (it would send unclipped gradients)."""
        for m in self.modules:
            if any(g.reduce_grads or getattr(g, "all_reduce_grads", False) for g in _param_groups(m)):
                raise PrivacyConfigurationError(
                    f"FSDP2 gradient synchronisation was switched back on for {type(m).__name__} "
                    "(set_requires_gradient_sync(True)): it reduce-scatters unclipped gradients, which is not "
                    "private. Do not call set_requires_gradient_sync under DPShardedStrategy.")

    def autograd_params(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The leaves autograd differentiates for each of the sharded ``params`` (the unsharded parameters;
        a parameter FSDP2 has not all-gathered yet is returned as is)."""
        unsharded = {id(fp.sharded_param): getattr(fp, "_unsharded_param", None) for fp in self._fsdp_params()}
        out = []
        for p in params:
            u = unsharded.get(id(p))
            out.append(p if u is None else u)
        return out

    def full_request(self, request: R) -> R:
        """``request`` with its per-coordinate scale (scale-then-privatize, docs/algorithms.md §4) gathered to full
        size: the scale is computed from the optimizer's sharded state, while the engine scales each example's
        whole gradient before clipping. The scale depends only on earlier releases (public): gathering it is
        post-processing. A collective every rank joins."""
        from torch.distributed.tensor import DTensor

        if request.scale is None:
            return request
        scale = {p: s.full_tensor() if isinstance(s, DTensor) else s for p, s in request.scale.items()}
        return replace(request, scale=scale)

    def drop_autograd_grads(self) -> None:
        """Discard the autograd gradients the unsharded leaves hold now (the clipped sums replace them) and
        hook any leaf not hooked yet, so that from now on none is kept (see :meth:`seal`)."""
        for fp in self._fsdp_params():
            u: Optional[nn.Parameter] = getattr(fp, "_unsharded_param", None)
            if u is not None:
                u.grad = None
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                fp.unsharded_accumulated_grad = None
        self._hook_leaves()

    # ------------------------------------------------------------------ shard geometry
    def rows(self, p: Tensor, rank: Optional[int] = None) -> tuple[int, int, int]:
        """(start, stop, c) of the rows of ``p``'s dimension 0 that ``rank`` (default: this rank) holds,
        c = ⌈rows/W⌉ the padded rows per rank; checked against the local shard for this rank."""
        r = self.rank if rank is None else rank
        total = p.shape[0]
        c = -(-total // self.world_size)
        start, stop = min(r * c, total), min((r + 1) * c, total)
        if rank is None:
            local = p.to_local().shape[0]  # type: ignore[attr-defined]
            if local != stop - start:
                raise RuntimeError(f"FSDP2 shard of a parameter of shape {tuple(p.shape)} has {local} rows on rank "
                                   f"{r}; the chunked layout predicts {stop - start}")
        return start, stop, c

    def as_sharded_grad(self, local: Tensor, p: Tensor) -> Tensor:
        """The local shard ``local`` of a gradient of ``p``, as a ``DTensor`` laid out like ``p``."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=p.shape, stride=p.stride())


def layer_class(m: nn.Module) -> type:
    """``m``'s own class (``fully_shard`` gives a module a subclass ``FSDP<Class>`` of FSDPModule and it)."""
    from torch.distributed.fsdp import FSDPModule

    return type(m).__bases__[-1] if isinstance(m, FSDPModule) else type(m)


def _param_groups(m: nn.Module) -> list[Any]:
    """FSDP2's parameter groups (``FSDPParamGroup``) of one sharded module."""
    state = m._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10 keeps at most one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _drop_grad(p: Tensor) -> None:
    p.grad = None


def local_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a ``DTensor`` counts its local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


__all__ = ["FSDPLayout", "fsdp_modules", "layer_class", "local_bytes"]


__getattr__ = lazy_exports(__name__, {
    "engine_problems": "lightning_dp.grad_sample.fsdp_support"
})
"""Names this module held before they moved (read access by the old name; new code imports their homes)."""
