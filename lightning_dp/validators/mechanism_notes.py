"""σ, C and the clipping policy's settings between two releases (rule 3 of docs/release_boundary.md: σ and C are
decisions).

The step compares σ and C from its ``training_step`` to its release, and the decision windows (:mod:`.decisions`)
judge what the hooks at a batch's, an epoch's or a validation's end decide. Lightning runs more of the user's code
between two releases than those hooks: a learning-rate scheduler's step (``interval="step"``: after
``on_train_batch_end``; ``"epoch"``: after ``on_train_epoch_end``), a ``LambdaLR``'s lambda, ``lr_scheduler_step``,
``on_before_optimizer_step`` and ``optimizer_step`` after the release, a logger's ``log_metrics`` or a callback's
hook no window runs again. A σ or C set there is judged by nobody: a lambda that reads the median per-example norm
from a logger's copy of ``SecondMomentMonitor``'s non-private diagnostics and sets C to it (zoo15 sm1-C) makes the
next release's C — released with every step as ``privacy/clip_norm`` — an exact, un-noised function of a record.

:class:`MechanismNotes` notes the settings (:func:`~.mechanism_settings.mechanism_decisions`: σ, C, the clipping policy
and its configuration, ``ClippingPolicy.settings``; an adaptive policy's own moves are its releases', not settings)
right after each release (and as each step begins: what the ``on_train_batch_start`` hooks set is the step's, judged
with it), and again where a change is accounted for:

- a decision window whose hooks, run again from the settings as it opened, set the settings as they are now (a C from
  the epoch number in ``on_train_epoch_start``): the window judged them (:meth:`accounted`);
- the library's own moves (:meth:`library_moved`): σ calibrated or refit for the plan when the training loader is
  (re)built, ``on_budget_short="recalibrate"``.

At the start of the next step (before the user's ``on_train_batch_start`` hooks, which the step's own replays judge
with its release), at a checkpoint and at the end of training, a setting that differs from the noted one is refused
(:meth:`check`) before anything more is released or written.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.loop_wraps import wrap_method
from lightning_dp.validators.mechanism_settings import mechanism_decisions, mechanism_entries

__all__ = ["MechanismNotes", "unaccounted_error"]


class MechanismNotes:
    """The mechanism's settings as the last release left them, or as a judged window or the library set them since
    (module docstring). Nothing is noted before the first release (what ``on_train_start`` sets is the run's
    configuration)."""

    def __init__(self) -> None:
        self._noted: Optional[Fingerprint] = None
        self._scheduled: dict[str, tuple[Any, Any]] = {}  # set in lr_scheduler_step: (before, after) of each
        self._unwatch: Optional[Callable[[], None]] = None  # restores the loop's scheduler update

    def note(self, trainer: Any) -> None:
        """The settings as a step begins (what ``on_train_batch_start`` set is the step's: its checks judge it with
        its release, a budget refuses it) and right after its release: what the next step is compared with."""
        self._noted, self._scheduled = mechanism_decisions(trainer), {}

    def watch_scheduler_step(self, trainer: Any) -> None:
        """Wrap the training loop's scheduler update (``trainer.fit_loop.epoch_loop.update_lr_schedulers``: each
        scheduler's step through the module's ``lr_scheduler_step``, a ``LambdaLR``'s lambda in it) for the fit: a
        setting it changes is noted as made there, never accounted for by the window it runs in (a batch's or an
        epoch's end: the window's hooks are judged, the scheduler's step after them is not). Lightning's loop is
        wrapped, not the user's module: a module with a function of the library's among its attributes could not be
        pickled (zoo31 s12: ``torch.save(model)`` in a callback)."""
        self.unwatch()

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def update_lr_schedulers(*args: Any, **kwargs: Any) -> Any:
                before = mechanism_decisions(trainer)
                out = original(*args, **kwargs)
                after = mechanism_decisions(trainer)
                for name in StateFingerprint.changed(before, after):
                    self._scheduled.setdefault(name, (before.get(name), after.get(name)))
                return out
            return update_lr_schedulers

        self._unwatch = wrap_method(trainer.fit_loop.epoch_loop, "update_lr_schedulers", make)

    def unwatch(self) -> None:
        """The scheduler update as it was before :meth:`watch_scheduler_step`."""
        undo, self._unwatch = self._unwatch, None
        if undo is not None:
            undo()

    def accounted(self, opened: dict[str, Any], replayed: Optional[Fingerprint], trainer: Any) -> None:
        """A decision window closed without a refusal: it opened with the settings ``opened``
        (:func:`~.mechanism_settings.mechanism_settings`) and its hooks, run again from them, left ``replayed`` (their
        decisions; ``None``: not run again). A setting that differs from the noted one is accounted for when the
        window opened from the noted value and its hooks were run again and judged: a change made before the window
        opened, or by the scheduler's step in its interval (:meth:`watch_scheduler_step`), is not. (Its hooks run
        again cannot be asked to set the value as it is now: an epoch's end runs again with the epoch counter
        advanced.)"""
        if self._noted is None:
            return
        now, before = mechanism_decisions(trainer), mechanism_entries(opened)
        for name in StateFingerprint.changed(self._noted, now):
            if replayed is not None and name not in self._scheduled and before.get(name) == self._noted.get(name):
                self._noted[name] = now[name]

    def library_moved(self, before: Fingerprint, trainer: Any) -> None:
        """The library changed the settings from ``before`` (:func:`~.mechanism_settings.mechanism_decisions`) to what
        they are now (σ calibrated or refit for the plan): what it moved, from the noted value, is noted."""
        if self._noted is None:
            return
        now = mechanism_decisions(trainer)
        for name in StateFingerprint.changed(before, now):
            if before.get(name) == self._noted.get(name):
                self._noted[name] = now[name]

    def check(self, trainer: Any, where: str) -> None:
        """Refuse a setting that differs from the noted one (:func:`unaccounted_error`)."""
        if self._noted is None:
            return
        now = mechanism_decisions(trainer)
        if self._scheduled:  # set in lr_scheduler_step (even when set back since, or accounted for otherwise)
            names = list(self._scheduled)
            raise unaccounted_error(names, {n: b for n, (b, _) in self._scheduled.items()},
                                    f"{where}; set in lr_scheduler_step, a learning-rate scheduler's step")
        changed = StateFingerprint.changed(self._noted, now)
        if changed:
            raise unaccounted_error(changed, self._noted, where)


_NAMES = {"privacy noise_multiplier": "the noise multiplier σ (private_step.noise_multiplier)",
          "privacy clipping": "the clipping bound C or the clipping policy's settings (private_step.max_grad_norm, "
                              "private_step.clipping)"}


def _value(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "C":
        return f"C = {value[1]:.6g}"
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], type):
        return f"{value[0].__name__}{dict(value[2])}"
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def unaccounted_error(changed: list[str], noted: Fingerprint, where: str) -> PrivacyConfigurationError:
    """The refusal of a σ, C or clipping policy setting changed between two releases where no decision window judged
    it."""
    what = "; ".join(f"{_NAMES.get(n, n)}: {_value(noted.get(n))} at the last release, another value now (not "
                     "quoted: it may be the data's)" for n in changed)
    return PrivacyConfigurationError(
        f"The mechanism's settings changed between two releases where nothing judged the change ({where}): {what}. "
        "σ and C are decisions: set from the training data they steer the next release by un-noised data, and C is "
        "released with every step (privacy/clip_norm). The change was made after the last release outside the hooks "
        "the decision windows run again (on_train_batch_end, on_train_epoch_end/on_train_epoch_start, "
        "on_validation_epoch_end/on_validation_end): most likely in a learning-rate scheduler's step (a LambdaLR "
        "lambda, lr_scheduler_step), in on_before_optimizer_step or optimizer_step, or by a logger or callback that "
        "writes it (a value read back from a logger's storage, e.g. SecondMomentMonitor's non-private diagnostics, "
        "is the training data's, un-noised). Nothing more was released. Set a public schedule from the epoch or step "
        "number in a judged hook (on_train_epoch_start, on_train_batch_end), give a target ε (σ is calibrated), or "
        "let the library move C privately (lightning_dp.clipping.AdaptiveClipping).")
