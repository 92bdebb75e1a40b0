"""The index of a release, and the plan it is charged at, are the mechanism's own: never the caller's.

:class:`~lightning_dp.privacy.private_step.PrivateStep` charges release t the rounds of its noise mechanism at t (banded
DP-MF: one round on the first step of each cycle of b steps, none on the others) at the sampling rate of its plan. Both
rest on what the mechanism itself did, so a loop of one's own may not choose them:

- **The index is the count of releases** (:func:`own_index`): ``steps_taken``, continued by a restored state. An index
  passed to ``release(step)``, ``refusal(step)`` or ``affordable(step)`` must be that count: ``release(step=1)`` every
  step would charge a banded mechanism's rounds at an index off its cycle (none, ever), and the ceilings asked about
  it would never refuse.
- **The sampler's cycle is the ledger's** (:func:`check_drawn_index`, :func:`check_start_step`): with b-min-separated
  sampling batch t holds only group t mod b; the release index of a batch must be the index its group was drawn at, or
  a group is drawn twice within one cycle (charged once). The loader starts each pass at the ledger's count
  (:class:`~lightning_dp.records.recorded_batches.RecordedBatches`), so a state restored after ``poisson_loader()``
  or draws dropped at an epoch's end realign it; a release whose batch was drawn at another index is refused.
- **The plan is the loader's** (:func:`plan_to_keep`): a restored state's sampling plan (q, N, B) is taken only while
  no loader was built (a report in another process); ``poisson_loader()`` then replaces it. Once the loader is built
  the plan stays the loader's: what it draws is what the ledger charges (the checkpoint's entries keep their own q).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_dp.errors import PrivacyConfigurationError

__all__ = ["check_drawn_index", "check_start_step", "own_index", "plan_to_keep"]


def own_index(step: Any, given: Optional[int], where: str = "release", drawn: bool = False) -> int:
    """The index of ``step``'s next release (its ``steps_taken``); ``given`` (the caller's) must be it; ``drawn``: the
    batch taken last must have been drawn at it (:func:`check_drawn_index`)."""
    own = int(step.steps_taken)
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given != own):
        raise PrivacyConfigurationError(
            f"{where}(step={given!r}): the next release is step {own}, the count of releases this mechanism made (a "
            "restored state's included). The index decides what the ledger charges (banded noise charges one round "
            "per cycle of b steps, by index): a loop's own index would charge another step's rounds. Nothing was "
            f"released. Call {where}() without a step (it uses its own count).")
    if drawn:
        check_drawn_index(step, own)
    return own


def check_start_step(step: Any, start_step: Optional[int]) -> int:
    """Where ``poisson_loader``'s sampler starts its group cycle: the ledger's count; ``start_step`` must be it."""
    own = int(step.steps_taken)
    if start_step is not None and int(start_step) != own:
        raise PrivacyConfigurationError(
            f"poisson_loader(start_step={start_step}): the ledger's next release is step {own}. With banded noise the "
            "sampler's group cycle must continue the ledger's (a group drawn twice within one cycle is charged once); "
            "omit start_step: the loader starts each pass at the ledger's count, a state restored before or after "
            "poisson_loader() included.")
    return own


def check_drawn_index(step: Any, index: int) -> None:
    """The batch released at ``index`` must have been drawn at ``index`` (banded noise: its group is index mod b)."""
    batches = step._batches
    drawn = None if batches is None else batches.index
    if step.bands > 1 and drawn is not None and drawn != index:
        step._pending = None  # not released: banked parts go with the step
        raise PrivacyConfigurationError(
            f"the batch released as step {index} was drawn at step {drawn} of the sampler's group cycle (b = "
            f"{step.bands}): its group may have been drawn already within this cycle, which the ledger charges once. "
            "A state was restored (load_state_dict) after this pass of the loader began, or drawn batches were "
            "skipped. Nothing was released. Restore the state before iterating the loader (a new pass starts at "
            "the ledger's count), and release every batch the loader yields.")


def plan_to_keep(step: Any, state: Any) -> bool:
    """Whether ``state``'s sampling plan replaces ``step``'s: only while no loader was built (module docstring)."""
    return state.get("sample_rate") is not None and step._batches is None
