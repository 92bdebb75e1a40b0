"""Proven, not assumed: which dimension of a tensor holds the step's examples, read from autograd's record.

Per-example clipping must know, at every layer call, which rows are example i's. The capture trusts dimension 0 when
it holds the sampler's count n (:mod:`.example_dim`); two layouts published code uses around torch's time-major modules
need more than a count, because a dimension of size n elsewhere can be anything (a [T, B, d] tensor with T = B, a
feature dimension of size n):

- **time-major** ``[T, B, …]``: a tutorial ViT's ``LayerNorm``/``Linear`` around ``nn.MultiheadAttention(batch_first=
  False)``, called on ``x.transpose(0, 1)`` of a batch-first tensor or on the attention's output;
- **example-minor rows** ``[c·B, …]`` made by a reshape of ``[c, B, …]`` (a dual-path separator stacks its
  speakers, ``torch.stack(chunks, 0).view(spks·B, N, L)``, and runs a ``Conv1d`` on the rows): example b owns rows
  b, B + b, 2B + b, …

:func:`examples_in` proves (or disproves) that a given dimension holds the examples by walking autograd's record back
from the tensor, tracking that dimension through operations whose effect on it is known — pointwise operations
(broadcasting included: an operand of size 1 there holds no examples and is not followed), casts and clones,
transposes and permutes, reshapes that keep every dimension up to the tracked one, slicing, selecting, concatenating
or stacking along another dimension, expansion — to the nearest output of a hooked layer whose example dimension is
known (``layout(node)``: the capture's record of this step's calls: 0 for a batch-first layer on the n examples, 1
for a time-major attention or RNN output, ...). Reaching one with the examples in the tracked dimension is the proof;
reaching one with them elsewhere is the disproof; anything else (data without a record, an operation not listed, more
than :data:`WALK` nodes) decides nothing, and the capture then keeps its refusal. Where the walk decides nothing, a
permuted view of the data itself (a tensor without a history: ``x.t()`` of the collated batch, or of an input that
requires grad) is proven by the strides: they say where the base's dimension 0, the n examples, went. The same trust
as the capture's own check, no more: a dimension of size n whose walk ends at a layer output (or the data) with the n
examples in that dimension.

Which examples interact is not this module's concern (the first step's probe compares each example alone with the
batch); it only says where the examples are.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from lightning_dp.validators.example_dim import _RESHAPES, _step_back

Layout = Callable[[Any], Optional[int]]
"""Autograd node of a hooked layer's output in this step → the dimension holding the examples there (``None``: not a
layer output; :data:`ROWS`: the output of a call on flattened rows, whose examples are not one dimension)."""

ROWS = -1
"""What :data:`Layout` says of a layer output whose dimension 0 holds flattened examples' rows (n·m, example-major)."""

WALK = 64
"""Autograd nodes visited at most from the tensor before the walk decides nothing."""

POINTWISE = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1", "DivBackward0",
    "DivBackward1", "NegBackward0", "TanhBackward0", "SigmoidBackward0", "ReluBackward0", "ThresholdBackward0",
    "GeluBackward0", "SiluBackward0", "EluBackward0", "LeakyReluBackward0", "HardtanhBackward0", "SoftplusBackward0",
    "HardswishBackward0", "HardsigmoidBackward0", "MishBackward0", "ExpBackward0", "LogBackward0", "PowBackward0",
    "PowBackward1", "SqrtBackward0", "RsqrtBackward0", "AbsBackward0", "NativeDropoutBackward0", "CloneBackward0",
    "ToCopyBackward0", "AliasBackward0", "AddcmulBackward0", "AddcdivBackward0", "WhereBackward0", "ClampBackward1",
    "ClampMinBackward0", "ClampMaxBackward0", "LogSigmoidBackward0", "ErfBackward0", "SinBackward0", "CosBackward0",
})
"""Autograd nodes of elementwise operations: the value at an index depends only on the operands at that index (after
broadcasting), so a dimension keeps its meaning through them."""


def examples_in(t: Tensor, dim: int, n: int, layout: Layout) -> Optional[bool]:
    """Whether dimension ``dim`` of ``t`` holds the step's ``n`` examples: ``True`` proven, ``False`` disproven,
    ``None`` undecided (module docstring)."""
    if t.dim() <= dim or t.shape[dim] != n:
        return False
    verdict = None if t.grad_fn is None else walk(t.grad_fn, tuple(t.shape), dim, layout)
    if verdict is None and t._base is not None and t._base.grad_fn is None:  # a permuted view of the data itself
        found = view_dim_of_examples(t, n)
        verdict = None if found is None else found == dim
    return verdict


