"""What an optimizer variant asks of the mechanism, and what the mechanism releases.

The contract of docs/architecture.md ("the strategy asks the variant, never the reverse"):

* before a step, the strategy asks the optimizer for a :class:`MechanismRequest`
  (a per-coordinate scale for scale-then-privatize, a second noised statistic for
  independent moments, the clean clipped mean for the non-private baseline);
* after the noise is added, the strategy hands the optimizer a :class:`Release`
  describing what it now holds in ``p.grad`` (and any extra statistic).

Both are plain data. Tensors are keyed by the parameter they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol, runtime_checkable

from torch import Tensor

ParamMap = Mapping[Tensor, Tensor]


@dataclass(frozen=True)
class MechanismRequest:
    """What a variant needs from the mechanism for the coming step.

    Attributes:
        scale: per-parameter, per-coordinate scale ``s_t`` applied to every
            per-example gradient *before* clipping, and undone after the noise
            (scale-then-privatize, docs/algorithms.md §4). Must depend only on earlier
            private outputs.
        second_moment: release the noised per-example second moment
            ``(Σ_i clip_C(g_i)² + σ₂ C² z) / B`` next to ĝ (independent moments,
            docs/algorithms.md §3). The budget is split: both statistics get √2 σ.
        clean_mean: also hand over the *un-noised* clipped mean ``S_t / B``.
            This is not private (the noiseless baseline, docs/algorithms.md §5); the
            strategy records such steps as non-private.
    """

    scale: Optional[ParamMap] = None
    second_moment: bool = False
    clean_mean: bool = False

    @property
    def noise_split(self) -> int:
        """Number of Gaussian releases sharing the step's budget (1 or 2)."""
        return 2 if self.second_moment else 1


DEFAULT_REQUEST = MechanismRequest()


@dataclass(frozen=True)
class Release:
    """What the mechanism released for one step.

    Attributes:
        noise_std: per-coordinate std of the noise in the gradient written to
            ``p.grad`` *before* unscaling, i.e. σ·C/B (×√2 when the budget is split).
            Its square is Φ of the bias-correction paper (docs/algorithms.md §2).
        expected_batch_size: the global expected batch B the sums were divided by.
        noise_multiplier: σ of the step (the ledger's value).
        max_grad_norm: C of the step.
        scale: the scale that was applied (``None`` if none); ``p.grad`` holds the
            unscaled ĝ, whose per-coordinate noise std is ``noise_std / scale``.
        second_moment: noised second-moment statistic per parameter, if requested.
        second_moment_noise_std: per-coordinate noise std of ``second_moment``.
        clean_mean: un-noised clipped mean per parameter (non-private), if requested.
    """

    noise_std: float
    expected_batch_size: float
    noise_multiplier: float
    max_grad_norm: float
    scale: Optional[ParamMap] = None
    second_moment: Optional[ParamMap] = None
    second_moment_noise_std: float = 0.0
    clean_mean: Optional[ParamMap] = field(default=None, repr=False)


@runtime_checkable
class PrivateOptimizer(Protocol):
    """An optimizer that talks to the mechanism (the DP-Adam variants do).

    Plain ``torch.optim`` optimizers need nothing from the mechanism and need not
    implement this; the strategy then uses :data:`DEFAULT_REQUEST`.
    """

    def mechanism_request(self) -> MechanismRequest:
        """What the coming step needs (called before the forward pass)."""
        ...

    def observe_release(self, release: Release) -> None:
        """Receive the step's release (called after ``p.grad`` holds ĝ, before ``step``)."""
        ...
