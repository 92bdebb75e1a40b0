"""What the training loop monitors, read from Lightning's objects for the release boundary's feedback rule
(:mod:`lightning_dp.privacy.boundary.feedback`): the schedulers and callbacks that steer training by a logged
value, and the names the training hooks logged (``trainer.fit_loop.epoch_loop._results``: every key logged by
``training_step`` and the training hooks, with its ``_step``/``_epoch`` forms)."""

from __future__ import annotations

from typing import Any, Callable

NOT_FROM_DATA: set[str] = set()
"""Names that lightning_dp's own callbacks log in training hooks and whose values are functions of the ledger, not of
the data (ε): each callback adds its own when it is imported."""

Consumer = tuple[str, str]
"""(who reads the value — a scheduler or callback, by class —, the monitored name)."""


def consumers(trainer: Any) -> list[Consumer]:
    """Everything in ``trainer`` that reads a logged value to steer training: plateau schedulers' ``monitor`` and the
    ``monitor`` of every callback (``EarlyStopping``, ``ModelCheckpoint``, a user's)."""
    out: list[Consumer] = []
    for config in getattr(trainer, "lr_scheduler_configs", None) or ():
        if getattr(config, "reduce_on_plateau", False) and isinstance(getattr(config, "monitor", None), str):
            out.append((f"the learning-rate scheduler {type(config.scheduler).__name__}", config.monitor))
    for callback in getattr(trainer, "callbacks", None) or ():
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str) and monitor:
            out.append((f"the callback {type(callback).__name__}", monitor))
    return out


def training_logged(trainer: Any) -> set[str]:
    """The names the training loop logged so far this epoch (as ``callback_metrics`` keys them)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    results = getattr(loop, "_results", None)
    names: set[str] = set()
    for metric in (results.values() if results is not None else ()):
        meta = getattr(metric, "meta", None)
        if meta is None:
            continue
        names.add(meta.name)
        if meta.forked:
            names.update((meta.forked_name(True), meta.forked_name(False)))
    return names


def fed_back(trainer: Any, exempt: Callable[[str], bool]) -> list[Consumer]:
    """The consumers of ``trainer`` that monitor a value the training loop logged (not ``exempt``)."""
    logged = training_logged(trainer)
    return [(who, name) for who, name in consumers(trainer) if name in logged and not exempt(name)]
