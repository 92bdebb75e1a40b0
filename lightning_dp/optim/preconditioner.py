"""The preconditioner interface shared by every DP-Adam / DP-AdaGrad variant.

A variant differs from plain Adam (or AdaGrad) in three places only, so a
:class:`Preconditioner` answers three questions (docs/algorithms.md §1–§5):

* :meth:`Preconditioner.request` — what the mechanism must do for the coming step
  (a per-coordinate scale, a second noised statistic, the clean mean);
* :meth:`Preconditioner.statistic` — which per-coordinate quantity is averaged
  into the second moment ``v`` (ĝ² for the baseline);
* :meth:`Preconditioner.denominator` — how the averaged second moment becomes
  the per-coordinate divisor of the update (``√v̂ + ε`` for the baseline).

The optimizer (:class:`~lightning_dp.optim.dp_adam.DPAdam` or
:class:`~lightning_dp.optim.dp_adagrad.DPAdagrad`) owns the averaging: an
exponential moving average with bias correction for Adam, a running sum for
AdaGrad. A preconditioner that must average a further quantity the same way
(the noise variance Φ of bias correction) receives an ``average`` function.
Preconditioners never see per-example data, only the mechanism's
:class:`~lightning_dp.privacy.release.Release` (post-processing).
"""

from __future__ import annotations

import inspect
from abc import ABC
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Union

from torch import Tensor

from lightning_dp.privacy.release import DEFAULT_REQUEST, MechanismRequest, Release



class SteppingOptimizer(Protocol):
    """What a variant reads of the optimizer it preconditions (a :class:`~lightning_dp.optim.base.DPOptimizerBase`;
    named by its shape so the variants need not import the optimizer that builds them)."""

    state: Any
    param_groups: list[dict[str, Any]]
    second_moment_key: str

#: ``average(key, value)`` folds ``value`` into ``state[key]`` exactly as the
#: optimizer folds its second-moment statistic into ``v`` and returns the
#: current (bias-corrected) average.
AverageFn = Callable[[str, Union[Tensor, float]], Tensor]


class Preconditioner(ABC):
    """Base class of the variants; the default methods are plain Adam/AdaGrad (§1).

    Subclasses set :attr:`name`, may set :attr:`requires_release` and
    :attr:`bases`, and take their hyperparameters as keyword-only arguments of
    ``__init__`` (the registry validates names against that signature).
    """

    name: ClassVar[str] = ""
    #: whether :meth:`DPOptimizerBase.step` needs a Release for this variant
    requires_release: ClassVar[bool] = True
    #: optimizer families the variant has a formula for
    bases: ClassVar[frozenset[str]] = frozenset({"adam", "adagrad"})

    def hparams(self) -> dict[str, Any]:
        """The variant's hyperparameters, as passed to ``__init__``."""
        names = inspect.signature(type(self).__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self"}

    def request(self, optimizer: SteppingOptimizer) -> MechanismRequest:
        """What the mechanism must do for the coming step (default: nothing extra)."""
        return DEFAULT_REQUEST

    def statistic(self, p: Tensor, grad: Tensor, release: Optional[Release], decay: Optional[Tensor]) -> Tensor:
        """The per-coordinate quantity averaged into ``v``: ĝ² by default (§1).

        ``grad`` is the gradient the optimizer steps on (ĝ plus any coupled weight
        decay term ``decay = λθ``).
        """
        return grad * grad

    def denominator(
        self, p: Tensor, second_moment: Tensor, release: Optional[Release], average: AverageFn, eps: float
    ) -> Tensor:
        """Divisor of the update from the averaged second moment: ``√v̂ + ε`` (§1).

        ``second_moment`` is v̂ (Adam, bias-corrected) or the running sum (AdaGrad);
        it must not be modified in place.
        """
        return second_moment.sqrt().add_(eps)

    def describe(self) -> str:
        """The hyperparameters in words, for the log line that announces the variant (``name=value, …``)."""
        return ", ".join(f"{k}={v!r}" for k, v in self.hparams().items()) or "no hyperparameters"

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"


def lookup(mapping: Optional[Mapping[Tensor, Tensor]], p: Tensor, what: str, variant: str) -> Tensor:
    """``mapping[p]`` or a RuntimeError naming the statistic the strategy failed to release."""
    if mapping is None or p not in mapping:
        raise RuntimeError(
            f"variant {variant!r} needs the release's {what!r} for every parameter with a gradient, "
            f"but the Release carries none for a parameter of shape {tuple(p.shape)}. The strategy must "
            f"serve optimizer.mechanism_request() (DPStrategy does); a hand-built Release must include it."
        )
    return mapping[p]


def noise_variance(p: Tensor, release: Release) -> Union[Tensor, float]:
    """Per-coordinate variance Φ of the noise in ``p.grad`` (docs/algorithms.md §2).

    ``release.noise_std² `` = (σC/B)² — or ``(noise_std / s)²`` per coordinate when
    the mechanism worked in a scaled space (``release.scale``, §4).
    """
    variance = float(release.noise_std) ** 2
    if release.scale is not None and p in release.scale:
        return variance / release.scale[p].pow(2)
    return variance
