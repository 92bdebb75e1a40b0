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
3. when it returns with calls held (or with tensors of the user's state written), the hook runs again from the
   state and generators as it started (the global ones and those the user holds:
   :func:`~.held_values.user_generators`), on the training data's exchanged copy
   (:meth:`~.step_checks.exchanged_training_data`: the dataset's and every copy in memory the batch check
   exchanges), with every other tensor and NumPy array the user's state holds given other values
   (:func:`~.held_values.other_values`: the model's buffers and attributes, the datamodule's, the callbacks', the
   trainer's and strategy's own attributes, the validation and test sets, the training dataset's caches, the
   globals of the user's modules; not the released state), every Python number and string they hold that is not
   a public setting (:func:`~.held_values.numbers_held`: not a saved hyper-parameter, a parameter-group setting, a
   counter in step with the trainer's, a name declared public) and the training loop's logged values and training
   metrics' states moved far (:meth:`~.logged_reads.LoggedReads.moved`), logging silenced
   (:func:`~.hook_replays.replaying`), its logger calls recorded and not written; then the state as the first run
   left it is put back. A tensor the first run wrote that the run again writes alike is a function of the released
   state: later runs again leave it (:func:`~.held_values.derived_from_released`: the weights kept at epoch start);
4. each held call whose place, method and digest the run again reproduces is written (a function of what the
   run again leaves alone: the released weights and ĝ, the optimizer's state, the step, the seeds); any other is
   refused, nothing of it written; so is every held call when the run again fails, or when no exchanged copy exists.
   A refusal is told apart once more (every rank alike): when the hook run again with the Python values left
   reproduces the calls, those values alone moved them, and the refusal names them and the fix
   (``save_hyperparameters()`` or ``public_state``): a configuration text of a setting not saved.
   Under DDP every rank runs the hook again when any rank held a call (a rank-0-only ``add_histogram``), and a
   refusal on one rank is raised on every rank (``StepChecks.on_every_rank``): none waits in a collective.

Why this is sound: a hook handed no batch that runs after the release reads the private data through arrays held in
memory — the training data (exchanged), anything derived from it and held anywhere in the user's state, computed
before the fit or by another hook (given other values unless a run again showed it a function of the released state:
zoo25 found a datamodule's standardised copy, the records' norms, a float64 validation copy, a fetch cache and a copy
on the trainer written when only the copies of the records were exchanged) — or through the logged values and
training metrics (moved); state kept from a step is refused at that step's release (rule 3). Randomness is replayed
as it was, so prior samples compare equal while a value of the data does not. Nothing held reaches the logs before it
is judged. A taint approach (arguments sharing no storage or autograd history with the batch) was rejected: a value
computed under ``no_grad``, through ``.item()``, numpy or Python numbers, or copied from the dataset by index carries
no history, so absence of history proves nothing.

Not judged: ``training_step`` and the hooks handed the batch, its loss or outputs (``on_train_batch_start``,
``on_before_backward``, ``on_train_batch_end``): their media stay refused unless released state or declared public
(a run again could not exchange the batch already computed from). Not seen: data read from disk inside the hook,
from the loop's internals (a prefetched batch in Lightning's data fetcher), or held where the walk of
:mod:`.held_values` does not reach (a closure of a class defined in a function, a library object's attributes; a
Python number in a helper object, a global of the user's modules, on the trainer, or under a public setting's name
with its value: :mod:`lightning_dp.fingerprints.held_numbers`).
A hook whose calls differ from run to run for other reasons (a time stamp in a text) is refused; so is one that
logs a value of public data the user's state holds (given other values too): declare the method public.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.library_objects import is_library, mark_wrapper
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import bit_exact
from lightning_dp.replays.starting_state import Generators, Piece, StartingState as Saved, gradients, put_back_after
from lightning_dp.validators import logger_outputs
from lightning_dp.validators.held_values import (derived_from_released, numbers_held, other_values, tensors_held,
                                                 user_generators)
from lightning_dp.validators.hook_replays import model_kept, replaying, replaying_now
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.step_replays import users_objects

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["JUDGED", "StartingState", "unwatch", "watch_fit"]

JUDGED = ("on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end", "on_after_backward",
          "on_before_optimizer_step", "on_before_zero_grad")
"""The training hooks handed no batch, run after the release (or before any step), whose media calls are judged."""

_WRAPPED: list[tuple[type, str, Any, Any]] = []  # (class, hook, its own attribute, wrapper) while watched


def watch_fit(trainer: "pl.Trainer", public: Callable[[str], bool] = lambda name: False) -> None:
    """:func:`~.logger_outputs.watch_fit`, and the user's :data:`JUDGED` hooks wrapped (at the class level, once per
    class) so that their media calls are held back and judged (module docstring)."""
    logger_outputs.watch_fit(trainer, public)
    unwatch_hooks()
    if not logger_outputs.watching():  # no logger, no writer: nothing to hold back
        return
    _WRAPPED.extend(logger_outputs.wrap_users_hooks(
        trainer, JUDGED, lambda hook, name: mark_wrapper(_judged(hook, name, trainer))))


def unwatch() -> None:
    """The fit is over: the loggers' methods and the user's hooks are as they were."""
    logger_outputs.unwatch()
    unwatch_hooks()


def unwatch_hooks() -> None:
    """The user's hooks as they were."""
    logger_outputs.put_back([(cls, name, own) for cls, name, own, _ in _WRAPPED])
    _WRAPPED.clear()


def _judged(hook: Callable[..., Any], name: str, trainer: "pl.Trainer") -> Callable[..., Any]:
    @functools.wraps(hook)  # the user's name and module: the replays still see the user's hook
    def judged(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = trainer.lightning_module
        if replaying_now() or logger_outputs.recording() or not trainer.training or \
                getattr(module, "_current_fx_name", None) != name:  # called by the user's code (in a step): refused
            return hook(self, *args, **kwargs)
        start = StartingState(trainer)
        calls = logger_outputs.Calls(judged=JUDGED)
        clock = ClockReads(hook, self)  # the clocks it reads, replayed in the runs again (a time stamp logged)
        draws = DrawReads(hook, self)  # and its unseeded draws
        with logger_outputs.recorded(calls), clock.recording(), draws.recording():
            result = hook(self, *args, **kwargs)
        held = calls.held()
        written = start.written()
        step = trainer.strategy.private_step
        if step.any_rank(bool(held) or bool(written)):  # alike on every rank: the hook's collectives stay paired
            again = start.run_again(lambda: _replayed((clock, draws), hook, self, args, kwargs), written)
            numbers: list[str] = []
            if step.any_rank(bool(start.numbers) and not _reproduced(calls, held, again)):  # which values moved it
                plain = start.run_again(lambda: _replayed((clock, draws), hook, self, args, kwargs), {},
                                        numbers=False)
                numbers = start.numbers if _reproduced(calls, held, plain) else []
            step.on_every_rank(lambda: _judge(calls, held, again, numbers), f"refused a logger call in {name}")
            for _, _, _, write, _ in held:
                write()
        return result
    return judged


def _replayed(read: tuple[ClockReads, DrawReads], hook: Callable[..., Any], owner: Any, args: tuple,
              kwargs: dict) -> Any:
    """The hook run again reading the clock values and the unseeded draws its first run read."""
    with read[0].replayed(), read[1].replayed():
        return hook(owner, *args, **kwargs)


def _reproduced(calls: "logger_outputs.Calls", held: list[Any], again: "logger_outputs.Calls | None") -> bool:
    """Whether the run again made each held call at its place with the same digest."""
    return all(again is not None and position < len(again.entries) and again.entries[position][0] ==
               calls.entries[position][0] and again.entries[position][2] == value for position, _, value, _, _ in held)


def _judge(calls: "logger_outputs.Calls", held: list[Any], again: "logger_outputs.Calls | None",
           numbers: list[str]) -> None:
    """Refuse the first held call the run again did not reproduce (raised on every rank alike by the caller);
    ``numbers``: the Python values whose other values alone moved it, named with the fix."""
    for position, method, value, _, where in held:
        if not _reproduced(calls, [(position, method, value, None, where)], again):
            error = logger_outputs.output_error(method, where)
            if numbers:
                shown = ", ".join(numbers[:6]) + (" …" if len(numbers) > 6 else "")
                error = PrivacyConfigurationError(
                    f"{error} What it writes changed when the Python values (numbers, strings) the user's state holds "
                    f"were given other values ({shown}): a number or string computed from the training data (a norm, "
                    "a count, class counts, a string of records) is as private as the data. If the value it writes "
                    "is a public setting, save it as a hyper-parameter (self.save_hyperparameters()) or declare its "
                    f"name public: DPStrategy(public_state={numbers[:2]!r}).")
            raise error


class StartingState:
    """The user's state, the weights, ĝ and the generators as a judged hook starts (its media calls here, its writes
    in :mod:`.judged_writes`), saved and put back by :mod:`lightning_dp.replays`; :meth:`run_again` runs it from
    there on the exchanged data."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.module = trainer.lightning_module
        self.step = trainer.strategy.private_step  # type: ignore[attr-defined]
        self.tensors = {path: (t, t._version) for path, t in self._tensors().items()}
        self.numbers: list[str] = []  # the Python values the last run again gave other values (their names)
        self.saved = Saved(*self._pieces(copied=True))
        self.generators = Saved(Generators, lambda: user_generators([self.module, *users_objects(self.trainer)]))
        self.restored: Callable[[], None] = lambda: None  # called as a run again starts from this state
        self.moved_lists: list[list] = []  # in a run again, the user's lists of numbers given other values

    def _pieces(self, copied: bool) -> list[Piece]:
        """The user's state, the weights and ĝ (``copied``: its values)."""
        boundary = self.step.boundary
        return [lambda: StateSnapshot(self.module, users_objects(self.trainer), boundary.engine_keys,
                                      boundary.global_modules()).restore,
                lambda: model_kept(self.module, weights=True),
                lambda: gradients(list(self.module.parameters()), copied)]

    def _tensors(self) -> dict[str, torch.Tensor]:
        return tensors_held(self.trainer, self.step._source[0] if self.step._source is not None else None,
                            self.step.boundary.global_modules())

    def written(self, library: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, a copy of its values) of the user's state (:func:`~.held_values.tensors_held`) the hook made
        or wrote in place; not a library module's unless ``library`` (a torchmetrics state an epoch-end hook resets:
        running the hook again for it would run a decision taken beside it again, outside the decision checks'
        windows)."""
        skipped = set() if library else {
            id(v) for m in self.module.modules() if is_library(m)
            for v in (*vars(m).values(), *m._buffers.values()) if isinstance(v, torch.Tensor)}
        return {path: (t, t.detach().clone()) for path, t in self._tensors().items() if id(t) not in skipped and (
                path not in self.tensors or self.tensors[path][0] is not t or self.tensors[path][1] != t._version)}

    def put_back(self) -> None:
        """The user's state, the weights and ĝ as the hook started (a write refused is not left in memory)."""
        self.saved.put_back()

    def run_again(self, run: Callable[[], Any], written: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  numbers: bool = True, other_data: bool = True,
                  arrays: bool = True) -> "logger_outputs.Calls | None":
        """The calls of ``run`` (the hook) run again from this state on the exchanged data, recorded; ``None`` when
        it fails or no exchanged copy of the training data exists. The state as it is now is put back after. Of the
        tensors the first run ``written``, those the run again makes alike are functions of the released state
        (:func:`~.held_values.derived_from_released`). ``numbers``: the Python values given other values too
        (:func:`~.held_values.numbers_held`; their names kept in :attr:`numbers`). ``other_data=False``: on the
        same data (a control: what differs there too is not the data's, a time stamp). ``arrays=False``: the other
        tensors and arrays of the user's state keep their values (validation's end: they hold the held-out
        validation's outputs)."""
        if self.step._source is None:
            return None
        calls = logger_outputs.Calls(again=True)
        alike: list[torch.Tensor] = []
        try:
            with put_back_after(*self._pieces(copied=False), Generators,  # ĝ as it is now: a run again writes copies
                                lambda: user_generators([self.module, *users_objects(self.trainer)])):
                reads = getattr(self.trainer.strategy, "_logged_reads", None)
                moved = reads.moved(training_only=True) if reads is not None and other_data else nullcontext()
                self.saved.put_back()  # ĝ as the hook was handed it (clip_grad_norm_ writes it in place)
                self.generators.put_back()
                self.restored()
                exchanged = self.step.exchanged_training_data()
                others = other_values(self.trainer, self.step._source[0], self.step.boundary.global_modules(),
                                      [value for _, value in exchanged.arrays],
                                      logger_outputs.released_state(self.module, lambda: self.trainer.optimizers))
                held = numbers_held(self.trainer, self.step._source[0], self.step.boundary.public_state,
                                    [v for _, v in exchanged.arrays + others.arrays]) if numbers else None
                self.numbers = held.names if held is not None else self.numbers
                held = held if other_data else None
                self.moved_lists = [v for _, v in others.arrays if type(v) is list] if other_data and arrays else []
                with exchanged.exchanged() if other_data else nullcontext(), \
                        others.exchanged() if other_data and arrays else nullcontext(), \
                        held.exchanged() if held is not None else nullcontext(), \
                        moved, replaying(self.module), logger_outputs.recorded(calls):
                    run()
                    now = self._tensors() if written else {}
                    alike = [t for path, (t, first) in written.items() if path in now and bit_exact(now[path], first)]
        except Exception:  # noqa: BLE001  (not judged: every held call is refused)
            return None
        derived_from_released(alike)
        return calls