def view_dim_of_examples(t: Tensor, n: int) -> Optional[int]:
    """For a view ``t`` whose base has the n examples in dimension 0, the dimension of ``t`` they are in, when ``t`` is
    a permutation of the base's dimensions (same storage offset, the same (size, stride) pairs); else ``None``."""
    base = t._base
    if base is None or base.dim() != t.dim() or base.dim() < 2 or base.shape[0] != n:
        return None
    if t.storage_offset() != base.storage_offset():
        return None
    if sorted(zip(t.shape, t.stride())) != sorted(zip(base.shape, base.stride())):
        return None
    key = (base.shape[0], base.stride(0))
    hits = [k for k in range(t.dim()) if (t.shape[k], t.stride(k)) == key]
    return hits[0] if len(hits) == 1 else None


def walk(node: Any, shape: Sequence[Optional[int]], dim: int, layout: Layout) -> Optional[bool]:
    """Breadth first from ``node`` (whose output has ``shape``), tracking dimension ``dim``: the verdict of the nearest
    layer output (:data:`Layout`), or ``None``."""
    todo = deque([(node, list(shape), dim)])
    for _ in range(WALK):
        if not todo:
            return None
        fn, shape, d = todo.popleft()
        found = layout(fn)
        if found is not None:
            return found == d
        todo.extend(_inputs(fn, shape, d))
    return None


def _shape_of(fn: Any, nr: int) -> Optional[list[int]]:
    """The shape of output ``nr`` of autograd node ``fn`` (its forward's result), from the node's metadata."""
    metadata = getattr(fn, "_input_metadata", None)
    return None if metadata is None or nr >= len(metadata) else [int(v) for v in metadata[nr].shape]


def _inputs(node: Any, shape: list, d: int) -> list[tuple[Any, list, int]]:
    """(operand node, its shape, the tracked dimension there) for each operand of ``node`` that carries dimension d."""
    name = type(node).__name__
    nexts = [(fn, nr) for fn, nr in node.next_functions if fn is not None]
    if name in POINTWISE:
        out = []
        for fn, nr in nexts:
            operand = _shape_of(fn, nr)
            if operand is None:
                continue
            k = d - (len(shape) - len(operand))  # broadcasting aligns trailing dimensions
            if k >= 0 and operand[k] == shape[d]:
                out.append((fn, operand, k))
        return out
    if not nexts:
        return []
    if name in _RESHAPES:
        before = [int(v) for v in getattr(node, "_saved_self_sym_sizes", ())]
        if len(before) > d and None not in shape[:d + 1] and before[:d + 1] == list(shape[:d + 1]):
            return [(nexts[0][0], before, d)]
        return []
    if name in ("CatBackward0", "StackBackward0"):
        return _joined(node, name, nexts, shape, d)
    if name == "ExpandBackward0":
        before = [int(v) for v in node._saved_self_sym_sizes]
        k = d - (len(shape) - len(before))
        return [(nexts[0][0], before, k)] if k >= 0 and before[k] == shape[d] else []
    if name in ("SplitBackward0", "SplitWithSizesBackward0"):
        rank = len(shape)
        split = node._saved_dim % rank if rank else 0
        return [(nexts[0][0], [int(v) for v in node._saved_self_sym_sizes], d)] if split != d else []
    moved = _step_back(node, name, shape, d)
    return [(nexts[0][0], moved[0], moved[1])] if moved is not None else []


def _joined(node: Any, name: str, nexts: list, shape: list, d: int) -> list[tuple[Any, list, int]]:
    """Operands of ``torch.cat``/``torch.stack`` along another dimension than the tracked one (every operand has it)."""
    stacked = name == "StackBackward0"
    rank = len(shape)
    at = node._saved_dim % rank if rank else 0
    if at == d:
        return []
    k = d - (1 if stacked and at < d else 0)
    out = []
    for fn, nr in nexts:
        operand = _shape_of(fn, nr)
        if operand is not None and len(operand) > k and operand[k] == shape[d]:
            out.append((fn, operand, k))
    return out


def example_minor_rows(t: Tensor, n: int, layout: Layout) -> Optional[int]:
    """c, when ``t``'s dimension 0 holds c·n rows made by a reshape of ``[c, n, …]`` whose dimension 1 is proven to
    hold the examples (:func:`walk`): example b owns rows b, n + b, …, (c − 1)·n + b. Clones and casts after the
    reshape are passed over. ``None`` otherwise (example-major rows are :func:`~.example_dim.flattened_rows`')."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in ("CloneBackward0", "ToCopyBackward0"):
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ not in _RESHAPES or not node.next_functions:
        return None
    before = [int(v) for v in getattr(node, "_saved_self_sym_sizes", ())]
    if (len(before) < 2 or before[1] != n or before[0] < 2 or before[0] * n != t.shape[0]
            or before[2:] != list(t.shape[1:])):
        return None
    source = node.next_functions[0][0]
    return before[0] if source is not None and walk(source, before, 1, layout) else None
