"""Common machinery of :class:`DPAdam` and :class:`DPAdagrad`: the mechanism contract.

Implements the :class:`~lightning_dp.privacy.release.PrivateOptimizer` protocol
(``mechanism_request()`` / ``observe_release(release)``) by delegating to the
variant's :class:`~lightning_dp.optim.preconditioner.Preconditioner`, and
enforces that a variant which needs the mechanism's release gets one before
every step.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from typing import Any, Callable, ClassVar, Iterable, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_dp.privacy.release import MechanismRequest, Release
from lightning_dp.optim.preconditioner import Preconditioner
from lightning_dp.optim.variants import make_preconditioner

Params = Union[Iterable[Tensor], Iterable[dict[str, Any]]]

#: torch.optim group flags these optimizers do not implement (a truthy value is refused)
UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


class DPOptimizerBase(Optimizer):
    """A ``torch.optim.Optimizer`` whose second-moment rule is a pluggable variant.

    Subclasses set :attr:`family` ("adam" / "adagrad"), :attr:`second_moment_key`
    (the state key of the raw second moment) and implement :meth:`_update`.
    The release and the variant live in one shared dict (``self._dp``) so that
    Lightning's ``LightningOptimizer`` wrapper, which forwards attribute reads to
    this object, sees the same release.
    """

    family: ClassVar[str] = ""
    second_moment_key: ClassVar[str] = ""

    def __init__(self, params: Params, defaults: dict[str, Any], variant: str, variant_hparams: dict[str, Any]) -> None:
        preconditioner = make_preconditioner(variant, self.family, **variant_hparams)
        super().__init__(params, defaults)
        self._dp: dict[str, Any] = {"preconditioner": preconditioner, "release": None}

    # -- the PrivateOptimizer protocol ------------------------------------------------
    @property
    def preconditioner(self) -> Preconditioner:
        """The variant object (see :mod:`lightning_dp.optim.variants`)."""
        return self._dp["preconditioner"]

    @property
    def variant(self) -> str:
        """Registered name of the variant."""
        return self.preconditioner.name

    def mechanism_request(self) -> MechanismRequest:
        """What the mechanism must do for the coming step (asked before the forward pass)."""
        return self.preconditioner.request(self)

    def observe_release(self, release: Release) -> None:
        """Receive the step's release; must precede each :meth:`step`."""
        if not isinstance(release, Release):
            raise TypeError(f"observe_release expects a lightning_dp.privacy.release.Release, got {type(release)!r}.")
        self._dp["release"] = release

    def _take_release(self) -> Optional[Release]:
        release, self._dp["release"] = self._dp["release"], None
        if release is None and self.preconditioner.requires_release:
            raise RuntimeError(
                f"{type(self).__name__}(variant={self.variant!r}) needs the mechanism's Release before every step: "
                f"run it under lightning_dp.DPStrategy, or call optimizer.observe_release(release) before "
                f"optimizer.step() in a plain loop (see the {type(self).__name__} docstring). Only "
                f"variant='post_processing' works without one."
            )
        return release

    # -- torch.optim.Optimizer ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, refusing flags this optimizer does not implement (ValueError)."""
        flags = [k for k in UNSUPPORTED_FLAGS if param_group.get(k)]
        if flags:
            raise ValueError(f"{type(self).__name__} does not implement {flags}; set them to False/None.")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter with a gradient; ``closure`` runs first (it may observe the release)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        release = self._take_release()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients.")
                self._update(p, group, release)
        return loss

    @abstractmethod
    def _update(self, p: Tensor, group: dict[str, Any], release: Optional[Release]) -> None:
        """Update one parameter in place from ``p.grad``."""

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"dp_variant"`` (name and hyperparameters, informative)."""
        state = super().state_dict()
        state["dp_variant"] = {"name": self.variant, "hparams": self.preconditioner.hparams()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader; warns if the checkpoint was written by another variant (state keys are shared)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("dp_variant", None)
        if saved is not None and saved.get("name") != self.variant:
            warnings.warn(
                f"loading optimizer state saved with variant {saved.get('name')!r} into variant {self.variant!r}; "
                f"moments carry over, variant-specific state starts fresh.",
                UserWarning,
                stacklevel=2,
            )
        super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_dp"] = {"preconditioner": self.preconditioner, "release": None}
        return state


def as_tensor_like(value: Union[Tensor, float], p: Tensor) -> Tensor:
    """``value`` as a tensor on ``p``'s device and dtype (scalars stay 0-dim)."""
    return torch.as_tensor(value, dtype=p.dtype, device=p.device)
