"""A value logged from the training data does not feed back into training (the release boundary's rule 6 in
:mod:`lightning_dp.privacy.boundary`, rule 10 in docs/release_boundary.md).

``self.log("train_loss", loss)`` in ``training_step`` reports an un-noised statistic of the private batch. Reported,
it is outside the guarantee and says so (the README's caveats). Fed back, it is a release without noise: a
``ReduceLROnPlateau`` that monitors it sets the learning rate of every later release from it, an ``EarlyStopping``
sets the number of releases, a ``ModelCheckpoint`` chooses which released model is kept. So a monitored name
(a plateau scheduler's ``monitor``, any callback's ``monitor`` attribute) must not be one that a training hook
logged: :func:`fed_back` finds them, from Lightning's own record of what the training loop logged
(``trainer.fit_loop.epoch_loop._results``: every key logged by ``training_step`` and the training hooks, with its
``_step``/``_epoch`` forms). The values lightning_dp's callbacks log there are functions of the ledger (ε) and are
exempt; a name declared in ``public_state`` is too (the user says it is computed from public data only).

Monitor a metric of held-out data (logged in ``validation_step``) instead. Checked before every release and when
validation starts (so an epoch-end metric is refused before the first release it could steer), on every rank alike.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from lightning_dp.errors import PrivacyConfigurationError

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


def feedback_error(found: Iterable[Consumer]) -> PrivacyConfigurationError:
    """The refusal of :func:`fed_back`'s findings, naming each consumer and the fix."""
    lines = "\n".join(f"- {who} monitors {name!r}, logged by a training hook" for who, name in found)
    return PrivacyConfigurationError(
        "A value logged from the private training batch feeds back into training:\n" + lines + "\nIt is not noised, "
        "so the learning rate, the stopping step or the kept checkpoint it chooses would leak the training data "
        "outside the guarantee. Monitor a metric of held-out data (logged in validation_step), or declare the name "
        "in DPStrategy(public_state=[...]) if it is computed from public data only "
        "(docs/release_boundary.md, rule 10).")
