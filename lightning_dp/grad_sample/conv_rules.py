"""Convolutions of any dimension, plain and transposed: per-example norms and clipped sums in closed form.

Serves ``nn.Conv1d/2d/3d`` (any stride, dilation, groups, padding — numbers, ``'same'``, ``'valid'`` — and padding
mode) and ``nn.ConvTranspose1d/2d/3d`` (any stride, padding, output_padding or ``output_size``, dilation, groups),
and subclasses that keep torch's forward.

**Convolution.** A convolution is a Linear map on patches. With g groups, group γ's weight W_γ ∈ R^{O/g × (C/g)·K}
(K = the product of the kernel sizes) sees at output position t the patch a_{γ,t} ∈ R^{(C/g)·K} of its C/g input
channels (the input padded as the layer pads it), and receives there the output gradient δ_{γ,t} ∈ R^{O/g} of the
mean loss. Example i's gradient is G_{i,γ} = n Σ_t δ_{i,γ,t} a_{i,γ,t}ᵀ, so the Linear layer's ghost norm (Li et al.
2022, "Large language models can be strong differentially private learners", §4) and book-keeping (Bu et al. 2023)
hold group by group:

    ‖G_i‖² = n² Σ_γ Σ_{t,t'} (a_{i,γ,t}·a_{i,γ,t'}) (δ_{i,γ,t}·δ_{i,γ,t'})    cost n·T²·(C·K + O)
    ‖G_i‖² = ‖G_i‖² of the materialised G_i = n Σ_t δ_{i,t} a_{i,t}ᵀ        cost n·T·C·K·O/g, whichever is cheaper
    Σ_i c_i G_i = the batch's weight gradient for the output gradient c ⊙ δ     one convolution backward

**Transposed convolution.** y = conv_transpose(x, W) is the adjoint of the convolution conv(·, W) with the same
stride s, padding p, dilation d and groups, mapping the output's channels back to the input's: in one dimension
y[o, s·j + d·κ − p] += Σ_c x[c, j] W[c, o, κ], so ⟨y, δ⟩ = ⟨x, conv(δ, W)⟩ and

    ∂⟨y, δ⟩/∂W[c, o, κ] = Σ_j x[c, j] · δ[o, s·j + d·κ − p] = Σ_j x[c, j] · P(δ)[(o, κ), j]

with P(δ) the patches of δ (zero-padded by p, stride s, dilation d) at the input's positions j (an output_padding
adds output rows that no such patch reaches: the patches are cut to the input's positions). That is the convolution
rule with the roles exchanged: patches of δ are the columns, the input x the rows, and W ∈ R^{C_in × C_out/g × K} is
laid out as a convolution's [O, I/g, K] with O = C_in. The clipped sum is one transposed-convolution backward of c ⊙ δ.

Both: the bias's gradient is n Σ_t δ_{i,t}. A call on flattened examples (``[n·k, C, …]``, recorded ``[n, k, C, …]``)
has example i's k frames as its positions side by side. Patch columns are unfolded a few examples at a time
(:func:`example_chunks`), never much more than the layer's inputs in size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.capture.own_tensors import own
from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.layer_stats import (
    LayerStats,
    WeightBiasStats,
    add_parts,
    gram_sq_norms,
    prefer_ghost,
    sq_norms,
)
from lightning_dp.grad_sample.rules import LayerRule, register_rule

CONVOLUTIONS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED: tuple[type[nn.Module], ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class ConvGeometry:
    """What the patches of one convolution layer depend on.

    ``pads``: the padding of the patches' source in ``F.pad`` order (last spatial dimension first, left then right):
    the layer's own padding for a convolution (``'same'`` split as torch splits it), p on both sides of δ for a
    transposed one; ``mode``: ``F.pad``'s mode (``'constant'`` for zeros)."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool
    pads: tuple[int, ...]
    mode: str

    @property
    def dims(self) -> int:
        """Number of spatial dimensions."""
        return len(self.kernel)

    def symmetric(self) -> Optional[tuple[int, ...]]:
        """Per spatial dimension, the zero padding when it is the same on both sides (a convolution can take it as its
        ``padding`` argument), else None."""
        left, right = self.pads[0::2][::-1], self.pads[1::2][::-1]
        return tuple(left) if self.mode == "constant" and left == right else None


