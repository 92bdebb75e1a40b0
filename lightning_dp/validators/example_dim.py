"""Verified, not assumed: every captured layer call holds one row per sampled example.

Per-example clipping bounds an example's influence only if what the engine calls "example i"
is example i. A layer that sees ``[B·T, d]`` (``h.view(-1, d)``) or a time-major ``[T, B, d]``
would be clipped per token or per time step: one example could then move the released sum by
T·C. The strategy knows how many examples the sampler put in each step (the sampler's
indices, not the batch's first tensor) and the capture compares every call's output with it
(:meth:`~lightning_dp.grad_sample.capture.activations.ActivationCapture.begin_step`); this module turns
what it saw into errors that name the layer, the shape and the fix.
"""

from __future__ import annotations

import math

from typing import Any, Mapping, Optional, Sequence

from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError

FIX = (
    "Keep the example dimension first in every layer with trainable parameters: call the layer on "
    "[B, T, ...] (nn.Linear, nn.Embedding, nn.LayerNorm accept any leading dimensions), or flatten a "
    "contiguous [B, ...] tensor as a view (h.contiguous().view(-1, d): example i then owns rows i*T...(i+1)*T-1; "
    "a reshape of activations that copies is verified too, but a copy of data such as x[:, :-1].reshape(-1), a "
    "transpose of the batch dimension before flattening, or indexing hides that), and run "
    "time-major code batch-first (batch_first=True, or transpose to [B, T, ...] before the layer; nn.Linear, "
    "nn.LayerNorm, nn.RMSNorm and nn.Embedding on [T, B, ...] are served where autograd's record shows dimension 1 "
    "holds the examples: a transpose of a batch-first tensor, or the output of a time-major attention or RNN). "
    "An unbatched lookup ([T] or [T, T] indices) is served where its result is broadcast over the examples "
    "(added to a [B, ...] tensor); any other use of it needs the batch as leading dimension ([B, T])."
)


def flattened_rows(t: Tensor, n: int, anchors: Optional[Mapping[Any, int]] = None) -> bool:
    """Whether ``t`` holds ``n`` examples flattened into ``t.shape[0]`` = n·m rows, example i owning rows
    ``i·m … (i+1)·m − 1``, verified one of two ways:

    - a view that flattens a contiguous tensor of ``n`` examples (``[n, …]`` in memory, dimension 0 first): same
      storage start, same size, both contiguous (``h.view(-1, d)``, ``x.flatten(0, 1)``); at n = 1 any view of a
      ``[1, …]`` tensor (the probe's examples alone: a reshape that copies at n > 1 may be a view there);
    - autograd's record (:func:`reshaped_from_examples`): a reshape of ``[n, …]`` followed only by operations whose
      effect on the rows is known (timm's window partitions, ``h.transpose(1, 2).reshape(B·k, …)``, MViT's
      ``x.reshape(-1, H, W, d).permute(0, 3, 1, 2).contiguous()``), or of ``[c, n, …]`` into ``[c, n·m, …]`` when
      the walk back from there reaches the output of a layer called on the step's examples (``anchors``: autograd
      node → its row count, n or a verified n·m; SAM's ``qkv.reshape(3, B·heads, N, d).unbind(0)``)."""
    if n < 1 or t.dim() == 0 or t.shape[0] % n:
        return False
    return _view_of_examples(t, n) or reshaped_from_examples(t, n, anchors or {})


def _view_of_examples(t: Tensor, n: int) -> bool:
    base = t._base
    if base is None or base.dim() == 0 or base.shape[0] != n:
        return False
    if n == 1:  # every entry of a [1, …] base is the one example's, whatever the view's layout
        return True
    return (t.is_contiguous() and base.is_contiguous() and t.numel() == base.numel()
            and t.data_ptr() == base.data_ptr())


_RESHAPES = ("UnsafeViewBackward0", "ViewBackward0", "ReshapeAliasBackward0")
"""Autograd's nodes of ``reshape``/``view``/``flatten`` (a copy or not), which save their input's sizes."""
_WALK = 16  # nodes followed back from t at most


