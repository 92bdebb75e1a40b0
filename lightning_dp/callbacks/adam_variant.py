"""AdamVariant: swap the user's Adam / AdamW / Adagrad for its DP-variant equivalent.

The LightningModule keeps returning a plain ``torch.optim`` optimizer from
``configure_optimizers``; this callback replaces it in the strategy with
:class:`~lightning_dp.optim.DPAdam` / :class:`~lightning_dp.optim.DPAdagrad`
running the chosen variant (docs/algorithms.md §1–§5), keeping param groups (lr,
betas, eps, weight decay, every key), the moments m, v and the step count, and
re-pointing LR schedulers.

When: at ``on_fit_start`` for ``start_step=0`` — after ``strategy.setup`` built the
optimizers and *before* Lightning restores optimizer state from a checkpoint,
so a checkpoint written after the swap loads straight into the DP optimizer —
otherwise at the first ``on_train_batch_start`` with ``global_step >=
start_step``. Whether the swap had happened is part of the callback's state, so
a run resumed past ``start_step`` swaps at ``on_fit_start`` too.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_dp.optim.base import UNSUPPORTED_FLAGS
from lightning_dp.optim.convert import dp_class_for, to_dp_optimizer
from lightning_dp.optim.variants import check_hparams, variant_class
from lightning_dp._strategy_glue import PrivateTraining


class AdamVariant(Callback):
    """Run the user's Adam / AdamW / Adagrad as the DP variant ``name``.

    Example::

        trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0),
                             callbacks=[AdamVariant("bias_corrected")])   # floor γ' = 0.1·Φ̄

    Args:
        name: a variant from :func:`lightning_dp.optim.variant_names`.
        start_step: optimizer step from which the variant is used (0: from the start);
            before it the user's optimizer runs unchanged (post-processing).
        **hparams: the variant's hyperparameters (``gamma_phi`` or ``gamma``; ``eps_s``, ``refresh_every``).

    When it takes effect it logs one INFO line (rank 0): the optimizers swapped, the variant and its parameters.

    Raises:
        ValueError: at construction for an unknown variant or hyperparameter; at fit
            start for an optimizer other than Adam/AdamW/Adagrad, a variant without a
            form for it, or a variant that needs the mechanism without ``DPStrategy``.
    """

    def __init__(self, name: str = "post_processing", start_step: int = 0, **hparams: Any) -> None:
        check_hparams(name, hparams)
        if int(start_step) != start_step or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0, got {start_step!r}.")
        self.name = name
        self.start_step = int(start_step)
        self.hparams = dict(hparams)
        self._swapped = False
        self._resumed_swapped = False

    @property
    def swapped(self) -> bool:
        """Whether the optimizers of the current fit run the variant."""
        return self._swapped

    # -- hooks --------------------------------------------------------------------------
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Validate; swap now if ``start_step == 0`` or the checkpoint being resumed was swapped."""
        self._swapped = False
        self._validate(trainer)
        resumed_swapped, self._resumed_swapped = self._resumed_swapped, False
        if self.start_step == 0 or resumed_swapped:
            self.swap(trainer)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        """Swap before the first step at or after ``start_step``."""
        if not self._swapped and trainer.global_step >= self.start_step:
            self.swap(trainer)

    def state_dict(self) -> dict[str, Any]:
        """``{"swapped": ..., "name": ...}`` — so a resume knows which optimizer the checkpoint holds."""
        return {"swapped": self._swapped, "name": self.name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember whether the checkpoint was written after the swap (runs before ``on_fit_start``)."""
        self._resumed_swapped = bool(state_dict.get("swapped", False))

    # -- the swap -----------------------------------------------------------------------
    def swap(self, trainer: "pl.Trainer") -> None:
        """Replace every optimizer of ``trainer.strategy`` and re-point its LR schedulers."""
        strategy = trainer.strategy
        old = list(strategy.optimizers)
        new = [to_dp_optimizer(opt, self.name, **self.hparams) for opt in old]
        strategy.optimizers = new  # the setter rebuilds the LightningOptimizer wrappers
        repoint_schedulers(strategy.lr_scheduler_configs, old, new)
        self._swapped = True
        rank_zero_info(announcement(old, new, trainer.global_step))

    def _validate(self, trainer: "pl.Trainer") -> None:
        for opt in trainer.strategy.optimizers:
            variant_class(self.name, dp_class_for(opt).family)
            for i, group in enumerate(opt.param_groups):
                flags = [k for k in UNSUPPORTED_FLAGS if group.get(k)]
                if flags:
                    raise ValueError(f"AdamVariant({self.name!r}): param group {i} of {type(opt).__name__} sets "
                                     f"{flags}, which the DP variants do not implement; set them to False.")
        if variant_class(self.name).requires_release and not _is_dp_strategy(trainer.strategy):
            raise ValueError(
                f"AdamVariant({self.name!r}) needs the mechanism's release every step: use "
                f"Trainer(strategy=lightning_dp.DPStrategy(...)); only 'post_processing' runs without it."
            )


def announcement(old: list[Optimizer], new: list[Optimizer], step: int) -> str:
    """The one line that says the variant took effect: which optimizers, the variant and its parameters, the step."""
    swaps = "; ".join(f"{type(o).__name__} → {type(n).__name__}(variant={n.variant!r}: {n.preconditioner.describe()})"
                      for o, n in zip(old, new))
    return f"AdamVariant: from step {step}, {swaps}; lr, betas, moments and schedulers carried over."


def _is_dp_strategy(strategy: object) -> bool:
    return isinstance(strategy, PrivateTraining)  # DPStrategy or DPShardedStrategy


def repoint_schedulers(configs: list[Any], old: list[Optimizer], new: list[Optimizer]) -> None:
    """Point each scheduler whose optimizer is in ``old`` at its replacement in ``new``.

    Torch's LR schedulers wrap ``optimizer.step`` to check that it runs before
    ``scheduler.step()``; the wrapper is re-applied to the replacement so that
    check (and its warning) behaves as before the swap.
    """
    replacement = {id(o): n for o, n in zip(old, new)}
    for config in configs:
        scheduler = config.scheduler
        target = replacement.get(id(getattr(scheduler, "optimizer", None)))
        if target is None:
            continue
        tracked = hasattr(scheduler.optimizer.step, "_wrapped_by_lr_sched")
        target._opt_called = getattr(scheduler.optimizer, "_opt_called", False)  # type: ignore[attr-defined]
        scheduler.optimizer = target
        if tracked:
            _track_step_calls(target)


def _track_step_calls(optimizer: Optimizer) -> None:
    """Mark ``optimizer._opt_called`` on every step, as torch's LRScheduler does at construction."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
