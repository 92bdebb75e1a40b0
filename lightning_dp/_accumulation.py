"""``Trainer(accumulate_grad_batches=k)`` under a private strategy: k of the loader's batches make one logical batch.

Lightning's accumulation sums k micro-batches' gradients before the optimizer steps. Privately that sum must be one
release: each example's gradient clipped once, one noise σC for the k micro-batches, one ledger entry at the rate of
the whole logical batch. Accumulating k noised releases instead would add k noises and charge k steps; clipping the
accumulated sum would bound no example. The decision, for both private strategies (like ``gradient_clip_val``,
:mod:`lightning_dp._gradient_clip`):

- at the fit's setup, with k > 1, the expected Poisson batch becomes k × the loader's ``batch_size`` (q = kB/N, the
  same number of optimizer steps per epoch as Lightning's accumulation), drawn once per step;
- the step is differentiated in physical batches of at most the loader's ``batch_size`` (the memory the loader was
  sized for), unless ``max_physical_batch_size`` was given: the accumulation happens inside the private step, which
  clips every example once and noises the sum once (docs/algorithms.md, "The mechanism");
- Lightning's own accumulation is off for the fit (``trainer.accumulate_grad_batches`` is 1 while it runs, restored
  at its end), said in one INFO line.

A ``GradientAccumulationScheduler`` whose value is the same from epoch 0 on (``scheduling={0: 2}``, zoo28 l03) is
``Trainer(accumulate_grad_batches=2)`` said another way: it is planned from at the setup, and the value it sets at
each epoch's start is put back to 1 before Lightning's loop reads it (:func:`keep_planned`; a change at an epoch the
fit never reaches, ``{0: 2, 5: 4}`` with ``max_epochs=3``, is no change). A value that changes during the fit (a
scheduler that changes it, ``{0: 1, 2: 4}``) would change q without a new plan: refused
(:func:`~lightning_dp._strategy_glue.check_loop`, :func:`changed_error`), and so is ``StochasticWeightAveraging``'s
BatchNorm pass, which sets it to the epoch's length. Fixed-shape batches (``fixed_batch_size``) size their own
physical batches: with them, accumulation is refused.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

from lightning_dp._warnings import said
from lightning_dp.errors import PrivacyConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl



def adopt_accumulation(trainer: "pl.Trainer", strategy: Any, label: str) -> None:
    """Apply the decision of the module docstring to ``trainer``'s accumulation for ``strategy`` (one of the private
    strategies: ``private_step``, ``max_physical_batch_size``, ``_accumulation``); idempotent within a fit."""
    k = given = trainer.accumulate_grad_batches
    if k == 1:
        k = scheduled(trainer) or 1
    if k == 1:
        return
    if not isinstance(k, int) or k < 1:
        raise PrivacyConfigurationError(f"Trainer(accumulate_grad_batches={k!r}) must be a positive integer.")
    if strategy.private_step.fixed_batch_size is not None:
        raise PrivacyConfigurationError(
            f"Trainer(accumulate_grad_batches={k}) with {label}(fixed_batch_size=...): fixed-shape batches size their "
            "own physical batches. Remove accumulate_grad_batches and raise the DataLoader's batch_size (the expected "
            "Poisson batch) instead.")
    strategy._accumulation = Accumulation(weakref.ref(trainer), k, strategy.max_physical_batch_size, given)
    trainer.accumulate_grad_batches = 1  # the private step accumulates: one clipping, one noise per logical batch
    said(f"{label}: Trainer(accumulate_grad_batches={k}): one private step draws the expected batch of {k} × the "
         "loader's batch_size and differentiates it in physical batches; Lightning's own accumulation is off for this "
         "fit")


class Accumulation:
    """What :func:`adopt_accumulation` took from the Trainer: the ``accumulate_grad_batches`` planned (``k``: the
    Trainer's, or a constant scheduler's), the Trainer's own (``given``) and the strategy's ``max_physical_batch_size``
    as given, both given back at the fit's end."""

    def __init__(self, trainer: "weakref.ref[Any]", k: int, physical: Optional[int], given: Optional[int] = None
                 ) -> None:
        self.trainer, self.k, self.physical = trainer, k, physical
        self.given = k if given is None else given


