"""The fit loop's own counters and limits: what sets how many releases a fit makes and when an epoch ends (rule 3 of
docs/release_boundary.md).

Lightning decides the length of a fit from counters and limits held by its loops, not only from the trainer's
settings: ``fit_loop.max_batches`` (``trainer.num_training_batches``, a property) ends an epoch, the optimizer steps
counted in ``fit_loop.epoch_loop.automatic_optimization.optim_progress`` (``manual_optimization.optim_step_progress``)
are ``trainer.global_step`` and meet ``max_steps``, the batch progress (``batch_progress.current.ready``,
``is_last_batch``) ends an epoch and the epoch progress meets ``max_epochs``. A hook that writes one of them from the
batch (``optim_progress.optimizer.step.total.completed += 5`` once the batch's label rate is high: zoo36 T21;
``fit_loop.max_batches = 3``: T20) decides the number of releases from un-noised data. :func:`loop_counters` names
them as fingerprint entries (``"trainer optimizer steps"``), and the loop objects that hold them by identity (a
progress object swapped for another); :func:`counters_kept` puts them back as they were. The replays of the user's
hooks compare them with the other decisions (:func:`~.steered_settings.replay_decisions`, :mod:`.decisions`) and put
them back after each run.

The loop itself moves some of them between two of the user's hooks (a batch's progress after ``on_train_batch_end``,
the epoch's after ``on_train_epoch_end``): ``steady=True`` leaves those out, for a comparison across the loop's own
work (a decision window's open and close); :func:`progress` holds them alone, for a comparison right after the user's
hooks (:class:`~.decisions.DecisionWindows` compares them when Lightning's logger connector is told the batch or the
epoch ended, before the loop moves them). The optimizer-step counters and ``max_batches`` the loop moves only inside
a step and as an epoch's data is set up.

Not seen: the data fetcher's and the data loader's iterators (a hook that draws batches from the fetcher ends the
epoch early), and the batch or epoch progress written by ``on_train_epoch_start`` or at a validation's end, where the
loop moves it too before the window closes (compared only when another decision of that window changed).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.records.identity import Same

__all__ = ["counters_kept", "loop_counters", "progress"]

_MISSING = object()

_OBJECTS = ("fit_loop", "fit_loop.epoch_loop", "fit_loop.epoch_progress", "fit_loop.epoch_progress.current",
            "fit_loop.epoch_progress.total", "fit_loop.epoch_loop.batch_progress",
            "fit_loop.epoch_loop.batch_progress.current", "fit_loop.epoch_loop.batch_progress.total",
            "fit_loop.epoch_loop.automatic_optimization", "fit_loop.epoch_loop.automatic_optimization.optim_progress",
            "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer",
            "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step",
            "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.current",
            "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total",
            "fit_loop.epoch_loop.manual_optimization", "fit_loop.epoch_loop.manual_optimization.optim_step_progress",
            "fit_loop.epoch_loop.manual_optimization.optim_step_progress.current",
            "fit_loop.epoch_loop.manual_optimization.optim_step_progress.total")
"""The loop objects that hold the counters, parent before child (a path from the trainer)."""

_STEPS = tuple(p for p in _OBJECTS if p.endswith((".step.current", ".step.total", "optim_step_progress.current",
                                                   "optim_step_progress.total")))
"""The optimizer-step trackers: ``global_step`` (moved by the loop only inside a step)."""

_PROGRESS = ("fit_loop.epoch_progress.current", "fit_loop.epoch_progress.total",
             "fit_loop.epoch_loop.batch_progress", "fit_loop.epoch_loop.batch_progress.current",
             "fit_loop.epoch_loop.batch_progress.total")
"""The batch and epoch progress (``is_last_batch`` on the batch progress itself): moved by the loop between hooks."""


def _objects(trainer: Any) -> dict[str, Any]:
    """Each of :data:`_OBJECTS` found from ``trainer`` (a path that ends early: left out)."""
    out: dict[str, Any] = {}
    for path in _OBJECTS:
        parent, _, key = path.rpartition(".")
        holder = out.get(parent, _MISSING) if parent else trainer
        value = _MISSING if holder is _MISSING else getattr(holder, key, _MISSING)
        if value is not _MISSING and value is not None:
            out[path] = value
    return out


def _fields(obj: Any, completed: bool = False) -> tuple[tuple[str, Any], ...]:
    """A tracker's numbers (and flags) as (name, value) pairs, in order; ``completed``: that count alone (an optimizer
    step's ``ready`` moves as the step begins, before ``training_step``; ``completed`` is ``global_step``)."""
    return tuple((k, v) for k, v in vars(obj).items() if isinstance(v, (int, float, bool))
                 and (not completed or k == "completed")) if hasattr(obj, "__dict__") else ()


