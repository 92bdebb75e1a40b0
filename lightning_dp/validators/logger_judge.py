"""Media a training hook that sees no batch writes to a logger: held back, judged by running the hook again.

A histogram, image, text or figure sent to a logger (:mod:`.logger_outputs`) by a hook of the training loop is
refused unless its arrays *are* released state or the method is declared public. In the hooks that are handed no
batch and run after the release (:data:`JUDGED`: ``on_train_start``, the epoch hooks, ``on_train_end``, and
``on_after_backward``, ``on_before_optimizer_step``, ``on_before_zero_grad``, which read ĝ) most such calls are
post-processing of the released model — per-parameter norms of ĝ, the epoch's weight change, a generative model's
samples from its prior, a configuration string — and are judged instead, by what they depend on:

1. the user's hook (of the module or of a callback that is not Lightning's or lightning_dp's) is wrapped for the fit
   (:func:`watch_fit`); as Lightning calls it (not the user's own code inside a step, nor the checks' replays), the
   user's state (:class:`~.snapshot.StateSnapshot`), the weights and the random generators' states are taken;
2. while it runs, a call the rule would refuse is **held back**: nothing is written; its arguments are copied and a
   digest of them taken (:func:`~.logger_outputs.digest`: arrays by their bytes, a figure by its pixels);
3. when it returns with calls held, the hook runs again from the state and generators as it started, on the
   training data's exchanged copy (:meth:`~.step_checks.exchanged_training_data`: the dataset's and every copy in
   memory the batch check exchanges) with the training loop's logged values and training metrics' states moved far
   (:meth:`~.logged_reads.LoggedReads.moved`), logging silenced (:func:`~.hook_replays.replaying`), its logger
   calls recorded and not written; then the state as the first run left it is put back;
4. each held call whose place, method and digest the run again reproduces is written (a function of what the
   exchange leaves alone: the released weights and ĝ, the optimizer's state, the step, the seeds); any other is
   refused, nothing of it written; so is every held call when the run again fails, or when no exchanged copy exists.
   Under DDP every rank runs the hook again when any rank held a call (a rank-0-only ``add_histogram``), and a
   refusal on one rank is raised on every rank (``StepChecks.on_every_rank``): none waits in a collective.

Why this is sound: a hook handed no batch that runs after the release can read the private data only (a) from the
training data in memory, which the run again exchanges, (b) from the logged values and training metrics, which it
moves, or (c) from state kept from a step — refused at that step's release by the kept-state checks (rule 3), before
these hooks run (an outputs list filled by ``training_step`` is refused at the first release). Randomness is replayed
as it was, so prior samples compare equal while a value of the data does not. Nothing held reaches the logs before it
is judged. A taint approach (arguments sharing no storage or autograd history with the batch) was rejected: a value
computed under ``no_grad``, through ``.item()``, numpy or Python numbers, or copied from the dataset by index carries
no history, so absence of history proves nothing.

Not judged: ``training_step`` and the hooks handed the batch, its loss or outputs (``on_train_batch_start``,
``on_before_backward``, ``on_train_batch_end``): their media stay refused unless released state or declared public
(a run again could not exchange the batch already computed from). Not seen: data read from disk inside the hook,
or from the loop's internals (a prefetched batch in Lightning's data fetcher). A hook whose calls differ from run to
run for other reasons (a time stamp in a text) is refused.
"""

from __future__ import annotations

import functools
import inspect
import random
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from lightning_dp.records.library_objects import library_callback, mark_wrapper
from lightning_dp.validators import logger_outputs
from lightning_dp.validators.hook_replays import model_kept, replaying, replaying_now, users_hook
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.step_replays import users_objects

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["JUDGED", "unwatch", "watch_fit"]

JUDGED = ("on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end", "on_after_backward",
          "on_before_optimizer_step", "on_before_zero_grad")
"""The training hooks handed no batch, run after the release (or before any step), whose media calls are judged."""

_WRAPPED: list[tuple[type, str, Any]] = []  # (class, hook, its own attribute or _ABSENT) while watched
_ABSENT = object()