def reshaped_from_examples(t: Tensor, n: int, anchors: Optional[Mapping[Any, int]] = None) -> bool:
    """Whether autograd's record of ``t`` shows its rows (dimension 0, n·m of them) made by a reshape of the ``n``
    examples. Walking back from ``t``, the rows' dimension is tracked through operations whose effect on it is known
    (:func:`_step_back`: ``contiguous``/``clone``, casts, permutes and transposes, slicing or selecting another
    dimension, ``unbind``, ``unsqueeze``, and reshapes that keep the dimensions up to the rows') to a reshape (or
    view) that makes them: its input has ``c`` entries where its output has the rows (a multiple of c), and the same
    sizes before. A reshape reads in logical, row-major order, whatever the memory layout, so each of the c entries
    becomes consecutive rows. With c = n in dimension 0 there, that is the proof (the same trust in a leading
    dimension of size n as a layer's own check). Otherwise (a later dimension, or c a verified n·m: windows) the walk
    goes on with that dimension until it meets, in dimension 0, the output of a layer called on c rows of the step's
    examples (``anchors``: autograd node → row count, recorded by the capture). Only tensors that require gradient
    carry a record; a copy of data is not verified."""
    if t.dim() == 0 or t.shape[0] <= n:  # rows keep their count back to the reshape, which must make more of them
        return False
    anchors = anchors or {}
    node, shape, r, count = t.grad_fn, list(t.shape), 0, 0  # count: 0 while walking the rows, then c
    counts = set(anchors.values()) | {n}
    for _ in range(_WALK):
        if node is None:
            return False
        if count and r == 0 and anchors.get(node) == count:
            return True
        name = type(node).__name__
        if name in _RESHAPES:
            before = [int(v) for v in getattr(node, "_saved_self_sym_sizes", ())]
            after = _resolved(shape, before)
            if after is None or len(before) <= r or before[:r] != after[:r]:
                return False
            if before[r] == after[r]:  # the reshape keeps every dimension up to this one: rows (or examples) stay
                shape = before
            elif not count and before[r] in counts and after[r] > before[r] and after[r] % before[r] == 0:
                if r == 0 and before[r] == n:
                    return True
                shape, count = before, before[r]
            else:
                return False
        else:
            moved = _step_back(node, name, shape, r)
            if moved is None:
                return False
            shape, r = moved
        node = node.next_functions[0][0] if node.next_functions else None
    return False


