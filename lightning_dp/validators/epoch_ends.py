"""An epoch ended by ``on_train_batch_start`` returning -1, judged where it is decided (docs/release_boundary.md,
rule 3).

Lightning ends the epoch when the module's ``on_train_batch_start`` returns -1: the batch it was handed is not trained
on, nor is the rest of the epoch. Decided from that batch (``if y.float().mean() > 0.3: return -1``, zoo35 R17, X17,
X17b), the number of releases — possibly none at all, before any release the step's replays could judge — follows the
private data. Each -1 the user's hook returns in a private fit is judged as it is returned (:func:`watch_fit`): the
hook runs again from the state it started from (the user's state and the generators) on the batch exchanged
(:func:`~lightning_dp.record_checks.outside_records.exchanged_copy`, labels included), then on it zeroed, and on
the training data's exchanged copies; an epoch end that the runs again do not repeat is the data's, and refused
before the loop acts on it (nothing of the batch was released). An end at a public place (``if batch_idx == 50:
return -1``, a time budget read from the clock is replayed) trains. Cost: the user's state taken at each call of the
hook; when a -1 is returned, two runs of it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.performance.fixed_batch import zeroed
from lightning_dp.record_checks.outside_records import exchanged_copy
from lightning_dp.records.library_objects import mark_wrapper
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.validators.hook_replays import replaying_now
from lightning_dp.validators import judged_writes
from lightning_dp.validators.logger_judge import StartingState
from lightning_dp.validators.logger_outputs import put_back, wrap_users_hooks

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["unwatch", "watch_fit"]

_WRAPPED: list[tuple[type, str, Any, Any]] = []


def watch_fit(trainer: "pl.Trainer") -> None:
    """Judge every -1 the module's ``on_train_batch_start`` returns in this private fit (module docstring)."""
    unwatch()
    _WRAPPED.extend(wrap_users_hooks(trainer, ("on_train_batch_start",), lambda hook, _: _judged(hook, trainer)))


def unwatch() -> None:
    """The user's hooks as they were."""
    kept = [(cls, name, own) for cls, name, own, wrapper in _WRAPPED if vars(cls).get(name) is wrapper]
    _WRAPPED.clear()
    put_back(kept)


def _judged(hook: Callable[..., Any], trainer: "pl.Trainer") -> Callable[..., Any]:
    @functools.wraps(hook)
    def on_train_batch_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        live = self is trainer.lightning_module and not replaying_now() and trainer.training \
            and getattr(self, "_current_fx_name", None) == "on_train_batch_start" \
            and getattr(trainer.strategy, "private_step", None) is not None
        if not live:
            return hook(self, *args, **kwargs)
        start = judged_writes._UsersState(trainer)  # (the user's state and generators: the fingerprint's cost)
        clock, draws = ClockReads(hook, self), DrawReads(hook, self)  # (served again to the runs again)
        with clock.recording(), draws.recording():
            result = hook(self, *args, **kwargs)
        if isinstance(result, int) and result == -1:
            _judge(trainer, hook, self, args, kwargs, start, (clock, draws))
        return result
    return mark_wrapper(on_train_batch_start)


def _judge(trainer: "pl.Trainer", hook: Callable[..., Any], module: Any, args: tuple, kwargs: dict,
           start: StartingState, reads: tuple[ClockReads, DrawReads]) -> None:
    """Run the hook again from ``start`` on the exchanged batch and data; refuse the -1 unless it returns -1 again."""
    step = trainer.strategy.private_step  # type: ignore[attr-defined]
    again: list[Any] = []
    batch = args[0] if args else kwargs.get("batch")
    rest = args[1:] if args else ()
    other = {k: v for k, v in kwargs.items() if k != "batch"}

    ran = True
    for variant in (exchanged_copy(batch), zeroed(batch)):  # (a label swap alone keeps a rate above 0.3 there)
        def run(variant: Any = variant) -> None:
            with reads[0].replayed(), reads[1].replayed():
                again.append(hook(module, variant, *rest, **other))
        ran = ran and start.run_again(run, {}, numbers=False) is not None
    ended = ran and len(again) == 2 and all(isinstance(r, int) and r == -1 for r in again)

    def refuse() -> None:
        if not ended:
            raise epoch_end_error(trainer.global_step, ran)
    step.on_every_rank(refuse, "refused an epoch end")


def epoch_end_error(step: int, ran: bool) -> PrivacyConfigurationError:
    """The refusal of an epoch ended from the training data by ``on_train_batch_start``."""
    how = "returned something else" if ran else "failed"
    return PrivacyConfigurationError(
        f"on_train_batch_start returned -1 at step {step}, ending the epoch: run again from the state it started "
        f"from on the batch and the training data with their values exchanged for others, it {how}. The end was "
        "decided from the private batch, and with it how many releases the fit makes (Lightning skips the rest of "
        "the epoch), outside the guarantee. Nothing of the batch was released. End epochs at a public place (a "
        "batch index, limit_train_batches, max_steps), or from held-out data at validation.")