def watch_fit(trainer: "pl.Trainer", public: Callable[[str], bool] = lambda name: False) -> None:
    """:func:`~.logger_outputs.watch_fit`, and the user's :data:`JUDGED` hooks wrapped (at the class level, once per
    class) so that their media calls are held back and judged (module docstring)."""
    logger_outputs.watch_fit(trainer, public)
    unwatch_hooks()
    if not logger_outputs.watching():  # no logger, no writer: nothing to hold back
        return
    module = trainer.lightning_module
    for owner in (module, *(cb for cb in trainer.callbacks if not library_callback(cb))):
        cls = type(owner)
        for name in JUDGED:
            hook = getattr(cls, name, None)
            raw = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
            if users_hook(hook) and inspect.isfunction(raw) and not any(c is cls and n == name
                                                                         for c, n, _ in _WRAPPED):
                _WRAPPED.append((cls, name, vars(cls).get(name, _ABSENT)))
                setattr(cls, name, mark_wrapper(_judged(hook, name, trainer)))


def unwatch() -> None:
    """The fit is over: the loggers' methods and the user's hooks are as they were."""
    logger_outputs.unwatch()
    unwatch_hooks()


def unwatch_hooks() -> None:
    """The user's hooks as they were."""
    while _WRAPPED:
        cls, name, own = _WRAPPED.pop()
        if own is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


def _judged(hook: Callable[..., Any], name: str, trainer: "pl.Trainer") -> Callable[..., Any]:
    @functools.wraps(hook)  # the user's name and module: the replays still see the user's hook
    def judged(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = trainer.lightning_module
        if replaying_now() or logger_outputs.recording() or not trainer.training or \
                getattr(module, "_current_fx_name", None) != name:  # called by the user's code (in a step): refused
            return hook(self, *args, **kwargs)
        start = _State(trainer)
        calls = logger_outputs.Calls(judged=JUDGED)
        with logger_outputs.recorded(calls):
            result = hook(self, *args, **kwargs)
        held = calls.held()
        step = trainer.strategy.private_step
        if step.any_rank(bool(held)):  # alike on every rank (a rank-0-only call): the hook's collectives stay paired
            again = start.run_again(lambda: hook(self, *args, **kwargs))
            step.on_every_rank(lambda: _judge(calls, held, again), f"refused a logger call in {name}")
            for _, _, _, write, _ in held:
                write()
        return result
    return judged


def _judge(calls: "logger_outputs.Calls", held: list[Any], again: "logger_outputs.Calls | None") -> None:
    """Refuse the first held call the run again did not reproduce (raised on every rank alike by the caller)."""
    for position, method, value, _, where in held:
        other = again.entries[position] if again is not None and position < len(again.entries) else None
        if other is None or other[0] != calls.entries[position][0] or other[2] != value:
            raise logger_outputs.output_error(method, where)


def _generators() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _set_generators(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    np.random.set_state(state[2])
    random.setstate(state[3])


class _State:
    """The user's state, the weights and the generators as a judged hook starts; :meth:`run_again` runs it from
    there on the exchanged data."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.module = trainer.lightning_module
        self.step = trainer.strategy.private_step  # type: ignore[attr-defined]
        self.snapshot = self._snapshot()
        self.weights = model_kept(self.module, weights=True)
        self.generators = _generators()

    def _snapshot(self) -> StateSnapshot:
        boundary = self.step.boundary
        return StateSnapshot(self.module, users_objects(self.trainer), boundary.engine_keys,
                             boundary.global_modules())

    def run_again(self, run: Callable[[], Any]) -> "logger_outputs.Calls | None":
        """The calls of ``run`` (the hook) run again from this state on the exchanged data, recorded; ``None`` when
        it fails or no exchanged copy of the training data exists. The state as it is now is put back after."""
        if self.step._source is None:
            return None
        after, weights, generators = self._snapshot(), model_kept(self.module, weights=True), _generators()
        calls = logger_outputs.Calls(again=True)
        reads = getattr(self.trainer.strategy, "_logged_reads", None)
        try:
            self.snapshot.restore()
            self.weights()
            _set_generators(self.generators)
            exchanged = self.step.exchanged_training_data()
            with exchanged.exchanged(), reads.moved(training_only=True) if reads is not None else nullcontext(), \
                    replaying(self.module), logger_outputs.recorded(calls):
                run()
        except Exception:  # noqa: BLE001  (not judged: every held call is refused)
            return None
        finally:
            after.restore()
            weights()
            _set_generators(generators)
        return calls
