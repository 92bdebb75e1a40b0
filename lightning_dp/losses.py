"""Per-example losses: the loss convention that keeps examples from interacting.

DPStrategy clips each example's gradient of the batch's MEAN loss (times the batch size). That
gradient is example i's alone only if the batch loss is the mean of per-example losses that
each depend on one example. The usual padded token loss is not: ``cross_entropy(logits.view(-1,
V), targets.view(-1), ignore_index=-100)`` divides by the non-pad tokens of the whole batch, so
example i's weight depends on the others' lengths (the first step's probe refuses it). The
helper below averages each example over its own tokens; ``training_step`` may return its
``[B]`` vector directly (DPStrategy takes the mean) or its ``.mean()``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError


def per_example_token_mean(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Each example's mean token cross-entropy over its own non-ignored tokens, shape ``[B]``.

    Args:
        logits: ``[B, T, V]`` (batch first, a language model's), or ``[B, C, d1, …, dk]`` with k ≥ 2 (the classes in
            dimension 1, as ``F.cross_entropy`` takes them: a segmentation model's ``[B, C, H, W]``).
        targets: ``[B, T]``, or ``[B, d1, …, dk]``: class indices; ``ignore_index`` marks padding (void pixels).
        ignore_index: target value that contributes nothing.

    Returns:
        l_i = Σ_t CE(logits_{i,t}, y_{i,t}) / max(1, #{t: y_{i,t} ≠ ignore}); an example with no
        token counts 0 (its gradient is zero).

    Example:
        >>> logits, y = torch.randn(2, 3, 5), torch.tensor([[1, 2, -100], [0, -100, -100]])
        >>> per_example_token_mean(logits, y).shape
        torch.Size([2])
        >>> per_example_token_mean(torch.randn(2, 4, 8, 8), torch.randint(0, 4, (2, 8, 8)), ignore_index=250).shape
        torch.Size([2])
    """
    if logits.dim() >= 4 and targets.shape == (logits.shape[0], *logits.shape[2:]):
        tokens = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none").flatten(1)
        counts = (targets != ignore_index).flatten(1).sum(1).clamp_min(1).to(tokens.dtype)
        return tokens.sum(1) / counts
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V] with targets [B, T], or [B, C, H, W, …] with targets [B, H, W, …]; "
                         f"got {tuple(logits.shape)} and {tuple(targets.shape)}")
    tokens = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=ignore_index, reduction="none")
    counts = (targets != ignore_index).sum(1).clamp_min(1).to(tokens.dtype)
    return tokens.sum(1) / counts


def mean_loss(out: Any, n: int) -> Any:
    """``out`` (a loss, or a dict with ``"loss"``) with a vector of n per-example losses replaced by its
    mean: the per-example loss convention (each example's loss is its own, the batch loss their mean)."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if isinstance(loss, Tensor) and loss.dim() == 1:
        if loss.shape[0] != n:
            raise PrivacyConfigurationError(
                f"the step returned a loss vector of {loss.shape[0]} entries for a batch of {n} examples: return "
                "the mean loss, or one loss per example (e.g. lightning_dp.per_example_token_mean for token losses).")
        loss = loss.mean()
        return {**out, "loss": loss} if isinstance(out, dict) else loss
    return out


def loss_tensor(out: Any, n: int, what: str = "training_step") -> Tensor:
    """The loss tensor of ``out`` (:func:`mean_loss` of n examples; from a dict's ``"loss"``), or the refusal of a step
    that returned none: which sampled batches were skipped would depend on private data."""
    loss = mean_loss(out, n)
    loss = loss.get("loss") if isinstance(loss, dict) else loss
    if not isinstance(loss, Tensor):
        raise PrivacyConfigurationError(
            f"{what} returned {type(out).__name__} without a loss: the mechanism needs the mean loss (or the vector of "
            "per-example losses) on every step; skipping a sampled batch would depend on private data (which batches "
            "were skipped is released by the missing update). Return the loss on every step; to ignore some examples, "
            "zero their per-example losses instead.")
    return loss