def _resolved(shape: list[Optional[int]], before: list[int]) -> Optional[list[int]]:
    """``shape`` with its one unknown size (an ``unbind``'s count) filled from the reshape's input size; None when
    more than one is unknown or it does not divide."""
    unknown = [k for k, v in enumerate(shape) if v is None]
    if not unknown:
        return [int(v) for v in shape]  # type: ignore[arg-type]
    known = math.prod(int(v) for v in shape if v is not None)
    total = math.prod(before)
    if len(unknown) > 1 or known == 0 or total % known:
        return None
    return [total // known if v is None else int(v) for v in shape]


def _step_back(node: Any, name: str, shape: list, r: int) -> Optional[tuple[list, int]]:
    """The input's shape and the tracked dimension's index in it, for the autograd ``node`` whose output has
    ``shape`` with the tracked dimension at ``r``; None for any operation not known to keep that dimension whole."""
    rank = len(shape)

    def dim(value: int, size: int) -> int:
        value = value - (1 << 64) if value >= (1 << 63) else value  # negative dims are saved as unsigned
        return value % size if size else value

    if name in ("CloneBackward0", "ToCopyBackward0"):
        return shape, r
    if name == "PermuteBackward0":
        dims = [dim(d, rank) for d in node._saved_dims]
        before = [None] * rank
        for k, d in enumerate(dims):
            before[d] = shape[k]
        return before, dims[r]
    if name == "TransposeBackward0":
        a, b = dim(node._saved_dim0, rank), dim(node._saved_dim1, rank)
        before = list(shape)
        before[a], before[b] = shape[b], shape[a]
        return before, b if r == a else a if r == b else r
    if name == "SliceBackward0":
        return (list(node._saved_self_sym_sizes), r) if dim(node._saved_dim, rank) != r else None
    if name in ("SelectBackward0", "UnbindBackward0"):
        d = dim(node._saved_dim, rank + 1)
        before = (list(node._saved_self_sym_sizes) if name == "SelectBackward0"
                  else [*shape[:d], None, *shape[d:]])
        return before, r + (d <= r)
    if name == "UnsqueezeBackward0":
        d = dim(node._saved_dim, rank)
        return (shape[:d] + shape[d + 1:], r - (d < r)) if d != r else None
    return None


def unbatched_call(inputs: Sequence[Tensor], out: Tensor, n: int) -> bool:
    """Whether a call has no example dimension at all: no dimension of any input or of the output has n
    entries, and the output's dimension 0 is not 1 (a ``[1, …]`` call is broadcast the usual way). T5's
    relative bias (``[T, T]`` bucket indices), ``pos(torch.arange(T))``, a layer called with shapes or ints only
    (LED's positions from ``input_ids.shape``). Such a call is one per step, shared
    by every example; its per-example gradients come from where the model broadcasts its output over the
    examples (:mod:`~lightning_dp.grad_sample.capture.broadcast_sites`); any other use is refused. At n = 1 (the
    probe's examples alone) a batched call has a dimension of size 1, so it is never mistaken for one."""
    if out.dim() == 0 or out.shape[0] == 1:
        return False
    # at n = 1 a size-1 dimension of the output says nothing (one head, a scalar per position: SwinV2-CR's meta MLP
    # [N², heads]); every example there is the one example, so a call taken for a lookup is still served exactly
    return all(n not in t.shape for t in inputs) and (n == 1 or n not in out.shape)


def example_dim_error(mismatched: Mapping[str, Sequence[tuple[int, ...]]],
                      n: Optional[int]) -> PrivacyConfigurationError:
    """The error for layers whose calls' output dimension 0 was not the step's n examples
    (``n=None``: not known, and the layers disagree among themselves)."""
    lines = [f"layer '{name or '<root>'}' produced outputs of shape {', '.join(str(s) for s in shapes[:3])}"
             for name, shapes in mismatched.items()]
    head = (f"This step sampled {n} example(s), but dimension 0 of these layers' outputs is not {n}"
            if n is not None else "Hooked layers disagree on the example dimension (dimension 0 of their outputs)")
    return PrivacyConfigurationError(
        head + ":\n- " + "\n- ".join(lines)
        + "\nPer-example clipping would clip per token or per time step, and one example could move the "
        "released sum by more than C. Nothing was released. " + FIX
    )


def ambiguous_layout_error(name: str, shape: tuple[int, ...], n: int) -> PrivacyConfigurationError:
    """A layer proven time-major (``[T, B, …]``) earlier in the run, called now on a tensor whose dimensions 0 and 1
    both have the step's n examples (T = B) and whose layout autograd's record does not decide (refused, before any
    release: clipping per time step would let one example move the sum by T·C)."""
    return PrivacyConfigurationError(
        f"layer '{name or '<root>'}' ran time-major ([T, B, ...]) earlier in this run, and this step it was called on "
        f"shape {shape} with {n} examples: both dimension 0 and dimension 1 have {n} entries, and autograd's record "
        "does not show which one holds the examples (the input has no record that leads back to a layer with a known "
        "layout). Per-example clipping could clip per time step. Nothing was released. Run the layer batch-first "
        "([B, T, ...]: transpose before it, or batch_first=True in the attention or RNN around it), or compute its "
        "input from a layer whose layout is known (a transpose of the batch-first embedding, the attention's output).")


def flattened_rnn_error(name: str, module: nn.Module) -> PrivacyConfigurationError:
    """An RNN called on verified flattened examples ``[B·m, T, d]`` (timm's Sequencer2d, a sentence-level LSTM over
    ``[B·sentences, words, d]``) in a configuration its rule does not take: each row's gradients come from the
    hand-written backward through time, which needs ``batch_first=True`` there and no inter-layer dropout in training
    (refused, before any release)."""
    return PrivacyConfigurationError(
        f"layer '{name or '<root>'}' ({type(module).__name__}) was called on flattened examples ([B·m, T, d] rows, "
        "verified), in a configuration whose per-row gradients are not served there (time-major input, or dropout "
        "between its layers in training). Nothing was released. Use batch_first=True and dropout=0 for this layer "
        "(dropout on its outputs instead), or call it on [B, T, d].")


def packed_sequence_error(name: str, module: object) -> PrivacyConfigurationError:
    """A layer called on a ``PackedSequence`` that no engine maps back to examples (refused, before any
    release). ``nn.LSTM``/``nn.GRU``/``nn.RNN`` are served (:mod:`~lightning_dp.grad_sample.rnn_unrolled`)
    except with inter-layer dropout in training: its masks, drawn inside the fused kernel on the packed
    rows, cannot be replayed layer by layer. Any other layer would see the time steps of all examples as rows."""
    head = f"layer '{name or '<root>'}' ({type(module).__name__}) was called on a PackedSequence (pack_padded_sequence)"
    if isinstance(module, nn.RNNBase):
        return PrivacyConfigurationError(
            f"{head} in training mode with dropout={module.dropout} between its {module.num_layers} layers: those "
            "random masks are drawn inside torch's fused kernel on the packed rows, and no per-example engine can "
            "replay them layer by layer. Nothing was released. Set dropout=0.0, or stack single-layer RNNs with the "
            "dropout applied to the packed data between them (PackedSequence(F.dropout(p.data, q, self.training), "
            "p.batch_sizes, p.sorted_indices, p.unsorted_indices)); both train with exact per-example gradients."
        )
    return PrivacyConfigurationError(
        f"{head}: its rows are the time steps of all examples, sorted by length, and only nn.LSTM, nn.GRU and "
        "nn.RNN map them back to examples. Nothing was released. Call it on the packed data's padded form "
        "instead (pad_packed_sequence(p, batch_first=True): [B, T, ...], example first)."
    )


def check_example_dim(mismatched: Mapping[str, Sequence[tuple[int, ...]]], n: Optional[int]) -> None:
    """Raise :func:`example_dim_error` if any layer saw a call of the wrong example dimension."""
    if mismatched and n is not None:
        raise example_dim_error(mismatched, n)


def check_lookups_served(unserved: Mapping[str, Sequence[tuple[int, ...]]], n: Optional[int]) -> None:
    """Raise :func:`lookup_use_error` if a layer called without the examples had its output used otherwise than
    broadcast over them."""
    if unserved and n is not None:
        raise lookup_use_error(unserved, n)


def lookup_use_error(unserved: Mapping[str, Sequence[tuple[int, ...]]], n: Optional[int] = None
                     ) -> PrivacyConfigurationError:
    """A layer called without the examples (a position table, a relative-position projection), whose output the
    model combined with the batch otherwise than by broadcasting it: its examples' gradients cannot be told apart.
    When every such call had fewer rows than the step's ``n`` sampled examples, the message leads with the likely
    cause: records dropped between the sampler and the model."""
    lines = [f"layer '{name or '<root>'}' (output {', '.join(str(s) for s in shapes[:2])})"
             for name, shapes in unserved.items()]
    shapes = [s for found in unserved.values() for s in found]
    fewer = bool(n) and bool(shapes) and all(len(s) and 0 < s[0] < n for s in shapes)
    dropped = (f"The step sampled {n} examples, but the model was called on fewer rows: a collate_fn, a transform or "
               "training_step dropped sampled records (keeping rows by the batch's own values — its median, its "
               "majority label — makes who is kept depend on the other records, and the batch size the sampler's "
               "accounting assumes is no longer the one trained on). Keep every sampled record (a record the "
               "dataset cannot read may be returned as None and dropped by the collate; records/empty_records.py), "
               "or weight the rows (a per-example mask in the loss) instead of filtering them. "
               "Details: " if fewer else "")
    return PrivacyConfigurationError(
        dropped + "These layers were called without the step's examples in dimension 0, and their output did not "
        "reach the loss by being broadcast over the examples (added to, multiplied with, expanded or repeated to the "
        "batch):"
        "\n- " + "\n- ".join(lines) + "\nEither the layer sees the batch in another layout (flattened by a copy, "
        "x[:, 1:].reshape(-1, d), or time-major), or it is a table shared by all examples used otherwise than "
        "broadcast (summed into the loss; used as a weight; repeated over the batch, repeat(B, …), and then not "
        "met row for row with a [B·m, …] view of the batch). Example i's share of its gradient cannot be told apart, "
        "so nothing was released. " + FIX + " A shared table used otherwise: freeze the layer (requires_grad_(False))."
    )


def check_something_captured(captured_any: bool, n: Optional[int]) -> None:
    """A step that sampled n > 0 examples must have captured some layer's gradient: otherwise the
    engine's hooks did not run and the release would be pure noise, never a silent zero."""
    if n and not captured_any:
        raise PrivacyConfigurationError(
            f"This step sampled {n} example(s), but no layer with trainable parameters reported a "
            "per-example gradient: the engine's hooks did not run. Common causes: the model was compiled "
            "(torch.compile) and run before DPStrategy attached its hooks — compile inside the "
            "LightningModule after setup, or not at all; parameters used only through functional calls "
            "(F.linear(x, self.weight)) outside a module's forward; or a loss that does not depend on "
            "the parameters (a loss detached from the model, e.g. torch.tensor(loss.item(), requires_grad=True)). "
            "Nothing was released."
        )


def replay_shape_error(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> PrivacyConfigurationError:
    """The per-example replay of a layer's call gave an output whose shape differs from its recorded gradient's:
    the call was not reproduced for one example (an argument mistaken for per-example, or the reverse)."""
    return PrivacyConfigurationError(
        f"layer '{name or '<root>'}': replayed for one example, its call gave an output of shape {got} where the "
        f"example's output gradient has shape {want}, so the call was not reproduced (an argument was taken for "
        "one row per example, or for one shared by all, wrongly). Nothing was released. Pass the layer its "
        "per-example tensors batch-first and its shared ones (masks, position tables) without a batch dimension, "
        "or report the layer's call signature to lightning_dp."
    )


def random_replay_error(name: str, module: object) -> PrivacyConfigurationError:
    """A layer with data-dependent shapes (``torch.nonzero``: a mixture-of-experts block's routing), served by one
    replay per example, whose replay draws random numbers: it would not reproduce the step's computation."""
    return PrivacyConfigurationError(
        f"layer '{name or '<root>'}' ({type(module).__name__}) has a forward whose shapes depend on the data "
        "(torch.nonzero, boolean-mask indexing: e.g. a mixture-of-experts block routing tokens to its experts), so "
        "its per-example gradients are computed by replaying it once per example, and that replay draws random "
        "numbers (dropout or noise inside it): it would not reproduce the step. Nothing was released. Move the "
        "dropout out of this module (apply it to its output), or set the module to eval mode, or freeze it "
        "(requires_grad_(False))."
    )


def mixed_use_error(where: str) -> PrivacyConfigurationError:
    """An embedding's parameter used by its own forward and also read outside it in one step (weight tying by
    ``F.linear(h, self.emb.weight)``): the two uses' per-example gradients are not combined."""
    return PrivacyConfigurationError(
        f"The trainable parameter {where} is used by its own module's forward and also read outside it in the same "
        "step (e.g. F.linear(h, self.emb.weight) for weight tying, or emb.weight sliced and added besides emb(x)). "
        "The per-example gradients of the two kinds of use are not combined. Nothing was released. For weight "
        "tying, make the output layer an nn.Linear whose .weight is the embedding's Parameter "
        "(head.weight = emb.weight); otherwise use the parameter one way only, or freeze it (requires_grad=False)."
    )


def hidden_use_error(where: str) -> PrivacyConfigurationError:
    """A layer's parameter that its forward used (the ghost engine's replaced forward, which leaves ``p.grad``
    alone) and that autograd still gave a gradient: another use in the step that no hook sees."""
    return PrivacyConfigurationError(
        f"The trainable parameter {where} is used by its layer's forward and also, in the same step, somewhere the "
        "per-example engine does not see: a read through module.parameters() or module._parameters (an L2 or L1 "
        "penalty in the loss, a norm constraint, a functional call such as F.linear(x, next(m.parameters()))). "
        "That use's gradient would be missing from every example's gradient (a penalty would silently do "
        "nothing). Nothing was released. For an L2 penalty "
        "give the optimizer weight_decay (it acts on the released gradient: post-processing); apply an L1 or other "
        "penalty to the weights after the optimizer's step (on_train_batch_end), or read the parameter through "
        "its module's attribute (module.weight) so that the use is captured."
    )


def missing_gradient_error(where: str, shape: tuple[int, ...]) -> PrivacyConfigurationError:
    """A trainable parameter that autograd gave a gradient although no hooked use of it ran (an unused
    parameter, whose per-example gradients are exactly zero, is not refused: ``unused_in_step``)."""
    return PrivacyConfigurationError(
        f"The trainable parameter {where} (shape {shape}) received a gradient, but from no use that the "
        "per-example engine captures: it is read outside its module's forward and used otherwise than broadcast "
        "over the examples or as the weight of a product with them (x @ w, F.linear(x, w), an einsum led by the "
        "examples' index) or F.linear's bias (self.weight @ h.t(), a convolution), or through a read the library "
        "does not see (module.parameters(), module._parameters). "
        "Nothing was released. Use it through a leaf module (nn.Linear; for weight tying: an nn.Linear whose "
        ".weight is the embedding's Parameter), pass it to F.linear, or freeze it (requires_grad=False). A weight "
        "applied to a loss already averaged over the batch (uncertainty weighting: torch.exp(-s) * "
        "F.cross_entropy(logits, y) + s) is such a use: apply it to each example's loss instead, "
        "(torch.exp(-s) * F.cross_entropy(logits, y, reduction='none') + s).mean()."
    )
