"""The names a training hook logs are a channel beside the values: ``self.log_dict({f"bucket_{int(loss * 1000)}": 1})``
or ``self.log("hi" if loss > 0.69 else "lo", 1.0)`` put the batch's loss into the keys of the trainer's metric dicts
(and the loggers' columns), which the runs with the logged values moved do not move (zoo30 m01, m02).

So the names are judged where they are chosen: the first step's replays of the hooks around a step
(``validators/step_replays.py``) record what each hook logs (:func:`recording`, :func:`hook`, :func:`record`: the
replays' ``self.log`` is silenced, :func:`~lightning_dp.validators.hook_replays.silenced_logging`), and names that
the replays on other data (the batch exchanged, the loss moved) log apart from the two plain replays are the data's
(:func:`names_apart`): refused before any release, naming the hook, never the names. At later steps
:class:`StepNames` notes the names the batch hooks log at each step; a set of names not seen before (a name that
appears or disappears) asks for the next step's batch check, whose replays judge the names the same way
(a name from the step or epoch count — ``f"loss_epoch{epoch}"``, ``"lr-Adam"`` once a schedule starts — is logged
alike on the exchanged data and trains).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional

__all__ = ["BATCH_HOOKS", "StepNames", "hook", "names_apart", "names_error", "due", "record", "recording",
           "take_due"]

BATCH_HOOKS = frozenset({"on_train_batch_start", "training_step", "on_before_backward", "on_after_backward",
                         "on_before_optimizer_step", "on_train_batch_end"})
"""The hooks run at every batch whose logged names :class:`StepNames` follows (as Lightning's results name them)."""

_RECORDING: list[Optional[set[tuple[str, str]]]] = [None]  # (hook, name) logged in the replay running now
_HOOK = ["training_step"]
_DUE = [False]  # a step logged a set of names not seen before: the next batch check judges the names


@contextmanager
def recording() -> Iterator[set[tuple[str, str]]]:
    """Within the block, the names the silenced ``self.log``/``self.log_dict`` are called with, as (hook, name)."""
    outer, _RECORDING[0] = _RECORDING[0], set()
    try:
        yield _RECORDING[0]
    finally:
        _RECORDING[0] = outer


@contextmanager
def hook(name: str) -> Iterator[None]:
    """The hook (``"training_step"``, ``"Callback.on_train_batch_end"``) whose logging :func:`record` notes inside."""
    outer, _HOOK[0] = _HOOK[0], name
    try:
        yield
    finally:
        _HOOK[0] = outer


def record(names: Iterable[Any]) -> None:
    """Note ``names`` logged by the hook running now (while :func:`recording`)."""
    kept = _RECORDING[0]
    if kept is not None:
        kept.update((_HOOK[0], str(n)) for n in names)


def logged(args: tuple, kwargs: dict, many: bool = False) -> None:
    """:func:`record` what a call of ``self.log`` (``many``: ``self.log_dict``) would log."""
    found = args[0] if args else kwargs.get("dictionary" if many else "name")
    record(list(found) if many and isinstance(found, dict) else [] if many or found is None else [found])


def names_apart(runs: list[frozenset]) -> list[str]:
    """The hooks whose logged names a run after the first two (other data) sets apart from those two (the batch,
    twice, alike: what those two set apart — a name from the clock — is not the data's)."""
    if len(runs) < 3 or runs[0] != runs[1]:
        return []
    return sorted({h for other in runs[2:] for h, _ in runs[0] ^ other})


def due() -> bool:
    """Whether a step logged a set of names not seen before, not yet judged (:func:`take_due`)."""
    return _DUE[0]


def take_due() -> bool:
    """Whether a step logged a set of names not seen before since the last call (:meth:`StepNames.close`)."""
    due, _DUE[0] = _DUE[0], False
    return due


def names_error(hooks: list[str], where: str) -> Any:
    """The refusal of names logged from the data (the hooks named, never the names: they carry the data)."""
    from lightning_dp.errors import PrivacyConfigurationError

    return PrivacyConfigurationError(
        f"The names logged by {', '.join(hooks)} (self.log, self.log_dict) were chosen from the data: {where}, "
        "the hook logged other names. A name is not moved as a logged value is: the keys of the trainer's metric "
        "dicts and the loggers' columns would carry the batch (its loss, its labels) to any callback or logger that "
        "reads them, outside the guarantee. Nothing was released. Log under fixed names, or names from the step or "
        "epoch count (f\"loss_epoch{epoch}\"), and put the data's quantity in the value (docs/release_boundary.md, "
        "rule 10).")


class StepNames:
    """The names the batch hooks of a private fit log at each batch (:meth:`note`, from Lightning's results as
    ``self.log`` fills them), closed as the next batch begins (:meth:`close`): a set of names not seen before (a name
    that appeared or disappeared since the first batch's, which the first step's replays judged) makes the next batch
    check judge the names (:func:`take_due`)."""

    def __init__(self) -> None:
        self.seen: set[frozenset] = set()
        self._batch: Optional[int] = None
        self._names: set[tuple[str, str]] = set()

    def note(self, fx: str, name: str, batch: int) -> None:
        """``fx`` logged ``name`` in batch number ``batch``."""
        if fx in BATCH_HOOKS:
            self.close(batch)
            self._names.add((fx, name))

    def close(self, batch: int) -> bool:
        """Batch number ``batch`` (the loop's count of batches made ready) has begun: the last one's names are noted;
        whether they are a set not seen before (then the next batch check judges them)."""
        if batch == self._batch:
            return False
        ran, self._batch = self._batch is not None and self._batch > 0, batch
        key, self._names = frozenset(self._names), set()
        if not ran:
            return False
        new = bool(self.seen) and key not in self.seen
        self.seen.add(key)
        _DUE[0] = _DUE[0] or new
        return new