def loop_counters(trainer: Any, steady: bool = False) -> Fingerprint:
    """The loop's counters and limits as fingerprint entries: ``"trainer fit_loop.max_batches"``, ``"trainer
    optimizer steps"`` (each step tracker's numbers), ``"trainer loop objects"`` (the objects, by identity) and, unless
    ``steady``, the batch and epoch progress (:func:`progress`); none without a fit loop. ``steady``: what the loop
    moves neither between two training hooks outside a step nor from a batch's arrival to its release (the step
    trackers' ``total.completed`` only: ``current`` is reset as an epoch begins)."""
    objects = _objects(trainer)
    fit = objects.get("fit_loop")
    if fit is None:
        return {}
    out: Fingerprint = {"trainer fit_loop.max_batches": getattr(fit, "max_batches", None),
                        "trainer optimizer steps": tuple((p, _fields(objects[p], steady)) for p in _STEPS
                                                         if p in objects and not (steady and p.endswith("current"))),
                        "trainer loop objects": tuple((p, Same(obj)) for p, obj in objects.items())}
    if not steady:
        out.update(progress(trainer, objects))
    return out


def progress(trainer: Any, objects: Optional[dict[str, Any]] = None) -> Fingerprint:
    """The batch and epoch progress as fingerprint entries (``"trainer batch progress"``, ``"trainer epoch
    progress"``): the numbers the loop moves between hooks."""
    objects = _objects(trainer) if objects is None else objects
    batch = tuple((p, _fields(objects[p])) for p in _PROGRESS if p in objects and ".batch_progress" in p)
    epoch = tuple((p, _fields(objects[p])) for p in _PROGRESS if p in objects and ".epoch_progress" in p)
    return {"trainer batch progress": batch, "trainer epoch progress": epoch} if objects else {}


def counters_kept(trainer: Any, with_progress: bool = True) -> Callable[[], None]:
    """The loop objects and their counters as they are now; the function returned puts them back (an object swapped
    for another first, then each tracker's numbers, then ``max_batches``). ``with_progress=False``: the batch and
    epoch progress left as they are then (a window whose hooks run on both sides of the loop's own moves: an epoch's
    end and the next epoch's start)."""
    objects = _objects(trainer)
    fields = {p: dict(_fields(obj)) for p, obj in objects.items()
              if p in _STEPS or (with_progress and p in _PROGRESS)}
    fit = objects.get("fit_loop")
    max_batches = getattr(fit, "max_batches", _MISSING)

    def put_back() -> None:
        for path, obj in objects.items():
            parent, _, key = path.rpartition(".")
            holder = objects[parent] if parent else trainer
            if hasattr(holder, "__dict__") and vars(holder).get(key, _MISSING) is not obj:
                setattr(holder, key, obj)
        for path, values in fields.items():
            obj = objects[path]
            for key in [k for k, _ in _fields(obj) if k not in values]:  # a number a hook added
                delattr(obj, key)
            for key, value in values.items():
                if vars(obj).get(key, _MISSING) is not value:
                    setattr(obj, key, value)
        if max_batches is not _MISSING and fit is not None and getattr(fit, "max_batches", _MISSING) != max_batches:
            fit.max_batches = max_batches
    return put_back
