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

A value that changes during the fit (``GradientAccumulationScheduler``) would change q without a new plan: refused
(:func:`~lightning_dp._strategy_glue.check_loop`). Fixed-shape batches (``fixed_batch_size``) size their own
physical batches: with them, accumulation is refused.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Optional

from lightning_dp.errors import PrivacyConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger("lightning_dp.strategy")


def adopt_accumulation(trainer: "pl.Trainer", strategy: Any, label: str) -> None:
    """Apply the decision of the module docstring to ``trainer``'s accumulation for ``strategy`` (one of the private
    strategies: ``private_step``, ``max_physical_batch_size``, ``_accumulation``); idempotent within a fit."""
    k = trainer.accumulate_grad_batches
    if k == 1:
        return
    if not isinstance(k, int) or k < 1:
        raise PrivacyConfigurationError(f"Trainer(accumulate_grad_batches={k!r}) must be a positive integer.")
    if strategy.private_step.fixed_batch_size is not None:
        raise PrivacyConfigurationError(
            f"Trainer(accumulate_grad_batches={k}) with {label}(fixed_batch_size=...): fixed-shape batches size their "
            "own physical batches. Remove accumulate_grad_batches and raise the DataLoader's batch_size (the expected "
            "Poisson batch) instead.")
    strategy._accumulation = Accumulation(weakref.ref(trainer), k, strategy.max_physical_batch_size)
    trainer.accumulate_grad_batches = 1  # the private step accumulates: one clipping, one noise per logical batch
    log.info("%s: Trainer(accumulate_grad_batches=%d): one private step draws the expected batch of %d × the "
             "loader's batch_size and differentiates it in physical batches; Lightning's own accumulation is off for "
             "this fit", label, k, k)


class Accumulation:
    """What :func:`adopt_accumulation` took from the Trainer: its ``accumulate_grad_batches`` (``k``) and the
    strategy's ``max_physical_batch_size`` as given, both given back at the fit's end."""

    def __init__(self, trainer: "weakref.ref[Any]", k: int, physical: Optional[int]) -> None:
        self.trainer, self.k, self.physical = trainer, k, physical


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
        trainer.accumulate_grad_batches = taken.k