def geometry(m: nn.Module) -> ConvGeometry:
    """The :class:`ConvGeometry` of a served convolution or transposed convolution ``m`` (one per distinct
    configuration, :func:`_geometry_of`: read every step, built once)."""
    return _geometry_of(tuple(m.kernel_size), tuple(m.stride), m.padding if isinstance(m.padding, str)
                        else tuple(m.padding), tuple(m.dilation), m.groups, m.padding_mode, isinstance(m, TRANSPOSED))


@functools.lru_cache(maxsize=256)
def _geometry_of(kernel: tuple[int, ...], stride: tuple[int, ...], padding, dilation: tuple[int, ...], groups: int,
                 padding_mode: str, transposed: bool) -> ConvGeometry:
    d = len(kernel)
    if isinstance(padding, str):
        totals = [dl * (k - 1) for k, dl in zip(kernel, dilation)] if padding == "same" else [0] * d
        sides = [(t // 2, t - t // 2) for t in totals]  # torch's split of 'same' (the larger half after)
    else:
        sides = [(p, p) for p in padding]
    pads = tuple(v for left, right in reversed(sides) for v in (left, right))
    mode = "constant" if padding_mode == "zeros" else padding_mode
    return ConvGeometry(kernel, stride, dilation, groups, transposed, pads, mode)


def frames(t: Tensor, dims: int) -> Tensor:
    """A call's ``[n, C, *spatial]`` tensor, or the ``[n·k, C, *spatial]`` frames of one on flattened examples."""
    return t if t.dim() == dims + 2 else t.flatten(0, 1)


def patch_columns(src: Tensor, geom: ConvGeometry, positions: Sequence[int]) -> Tensor:
    """Patches of ``src`` ``[m, C, *spatial]`` as columns ``[m, C·K, L]`` (rows in the weight's (C, k_1, …, k_d)
    order; L = ∏ ``positions``, the first ``positions[j]`` windows along spatial dimension j).

    The padded source is unfolded as a strided view (a dilation d takes every d-th element of a window d·(k−1)+1
    wide) and copied once in its (C, k…, o…) order, whose innermost rows are contiguous output positions: on CPU much
    faster than an im2col or a token-major copy."""
    if any(geom.pads):
        src = F.pad(src, geom.pads, mode=geom.mode)
    view, d = src, geom.dims
    for j, (k, s, dl) in enumerate(zip(geom.kernel, geom.stride, geom.dilation)):
        view = view.unfold(2 + j, dl * (k - 1) + 1, s)
        if dl > 1:
            view = view[..., ::dl]
        view = view.narrow(2 + j, 0, positions[j])
    m, c = src.shape[:2]
    order = (0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d))  # [m, C, o…, k…] → [m, C, k…, o…]
    return view.permute(order).reshape(m, c * math.prod(geom.kernel), math.prod(positions))


def columns(src: Tensor, geom: ConvGeometry, positions: Sequence[int]) -> Tensor:
    """:func:`patch_columns` of one call, ``[n, C·K, L]``; on flattened examples (``[n, k, C, …]``) example i's k
    frames' columns side by side, ``[n, C·K, k·L]`` (frame-major, as :func:`positions_of`)."""
    if src.dim() == geom.dims + 2:
        return patch_columns(src, geom, positions)
    n, k = src.shape[:2]
    cols = patch_columns(src.flatten(0, 1), geom, positions)
    return cols.view(n, k, *cols.shape[1:]).transpose(1, 2).reshape(n, cols.shape[1], -1)


def positions_of(t: Tensor, dims: int) -> Tensor:
    """One call's ``[n, C, *spatial]`` (or flattened examples' ``[n, k, C, *spatial]``) tensor as ``[n, C, positions]``
    (the k frames' positions one after another, as :func:`columns`)."""
    return t.flatten(2) if t.dim() == dims + 2 else t.transpose(1, 2).flatten(2)


_MIN_PATCH_CHUNK = 1 << 16  # elements: CPU patch chunks may always be this large (256 KiB)
_MIN_PATCH_CHUNK_ACCELERATOR = 1 << 22  # 16 MiB: on a GPU each chunk costs kernel launches


def example_chunks(n: int, per_example: int, budget: int, device_type: str = "cpu") -> list[slice]:
    """Slices of the n examples such that each chunk's patch columns (``per_example``
    elements per example) fit in max(``budget``, floor) elements; the caller passes the size of
    the layer's inputs, so unfolding never more than matches the activations it reads. The
    floor is 2¹⁶ elements on CPU and 2²² on accelerators, where fewer, larger chunks save
    kernel launches."""
    floor = _MIN_PATCH_CHUNK if device_type == "cpu" else _MIN_PATCH_CHUNK_ACCELERATOR
    size = max(1, max(budget, floor) // max(per_example, 1))
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _as_float(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype) if t.dtype != like.dtype else t


class ConvPatches:
    """One layer's calls in patch form: per call the patches' source (x; δ for a transposed convolution), the rows'
    source (δ; x) and the output gradient δ, in the weight's dtype (module docstring)."""

    def __init__(self, m: nn.Module, records: Sequence) -> None:
        self.m, self.geom = m, geometry(m)
        self.weight = like = own(m, "weight")  # the engine's own read (own_tensors.py)
        self.calls = [(_as_float(r.args[0], like), _as_float(r.grad_out, like)) for r in records]
        t = self.geom.transposed
        self.pairs = [(d, x) if t else (x, d) for x, d in self.calls]  # (columns' source, rows' source)
        self.n = self.calls[0][1].shape[0]
        self.out_g = like.shape[0] // self.geom.groups  # rows per group (O/g; C_in/g when transposed)
        self.in_g = like.shape[1:].numel()  # columns per group ((C/g)·K; (C_out/g)·K when transposed)
        dims = self.geom.dims  # positions per call (as positions_of lays them out), from the shapes alone
        self.T = sum(math.prod(r.shape[2:]) if r.dim() == dims + 2 else r.shape[1] * math.prod(r.shape[3:])
                     for _, r in self.pairs)

    def chunks(self) -> list[slice]:
        """Example chunks whose patch columns stay within the size of the columns' sources (:func:`example_chunks`)."""
        budget = sum(s.numel() for s, _ in self.pairs)
        per_example = self.in_g * self.geom.groups * self.T
        return example_chunks(self.n, per_example, budget, self.calls[0][0].device.type)

    def _grouped(self, part: slice) -> Iterator[tuple[Tensor, Tensor]]:
        """Per call, the chunk's columns ``[k·g, in_g, L]`` and rows ``[k·g, out_g, L]``."""
        g, dims = self.geom.groups, self.geom.dims
        for src, rows in self.pairs:
            rows = rows[part]
            spatial = rows.shape[-dims:]
            a = columns(src[part], self.geom, spatial)
            k, L = a.shape[0], a.shape[2]
            yield a.view(k * g, self.in_g, L), positions_of(rows, dims).reshape(k * g, self.out_g, L)

    def ghost_sq_norms(self, part: slice) -> Tensor:
        """Σ_γ Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') for the chunk's examples (the calls joined along positions)."""
        pairs = list(self._grouped(part))
        a = torch.cat([p[0] for p in pairs], 2) if len(pairs) > 1 else pairs[0][0]
        d = torch.cat([p[1] for p in pairs], 2) if len(pairs) > 1 else pairs[0][1]
        return gram_sq_norms(a.transpose(1, 2), d.transpose(1, 2)).view(-1, self.geom.groups).sum(1)

    def materialise(self) -> Tensor:
        """G_i = Σ_calls Σ_t δ_{i,t} a_{i,t}ᵀ, laid out as the weight: ``[n, *weight.shape]``; by one convolution
        backward per call with the examples as groups (:meth:`_examples_as_groups`: no patch columns), or for a
        depthwise layer by products over patch columns (:func:`by_patch_products`)."""
        if self.weight.shape[1] == 1 and self.geom.groups > 1:  # by_patch_products(self.m), its weight read once
            return self._patch_products()
        G = add_parts([self._examples_as_groups(x, d) for x, d in self.calls])
        return G.view(self.n, *self.weight.shape)

    def _patch_products(self) -> Tensor:
        """G_{i,γ} = δ_{i,γ} a_{i,γ}ᵀ: one batched product per chunk of examples and call (patch columns)."""
        g = self.geom.groups
        G = self.calls[0][1].new_empty(self.n * g, self.out_g, self.in_g)
        for part in self.chunks():
            rows = slice(part.start * g, part.stop * g)
            for i, (a, d) in enumerate(self._grouped(part)):  # β = 0 first: G's contents ignored
                G[rows].baddbmm_(d, a.transpose(1, 2), beta=float(i > 0))
        return G.view(self.n, *self.weight.shape)

    def _examples_as_groups(self, x: Tensor, d: Tensor) -> Tensor:
        """Every example's weight gradient ``[n·O, C/g, *K]`` at once: the call's n examples side by side as channels,
        ``[1, n·C, …]`` (a flattened call's k frames as its batch, ``[k, n·C, …]``), convolved with n·g groups, so
        that group (i, γ) sees example i's channels of group γ only and its weight gradient is G_{i,γ}."""
        geom, n = self.geom, self.n
        x, d = (x.transpose(0, 1), d.transpose(0, 1)) if x.dim() == geom.dims + 3 else (x[None], d[None])
        x, d = x.reshape(x.shape[0], -1, *x.shape[3:]), d.reshape(d.shape[0], -1, *d.shape[3:])
        padding, out_pad, x = self._conv_arguments(x, d)
        w = self.weight
        shape = (n * w.shape[0], *w.shape[1:])  # the weight of the n·g-group convolution: only its shape is read
        return torch.ops.aten.convolution_backward(  # zeros without writing them: one 0 expanded to the shape
            d, x, x.new_zeros(()).expand(shape), None, list(geom.stride), padding, list(geom.dilation), geom.transposed,
            out_pad, n * geom.groups, [False, True, False])[1]

    def _conv_arguments(self, x: Tensor, d: Tensor) -> tuple[list[int], list[int], Tensor]:
        """``padding`` and ``output_padding`` of the call as a convolution backward takes them, and its input (padded
        first where the layer pads otherwise than with zeros on both sides alike)."""
        geom, dims = self.geom, self.geom.dims
        if geom.transposed:
            return list(self.m.padding), output_padding(self.m, x, d), x
        padding = geom.symmetric()
        if padding is None:
            return [0] * dims, [0] * dims, F.pad(x, geom.pads, mode=geom.mode)
        return list(padding), [0] * dims, x

    def bias_grads(self) -> Tensor:
        """Σ_t δ_{i,t} per example, ``[n, O]``."""
        dims = self.geom.dims  # positions_of(d, dims).sum(2), without its view: every dimension after the channels'
        return add_parts([d.sum(tuple(range(2, d.dim())) if d.dim() == dims + 2 else (1, *range(3, d.dim())))
                          for _, d in self.calls])

    def weight_sum(self, c: Tensor) -> Tensor:
        """Σ_i c_i G_i: the batch's weight gradient for output gradient c ⊙ δ, one (transposed) convolution backward
        per call (Bu et al.'s book-keeping)."""
        return add_parts([self._weight_grad(x, d * c.view(-1, *[1] * (d.dim() - 1))) for x, d in self.calls])

    def _weight_grad(self, x: Tensor, d: Tensor) -> Tensor:
        geom = self.geom
        x, d = frames(x, geom.dims), frames(d, geom.dims)
        padding, out_pad, x = self._conv_arguments(x, d)
        return torch.ops.aten.convolution_backward(
            d, x, x.new_zeros(()).expand(self.weight.shape), None, list(geom.stride), padding, list(geom.dilation),
            geom.transposed, out_pad, geom.groups, [False, True, False])[1]


def output_padding(m: nn.Module, x: Tensor, y: Tensor) -> list[int]:
    """The output_padding a transposed convolution's call used, from its input and output sizes (``output_size``
    included): L_out − ((L_in − 1)·s − 2p + d·(k − 1) + 1) per spatial dimension."""
    dims = len(m.kernel_size)
    return [y.shape[-dims + j] - ((x.shape[-dims + j] - 1) * s - 2 * p + dl * (k - 1) + 1)
            for j, (k, s, p, dl) in enumerate(zip(m.kernel_size, m.stride, m.padding, m.dilation))]


def by_patch_products(m: nn.Module) -> bool:
    """Materialise a depthwise layer's per-example gradients (one channel of the columns' source per group) by
    products over patch columns: as a convolution with the examples as groups it would have n·C groups of one
    channel, which CPU backends run group by group (2–3× slower, measured on Conv1d/Conv2d, 32 examples). Every other
    layer takes that convolution (1.4–2.5× faster than the products: no patch columns to copy)."""
    return own(m, "weight").shape[1] == 1 and m.groups > 1


def prefer_conv_ghost(T: int, d_in: int, d_out: int) -> bool:
    """The ghost norm for a convolution group of ``d_in`` columns and ``d_out`` rows at T positions
    (:func:`~.layer_stats.prefer_ghost`: T·(in + out) < in·out)."""
    return prefer_ghost(T, d_in, d_out)


class ConvStats(WeightBiasStats):
    """A served convolution's per-example squared norms (ghost or materialised, whichever is cheaper) and clipped
    sums (c·G, or one convolution backward of c ⊙ δ); module docstring."""

    def __init__(self, patches: ConvPatches, k: float, weight: Optional[Tensor], bias: Optional[Tensor],
                 scale: Optional[ParamMap], with_squares: bool) -> None:
        self.patches, self.k, self.weight, self.bias = patches, k, weight, bias
        self.sw = None if scale is None or weight is None else scale[weight]
        self.G: Optional[Tensor] = None
        sq: Optional[Tensor] = None  # 0 + x is x: the first part is taken as it is
        if weight is not None:
            self.weight_sq = sq = self._weight_sq_norms(with_squares)
        if bias is not None:
            db = patches.bias_grads()
            self.db = db if scale is None else db * scale[bias]
            sq = self.db.pow(2).sum(1) if sq is None else sq + self.db.pow(2).sum(1)
        self.sq_norms = (patches.calls[0][1].new_zeros(patches.n) if sq is None else sq) * (k * k)

    def _weight_sq_norms(self, with_squares: bool) -> Tensor:
        p = self.patches
        if self.sw is None and not with_squares and prefer_conv_ghost(p.T, p.in_g, p.out_g):
            return torch.cat([p.ghost_sq_norms(part) for part in p.chunks()])
        G = p.materialise()
        self.G = G if self.sw is None else G * self.sw
        return sq_norms(self.G)

    def _bookkept_weight_sum(self, c: Tensor) -> Tensor:
        return self.patches.weight_sum(c)


class _ConvInputGradOnly(torch.autograd.Function):
    """A convolution (plain or transposed, any dimension) whose backward computes only the input gradient: the
    weight and bias gradients come from :class:`ConvStats` (book-keeping), not from the ordinary backward. For a call
    whose input does not require grad (a first layer); any other call takes torch's own convolution on the detached
    weight and bias (:func:`_conv_forward`: the same values, without this Function's Python dispatch)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], conf: tuple) -> Tensor:
        stride, padding, dilation, transposed, out_pad, groups = conf
        ctx.save_for_backward(x, weight)
        ctx.conf = conf
        dims = weight.dim() - 2
        if transposed:
            return _CONV_TRANSPOSE_FN[dims](x, weight, bias, stride, padding, out_pad, groups, dilation)
        return _CONV_FN[dims](x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            stride, padding, dilation, transposed, out_pad, groups = ctx.conf
            gx = torch.ops.aten.convolution_backward(
                g, x, weight.to(g.dtype), None, list(stride), list(padding), list(dilation), transposed,
                list(out_pad), groups, [True, False, False])[0].to(x.dtype)
        return gx, None, None, None


def _replayed_or_unbatched(m: nn.Module, x: Tensor) -> bool:
    """Calls that keep the module's own forward: a replay inside torch.func, an unbatched input."""
    return torch._C._are_functorch_transforms_active() or x.dim() != own(m, "weight").dim()


def _conv_forward(self: nn.Module, input: Tensor) -> Tensor:  # noqa: A002  (the module's own argument name)
    if _replayed_or_unbatched(self, input):
        return type(self).forward(self, input)
    geom = geometry(self)
    padding = geom.symmetric()
    if padding is None:  # reflect/replicate/circular, or an asymmetric 'same': padded first, as the module does
        input, padding = F.pad(input, geom.pads, mode=geom.mode), (0,) * geom.dims
    weight, bias = own(self, "weight"), own(self, "bias")  # read as self.weight, self.bias (own_tensors.py)
    if input.requires_grad:  # torch's own convolution on the parameters detached: its backward is the input gradient
        bias = None if bias is None else bias.detach()
        return _CONV_FN[geom.dims](input, weight.detach(), bias, self.stride, padding, self.dilation, self.groups)
    conf = (self.stride, padding, self.dilation, False, (0,) * geom.dims, self.groups)
    return _ConvInputGradOnly.apply(input, weight, bias, conf)


def _conv_transpose_forward(self: nn.Module, input: Tensor,  # noqa: A002  (the module's own argument name)
                            output_size: Optional[list[int]] = None) -> Tensor:
    if _replayed_or_unbatched(self, input):
        return type(self).forward(self, input, output_size)
    dims = len(self.kernel_size)
    out_pad = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size, dims,
                                   self.dilation)
    if input.requires_grad:  # as _conv_forward: torch's own transposed convolution on the detached parameters
        bias = None if self.bias is None else self.bias.detach()
        return _CONV_TRANSPOSE_FN[dims](input, self.weight.detach(), bias, self.stride, self.padding, out_pad,
                                        self.groups, self.dilation)
    conf = (self.stride, self.padding, self.dilation, True, tuple(out_pad), self.groups)
    return _ConvInputGradOnly.apply(input, self.weight, self.bias, conf)


def _base_class(m: nn.Module) -> Optional[type[nn.Module]]:
    return _base_of(type(m))


@functools.lru_cache(maxsize=None)
def _base_of(kind: type) -> Optional[type[nn.Module]]:
    """The torch convolution class ``kind`` is or derives from (by class: asked of every layer, every step)."""
    return next((c for c in CONVOLUTIONS + TRANSPOSED if issubclass(kind, c)), None)


@register_rule
class ConvRule(LayerRule):
    """``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` (module docstring)."""

    name = "conv"

    def serves(self, m: nn.Module) -> bool:
        """torch's convolutions and subclasses keeping their forward (timm's weight-standardising StdConv2d does not:
        its per-example gradients are not δ aᵀ)."""
        base = _base_class(m)
        if base is None or type(m).forward is not base.forward:
            return False
        return base in TRANSPOSED or type(m)._conv_forward is base._conv_forward

    def closed_form(self, m: nn.Module) -> bool:
        """Under FSDP2 only the convolutions of :func:`sharding_served`."""
        return sharding_served(m)

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """Ghost norm or materialised G, whichever is cheaper; book-keeping sums (:class:`ConvStats`)."""
        patches = ConvPatches(calls.module, calls.records)
        return ConvStats(patches, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares)

    def dense(self, calls: LayerCalls, wanted: dict[str, Tensor],
              n: int) -> Optional[list[tuple[Tensor, Tensor, float]]]:
        """G_i and the bias's Σ_t δ_{i,t} (× n) where :class:`ConvStats` would materialise G (the ghost norm not
        cheaper), else None."""
        patches = ConvPatches(calls.module, calls.records)
        weight, bias = wanted.get("weight"), wanted.get("bias")
        if weight is not None and prefer_conv_ghost(patches.T, patches.in_g, patches.out_g):
            return None
        out = [] if weight is None else [(weight, patches.materialise(), float(n))]
        return out if bias is None else [*out, (bias, patches.bias_grads(), float(n))]

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """Materialised: G_i by one batched product over patches, the bias's Σ_t δ_{i,t} (both × n)."""
        patches = ConvPatches(calls.module, calls.records)
        with torch.no_grad():
            return {key: (patches.materialise() if key == "weight" else patches.bias_grads()) * n for key, _ in wanted}

    def input_grad_only_forward(self, m: nn.Module) -> Optional[Callable]:
        """torch's own classes (not subclasses): a forward whose backward skips the weight and bias gradients."""
        if type(m) in CONVOLUTIONS:
            return _conv_forward
        return _conv_transpose_forward if type(m) in TRANSPOSED else None


def sharding_served(m: nn.Module) -> bool:
    """The convolutions the ghost engine served under FSDP2 before this rule (``nn.Conv2d``-like, groups 1, zero
    numeric padding; :meth:`ConvRule.closed_form`, read by :func:`~.ghost.has_closed_form`). The rule's other forms
    are not tested under sharding and keep being refused there."""
    return (ConvRule().serves(m) and isinstance(m, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros"
            and not isinstance(m.padding, str))