def scheduled(trainer: "pl.Trainer") -> Optional[int]:
    """The value of a ``GradientAccumulationScheduler`` among ``trainer``'s callbacks when it is the same for every
    epoch the fit runs from 0 on (the callback puts ``{0: 1}`` in a schedule that starts later; an epoch at or past
    ``max_epochs`` is never reached, zoo29 a06; with ``max_epochs`` ``None`` or -1 any may be); ``None``: none, or
    one that changes the value."""
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    last = getattr(trainer, "max_epochs", None)
    reached = (lambda epoch: True) if last is None or last < 0 else (lambda epoch: epoch < last)
    values = {v for cb in getattr(trainer, "callbacks", None) or () if isinstance(cb, GradientAccumulationScheduler)
              for epoch, v in cb.scheduling.items() if reached(epoch)}
    return values.pop() if len(values) == 1 else None


def keep_planned(trainer: "pl.Trainer", strategy: Any) -> None:
    """Before Lightning's loop decides whether a batch accumulates: the planned value a constant scheduler set again
    (at an epoch's start) is the private step's, and Lightning's own accumulation stays off."""
    taken: Optional[Accumulation] = strategy._accumulation
    if taken is not None and taken.given == 1 and trainer.accumulate_grad_batches == taken.k:
        trainer.accumulate_grad_batches = 1


def changed_error(trainer: "pl.Trainer", label: str) -> PrivacyConfigurationError:
    """The refusal of an ``accumulate_grad_batches`` set during the fit, naming what set it."""
    k = trainer.accumulate_grad_batches
    averaging = [cb for cb in getattr(trainer, "callbacks", None) or () if type(cb).__name__ ==
                 "StochasticWeightAveraging" and getattr(cb, "_model_contains_batch_norm", False)]
    if averaging and k == getattr(getattr(trainer, "fit_loop", None), "max_batches", None):
        return PrivacyConfigurationError(
            f"StochasticWeightAveraging's BatchNorm pass cannot run privately: the model holds BatchNorm layers, so "
            "after its last averaging epoch the callback runs one more epoch over the training loader (setting "
            f"accumulate_grad_batches={k}, the epoch's length: no optimizer step) to recompute the averaged model's "
            "running statistics from the private records, without noise, and releases them with the model. Replace "
            "BatchNorm with nn.GroupNorm or nn.LayerNorm (a model without BatchNorm skips the pass), or average "
            "without the callback (torch.optim.swa_utils.AveragedModel in a callback of yours) and recompute the "
            "BatchNorm statistics on public data (torch.optim.swa_utils.update_bn on a public loader).")
    return PrivacyConfigurationError(
        f"accumulate_grad_batches={k} was set during the fit (a GradientAccumulationScheduler that changes it): the "
        "Poisson rate q was planned for the loader's batches at the fit's start, and Lightning would add noise to "
        "each micro-batch and rescale per-example gradients before clipping. Set Trainer(accumulate_grad_batches=k) "
        "once, or a scheduler of one value from epoch 0 (the private step then draws k × batch_size per step), or "
        f"raise the DataLoader's batch_size; {label}(max_physical_batch_size=...) bounds the memory.")


def physical_batch_size(strategy: Any, loader_batch_size: int) -> None:
    """Under adopted accumulation, physical batches of at most the loader's ``batch_size`` (when
    ``max_physical_batch_size`` was not given)."""
    taken: Optional[Accumulation] = strategy._accumulation
    if taken is not None and taken.physical is None:
        strategy.max_physical_batch_size = loader_batch_size


def batches_per_step(strategy: Any) -> int:
    """k: how many of the loader's batches one private step draws (1 without accumulation)."""
    taken: Optional[Accumulation] = strategy._accumulation
    return 1 if taken is None else taken.k


def restore_accumulation(strategy: Any) -> None:
    """Give the Trainer back its ``accumulate_grad_batches`` and the strategy its ``max_physical_batch_size``."""
    taken: Optional[Accumulation] = strategy._accumulation
    strategy._accumulation = None
    if taken is None:
        return
    strategy.max_physical_batch_size = taken.physical
    trainer = taken.trainer()
    if trainer is not None:
        trainer.accumulate_grad_batches = taken.given
