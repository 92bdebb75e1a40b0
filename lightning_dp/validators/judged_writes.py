"""Writes to kept state by the training hooks that run outside the step computation, judged (rule 3 of
docs/release_boundary.md) instead of refused outright.

A hook that runs after the release, or that is handed no batch — :data:`HOOKS`: a batch's end, ``on_before_zero_grad``,
``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``, a validation's start and end
during a fit, ``on_train_end`` (an adapter merged into the weights: qa13 c7) — may write the parameters, buffers,
the model's or a callback's attributes, or the released ĝ, as a function of released state only: post-processing,
which DP allows (a Keras-style max-norm projection of the weights, a clamp, ``clip_grad_norm_`` of ĝ, an EMA of the
weights kept at a batch's end and swapped in for validation, weight decay by hand). Such a write is judged where it
is made:

1. the user's hook (of the module, or of a callback that is not Lightning's or lightning_dp's) is wrapped for the fit
   (:func:`watch_fit`); as Lightning calls it, the user's state, the weights, ĝ and the generators are taken
   (:class:`~.logger_judge.StartingState`) with the kept state's fingerprint (as the release boundary reads it, and
   in full);
2. when the hook wrote kept state or ĝ, it runs again from that starting state: on the training data's exchanged
   copy, every other tensor and NumPy array of the user's state given other values
   (:func:`~.held_values.other_values`), the logged values moved, the user's generators replayed — and, at a batch's
   end, on the batch exchanged with its outputs moved far, then on its floating-point values exchanged with its
   outputs moved near zero (:func:`~lightning_dp.record_checks.outside_records.exchanged_copy`,
   :func:`~.hook_replays.moved_far`);
3. the write is accepted — it becomes what the next release compares with (``ReleaseBoundary.accept``; a ĝ
   post-processed is what the optimizer steps with, ``ReleaseBoundary.released``) and its tensors are functions of
   the released state (:func:`~.held_values.derived_from_released`: a later judge leaves their values) — only when
   every run again reproduces it bit-exactly: the same entries of the kept state's full fingerprint, the same
   parameters, ĝ and written tensors of the user's state, nothing else written. The clocks the hook reads are
   replayed (:class:`~lightning_dp.replays.clock.ClockReads`: each run again reads the values the real run read), so
   time stamps kept in a list are written alike, and so are its unseeded draws
   (:class:`~lightning_dp.replays.draws.DrawReads`: jitter from ``np.random.default_rng()`` kept alone is accepted,
   the batch's mean with it added refused); a list of numbers the run again gave other values is compared with
   its items' own values back, the items the hook wrote as written. (A difference that a run again on the same data
   shows too — a clock read elsewhere — is excused only for a Python number, a batch timer's duration: never for a
   tensor, an array, a container, the weights or ĝ, where an unseeded generator or the loader's own sampler would
   hide the data behind it). Between the release and the update (:data:`_BEFORE_UPDATE`: ``on_after_backward``,
   ``on_before_optimizer_step``, ``configure_gradient_clipping``) ĝ is held as released in the runs again, so a write
   that depends on the private data beyond ĝ moves with the exchanged copy — a statistic of the training set
   (``trainer.train_dataloader.dataset.tensors[0].mean(0)``, the datamodule's tensor) kept in a buffer: lw31 —
   while the norm of ĝ, a step counter or an EMA of the weights kept there is reproduced; the optimizers' and
   schedulers' state is compared there too (:class:`_Settings`: a statistic kept in ``optimizer.state[p]``, a
   parameter group's key or on a scheduler, zoo32 j04, j05, j11, is refused; a warm-up of the learning rate from the
   step count trains). Otherwise a write to kept state is refused there
   (:meth:`~lightning_dp.privacy.boundary.ReleaseBoundary.written_error`); a ĝ changed is left to the check before
   the update, and ``on_train_end``'s write to the end of the fit's (:mod:`.end_of_fit`, which puts it back), which
   refuse them as before.

Cost: a hook that wrote nothing at its first call is not run again at its later calls: each is watched by the release
boundary's fingerprint (version counters and norms, no full checksums, no starting state) and a write it starts
making later — at step 5, on the second epoch, once the loss is low — is refused there (:meth:`_Judge.watched`:
it cannot be run again from where it started), even under a name the boundary accepts for other reasons (a counter
``training_step`` keeps, overwritten from the data: judged29); a hook that writes from its first call on is judged
at each. Between the release and the update a quiet hook's call also takes the user's state and generators as it
starts (:class:`_UsersState`: no weights, no ĝ — the call must leave them, else it is refused as late —, at about
the fingerprint's cost), so that a late write to the rest is run again from there and judged
(:meth:`_Judge.late_judged`: the norm of ĝ kept every 5th step trains, a statistic of the training set kept there is
refused). A batch's end stays fully watched while the first step's replays found its hooks writing (``expected``). A
hook that writes pays its runs again at every call.

What starts as released: at the start of training, a tensor of the user's state equal to a parameter (an EMA's copy of
the weights) or all zeros (a counter) is a function of the released state. At ``on_validation_end`` the other tensors
of the user's state keep their values in the runs again (they hold what validation computed on held-out data: the
best held-out loss kept from its outputs trains); the training data is exchanged and its logged values moved, so a
statistic of the training set read there (``trainer.train_dataloader.dataset.tensors``, which no record read shows)
is refused; a copy of the training data the user's state held before the fit, read there, is not seen. Not judged:
``on_validation_epoch_end`` and ``validation_step`` (held-out data: what they keep after validation reads a training
record is refused by the comparison at validation's end), the hooks inside the step (``training_step``,
``on_train_batch_start``, ``on_before_backward``: the replays of :mod:`.step_replays` judge them), a hook called by
the user's own code. Python numbers and strings of the user's state keep their values in a run again
(:mod:`.held_values`): a write computed from one held as a float is not seen as the data's (a float of the training
set taken before the fit scaling the weights passes, as a C or σ chosen on it would; giving them other values would
refuse an EMA's decay and a max-norm bound held as floats on a callback, which cannot save hyper-parameters: judged29).
"""

from __future__ import annotations

import functools
import operator
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.adjacent_hooks import only_the_loop_between
from lightning_dp.fingerprints.checksums import content_sums
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, changed_entries
from lightning_dp.fingerprints.state_walker import freeze
from lightning_dp.records.identity import Same
from lightning_dp.records.library_objects import mark_wrapper
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import bit_exact
from lightning_dp.replays.starting_state import StartingState as Saved
from lightning_dp.validators.held_values import derived_from_released, tensors_held
from lightning_dp.validators.hook_replays import moved_far, moved_near, replaying_now
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.logger_judge import StartingState
from lightning_dp.validators.logger_outputs import put_back, wrap_users_hooks
from lightning_dp.validators.steered_settings import decisions, schedulers, settings_kept
from lightning_dp.record_checks.outside_records import exchanged_copy

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["HOOKS", "current", "unwatch", "watch_fit"]

HOOKS = ("on_train_batch_end", "on_before_zero_grad", "on_after_backward", "on_before_optimizer_step",
         "configure_gradient_clipping", "on_validation_start", "on_validation_end", "on_train_end")
"""The hooks whose writes are judged (module docstring)."""

_BEFORE_UPDATE = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
"""The hooks that run between the release and the update: a ĝ they post-process is what the optimizer steps with."""

_WRAPPED: list[tuple[type, str, Any, Any]] = []  # (class, hook, its own attribute, the wrapper) while watched
_CURRENT: list["_Judge"] = []  # the fit's judge while watched (shared with :mod:`.judged_updates`)
_ABSENT = object()


def watch_fit(trainer: "pl.Trainer", expected: Callable[[], bool] = lambda: False, updates: bool = False) -> None:
    """Wrap the user's :data:`HOOKS` (at the class level, once per class) for the fit; ``expected()``: whether the
    first step's replays found the batch-end hooks writing (they stay watched). Called as training starts: the
    tensors of the user's state that start as released are noted (module docstring)."""
    unwatch()
    judge = _Judge(trainer, expected)
    _CURRENT.append(judge)
    _WRAPPED.extend(wrap_users_hooks(trainer, HOOKS, lambda hook, name: _wrapped(hook, name, judge)))
    if _WRAPPED or updates:  # (``updates``: the optimizer's update runs the user's code, judged by .judged_updates)
        judge.note_released()


def unwatch() -> None:
    """The user's hooks as they were (a class attribute replaced since by another is left)."""
    kept = [(cls, name, own) for cls, name, own, wrapper in _WRAPPED if vars(cls).get(name) is wrapper]
    _WRAPPED.clear()
    _CURRENT.clear()
    put_back(kept)


def current() -> Optional["_Judge"]:
    """The judge of the fit being watched (:func:`watch_fit`), if any: its starting states, fingerprint and released
    tensors are what :mod:`.judged_updates` judges the optimizer's update with."""
    return _CURRENT[-1] if _CURRENT else None


def _wrapped(hook: Callable[..., Any], name: str, judge: "_Judge") -> Callable[..., Any]:
    @functools.wraps(hook)  # the user's name and module: the replays still see the user's hook
    def judged(self: Any, *args: Any, **kwargs: Any) -> Any:
        if replaying_now() or not judge.live(name):
            judge.last = None  # (a chain of watched calls: only the next watched call continues it)
            return hook(self, *args, **kwargs)
        return judge.call(hook, self, name, args, kwargs, sys._getframe(1))
    return mark_wrapper(judged)


class _Judge:
    """What the wrappers of one fit share: the trainer, the hooks found writing nothing, the fingerprint."""

    def __init__(self, trainer: "pl.Trainer", expected: Callable[[], bool]) -> None:
        self.trainer = trainer
        self.expected = expected
        self.quiet: set[tuple[type, str]] = set()  # (class, hook) whose first call wrote nothing: not watched
        self._fingerprint: Optional[tuple[Any, StateFingerprint]] = None
        self.released: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # tensors with the values released with
        self.last: Optional[tuple[Any, ...]] = None  # the last watched call: (caller frame, owner, hook, fingerprint,
        # callbacks, the fingerprint after it), while it found nothing written and no other hook of ours ran since

    @property
    def step(self) -> Any:
        return self.trainer.strategy.private_step  # type: ignore[attr-defined]

    def live(self, name: str) -> bool:
        """Whether Lightning calls the hook ``name`` now, in a private fit (not the user's code calling it)."""
        trainer, module = self.trainer, self.trainer.lightning_module
        if getattr(module, "_current_fx_name", None) != name or getattr(trainer.strategy, "private_step", None) is None:
            return False
        if name in ("on_validation_start", "on_validation_end"):
            return trainer.state.fn == "fit" and trainer.validating and not trainer.sanity_checking
        return bool(trainer.training)

    def fingerprint(self) -> StateFingerprint:
        module = self.trainer.lightning_module
        if self._fingerprint is None or self._fingerprint[0] is not module:
            self._fingerprint = (module, self.step.boundary.fingerprint(module))
        return self._fingerprint[1]

    def _held(self) -> dict[str, torch.Tensor]:
        boundary = self.step.boundary
        datasets = boundary.datasets()
        return tensors_held(self.trainer, datasets[0] if datasets else None, boundary.global_modules())

    def note_released(self) -> None:
        """The tensors of the user's state that start as released: equal to a parameter, or all zeros."""
        params = [p.detach() for p in self.trainer.lightning_module.parameters()]
        for t in self._held().values():
            if t.numel() and t.layout == torch.strided and (not t.detach().any() or any(
                    type(p) is type(t.detach()) and p.shape == t.shape and p.dtype == t.dtype and p.device == t.device
                    and torch.equal(p, t.detach())  # (a sharded parameter, a DTensor, is no plain tensor's equal)
                    for p in params)):
                self.released[id(t)] = (t, t.detach().clone())

    def mark_released(self) -> None:
        """Those of :attr:`released` that hold the values they were released with are functions of the released state
        (:func:`~.held_values.derived_from_released`, by version counter: noted again whenever a run again starts,
        since putting a starting state back moves the counters)."""
        derived_from_released([t for t, value in self.released.values() if bit_exact(t, value)])

    def call(self, hook: Callable[..., Any], owner: Any, name: str, args: tuple, kwargs: dict,
             caller: Any = None) -> Any:
        """Run the hook; judge what it wrote (module docstring). ``caller``: the frame that called it."""
        key = (type(owner), name)
        if key in self.quiet and not (name == "on_train_batch_end" and self.expected()):
            return self.watched(hook, owner, name, args, kwargs, caller)
        self.last = None
        boundary, fingerprint = self.step.boundary, self.fingerprint()
        callbacks = boundary.callbacks()
        self.mark_released()
        start = StartingState(self.trainer)
        start.restored = self.mark_released
        full = fingerprint.take(callbacks, full=True)
        params = list(self.trainer.lightning_module.named_parameters())
        places = [(p.data_ptr(), p._version) for _, p in params]  # a rebinding through .data keeping the values
        grads = [(p, p.grad, -1 if p.grad is None else p.grad._version) for _, p in params] \
            if name in _BEFORE_UPDATE else []  # (StartingState keeps ĝ's values, for the runs again)
        clock = ClockReads(hook, owner)  # the clocks it reads, replayed in the runs again (time stamps in a list)
        draws = DrawReads(hook, owner)  # and its unseeded draws (jitter kept in state)
        settings = _Settings(self.trainer) if name in _BEFORE_UPDATE else None  # the optimizers', the schedulers'
        before = settings.entries(full=True) if settings else {}
        with clock.recording(), draws.recording():
            result = hook(owner, *args, **kwargs)
        first = fingerprint.take(callbacks, full=True)
        names = list(dict.fromkeys([*StateFingerprint.changed(full, first), *(
            f"parameter {n}" for (n, p), place in zip(params, places) if (p.data_ptr(), p._version) != place)]))
        moved = [p for p, g, version in grads if p.grad is not g or (g is not None and g._version != version)]
        settled = changed_entries(before, after := settings.entries(full=True)) if settings else []
        if not self.step.any_rank(bool(names or moved or settled)):  # alike on every rank: collectives stay paired
            self.quiet.add(key)
            return result
        self.quiet.discard(key)
        written = start.written(library=True)  # (an AveragedModel's count)
        again = _RunAgain(self, start, first, names, grads, written)
        again.handed, again.clock, again.draws = args, clock, draws
        again.arrays = name != "on_validation_end"  # what validation computed and keeps: held-out data's
        if settings:
            again.settings, again.settled, again.first_settings = settings, settled, after
            start.restored = _chained(settings.put_back, self.mark_released)
            as_written = _Settings(self.trainer)
        reproduced = again.every_run(lambda variant: hook(owner, *variant, **kwargs), _variants(owner, name, args,
                                                                                             self.trainer))
        if settings:
            as_written.put_back()  # (the last run again's, from other data: not kept)

        def judge() -> None:  # at the fit's end, what is refused is put back first (EndOfFit.judge): left to it
            if (names or settled) and not reproduced and name != "on_train_end":
                start.put_back()  # nothing of the refused write stays in memory (a record kept in a buffer)
                if settings:
                    settings.put_back()
                at = "at the end of step" if name == "on_train_batch_end" else "at step"
                raise _refusal(boundary, names, settled, _WHERE.format(
                    hook=f"{type(owner).__name__}.{name} {at} {self.trainer.global_step}"))
        self.step.on_every_rank(judge, f"refused a write in {name}")
        if reproduced:
            boundary.accept(names)
            if (statistics := getattr(self.step, "written_statistics", None)) is not None:
                statistics.note_written(names)  # (a parameter written through .data: no version moved)
            self.released.update((id(t), (t, t.detach().clone())) for t, _ in written.values())
            self.mark_released()
            if moved:  # ĝ post-processed as a function of itself: what the optimizer steps with
                boundary.released([p for _, p in params if p.grad is not None and p.requires_grad])
        return result

    def watched(self, hook: Callable[..., Any], owner: Any, name: str, args: tuple, kwargs: dict,
                caller: Any = None) -> Any:
        """Run a hook that wrote nothing at its first call (no starting state taken, no full checksums) and refuse
        what it writes now: kept state, as the release boundary's fingerprint shows it, or a parameter (module
        docstring: a write that starts later — at step 5, on the second epoch, once the loss is low — cannot be run
        again from where it started; the boundary alone would let one through under a name it accepts for other
        reasons, a counter ``training_step`` keeps). The fingerprint before is the one after the last watched call
        when only Lightning's callback loop ran since (:func:`~.adjacent_hooks.only_the_loop_between`: the same
        state), else taken now."""
        fingerprint, callbacks = self.fingerprint(), self.step.boundary.callbacks()
        params = list(self.trainer.lightning_module.named_parameters())
        places = [(p.data_ptr(), p._version) for _, p in params]
        last, self.last = self.last, None
        before = last[5] if last is not None and caller is last[0] and name == last[2] and fingerprint is last[3] \
            and len(callbacks) == len(last[4]) and all(map(operator.is_, callbacks, last[4])) \
            and only_the_loop_between(caller, last[1], owner, name, self.trainer) else fingerprint.take(callbacks)
        del last
        start = _UsersState(self.trainer) if name in _BEFORE_UPDATE else None  # (cheap: no weights, no ĝ copied)
        grads = [(p, p.grad, -1 if p.grad is None else p.grad._version) for _, p in params] if start else []
        start_settings = (settings := _Settings(self.trainer)).entries(full=False) if start else {}
        result = hook(owner, *args, **kwargs)
        after = fingerprint.take(callbacks)
        names = list(dict.fromkeys([*StateFingerprint.changed(before, after), *(
            f"parameter {n}" for (n, p), place in zip(params, places) if (p.data_ptr(), p._version) != place)]))
        settled = changed_entries(start_settings, settings.entries(full=False)) if start else []
        late, refused = (_LATE, names) if start is None else \
            self.late_judged(hook, owner, args, kwargs, start, names, grads, (settings, settled))
        if not names and not settled and caller is not None:
            self.last = (caller, owner, name, fingerprint, callbacks, after)

        def judge() -> None:
            if refused:
                if start is not None:
                    start.put_back()  # (the user's state: nothing of the refused write stays in memory)
                    settings.put_back()
                raise _refusal(self.step.boundary, [n for n in refused if n not in settled],
                               [n for n in refused if n in settled], late.format(
                                   hook=f"{type(owner).__name__}.{name} at step {self.trainer.global_step}"))
        self.step.on_every_rank(judge, f"refused a late write in {name}")
        return result

    def late_judged(self, hook: Callable[..., Any], owner: Any, args: tuple, kwargs: dict, start: "_UsersState",
                    names: list[str], grads: list[tuple[Any, Any, int]],
                    settings: tuple["_Settings", list[str]]) -> tuple[str, list[str]]:
        """A late write (``names``) of a hook between the release and the update (:data:`_BEFORE_UPDATE`): its
        writes to kept state other than the weights are judged as at a judged call — run again from ``start`` (the
        user's state as the call started) on the training data's exchanged copies with ĝ held fixed, accepted when
        reproduced (the norm of ĝ kept every 5th step), refused when they move with the exchanged data (a statistic
        of the training set kept in a buffer). A parameter written, or ĝ changed, beside them: all refused as a late
        write (the weights and ĝ as the call started were not kept: no run again); ĝ changed alone is left to the
        check before the update. ``settings``: the optimizers' and schedulers' state as the call started
        (:class:`_Settings`) and the entries of it the call changed, judged alike. Returns the refusal's message and
        the names refused (none: accepted)."""
        kept = [n for n in names if not n.startswith("parameter ")]
        moved = any(p.grad is not g or (g is not None and g._version != version) for p, g, version in grads)
        state, settled = settings
        if not self.step.any_rank(bool(kept or settled)):  # (alike on every rank: the hook's collectives stay paired)
            return _LATE, names
        if self.step.any_rank(moved or len(kept) < len(names)):
            return _LATE, [*names, *settled]
        start.complete()
        start.restored = _chained(state.put_back, self.mark_released)
        written = start.written(library=True)
        again = _RunAgain(self, start, self.fingerprint().take(self.step.boundary.callbacks(), full=True), kept,
                          grads, written)
        again.handed = args
        again.settings, again.settled, again.first_settings = state, settled, state.entries(full=True)
        as_written = _Settings(self.trainer)
        reproduced = again.every_run(lambda variant: hook(owner, *variant, **kwargs), [args])
        as_written.put_back()
        if reproduced:
            self.step.boundary.accept(kept)
            self.released.update((id(t), (t, t.detach().clone())) for t, _ in written.values())
            self.mark_released()
            return _WHERE, []
        return _WHERE, [*kept, *settled]


class _UsersState(StartingState):
    """The starting state of a call of a quiet hook between the release and the update: the user's state and the
    generators alone, taken at every call (a late write there is run again from it: :meth:`_Judge.late_judged`); the
    weights and ĝ, which such a call must leave as they were, are taken when it is run again (:meth:`complete`)."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self._whole = False
        super().__init__(trainer)

    def _pieces(self, copied: bool) -> list[Any]:
        pieces = super()._pieces(copied)
        return pieces if self._whole or not copied else pieces[:1]  # (the first: the user's state)

    def complete(self) -> None:
        """The weights and ĝ as now (as the call started: it left them) added to the starting state."""
        users, self._whole = self.saved, True
        self.saved = Saved(lambda: users.put_back, *self._pieces(copied=True)[1:])


class _RunAgain:
    """The runs again of one judged call, each from its starting state, compared with the first (module docstring)."""

    def __init__(self, judge: _Judge, start: StartingState, first: Fingerprint, names: list[str],
                 grads: list[tuple[Any, Any, int]], written: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.judge, self.start, self.first, self.names, self.written = judge, start, first, names, written
        module = judge.trainer.lightning_module
        self.params = [(p, p.detach().clone()) for p in module.parameters()]
        self.first_grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p, *_ in grads]
        self.handed: tuple = ()  # the hook's arguments as Lightning handed them
        self.clock = ClockReads()  # the clock values the first run read: each run again reads them again
        self.draws = DrawReads()  # and its unseeded draws
        self.arrays = True  # the other arrays of the user's state given other values (not at validation's end)
        self.settings: Optional[_Settings] = None  # between the release and the update: the optimizers' state, …
        self.settled: list[str] = []  # … the entries of it the first run changed, and what it left there
        self.first_settings: Fingerprint = {}
        self.excused: set[str] = set()  # entries another judge runs again (an update's closure: training_step's)

    def every_run(self, hook: Callable[[tuple], Any], variants: list[tuple]) -> bool:
        """Whether the hook, run on each variant of its arguments, reproduces the first run's write exactly. Every rank
        runs as many runs again (the hook's collectives stay paired: no rank stops early)."""
        apart: set[str] = set()
        failed = False
        for variant in variants:
            found = self._once(hook, variant)
            failed = failed or found is None
            apart |= (found or set()) - self.excused
        # A difference a run on the same data shows too (a clock) is excused only for a Python number (a batch timer's
        # duration): never for a tensor, an array, a container, the weights or ĝ (zoo27: randomness the runs do not
        # replay — the loader's own sampler drawn again, an unseeded NumPy generator — passed the data's class means
        # and records kept in a replay buffer as "time stamps")
        control = not failed and bool(apart) and all(_number_entry(self.first.get(n)) for n in apart)
        plain = self._once(hook, self.handed, other_data=False) if self.judge.step.any_rank(control) else None
        if not control:
            return not failed and not apart
        return plain is not None and apart <= plain

    def _once(self, hook: Callable[[tuple], Any], variant: tuple, other_data: bool = True) -> Optional[set[str]]:
        """What one run again wrote otherwise than the first (``None``: it failed). Python numbers keep their values
        (a counter the hook keeps would move with them; so would an EMA's decay or a max-norm bound held as a float:
        judged29)."""
        fingerprint, callbacks = self.judge.fingerprint(), self.judge.step.boundary.callbacks()
        apart: list[set[str]] = []

        def run() -> None:
            with _originals(self.start.moved_lists):
                before = fingerprint.take(callbacks, full=True)
            with self.clock.replayed(), self.draws.replayed():
                hook(variant)
            with _originals(self.start.moved_lists):  # (what the hook appended to a list of time stamps: compared)
                after = fingerprint.take(callbacks, full=True)
            names = {*self.names, *StateFingerprint.changed(before, after)}
            held = self.start._tensors() if self.written else {}
            settled = changed_entries(self.first_settings, self.settings.entries(full=True)) if self.settings else []
            apart.append({n for n in names if after.get(n, _ABSENT) != self.first.get(n, _ABSENT)} | set(settled)
                         | {f"parameter #{i}" for i, (p, value) in enumerate(self.params) if not bit_exact(p, value)}
                         | {f"gradient #{i}" for i, (p, value) in enumerate(self.first_grads)
                            if not bit_exact(p.grad, value)}
                         | {path for path, (_, value) in self.written.items()
                            if path not in held or not bit_exact(held[path], value)})
        ran = self.start.run_again(run, {}, numbers=False, other_data=other_data, arrays=self.arrays) is not None \
            and len(apart) == 1
        return apart[0] if ran else None


class _Settings:
    """What a hook between the release and the update may write in the optimizers and their schedulers (zoo32 j04,
    j05, j11: the training set's mean kept in ``optimizer.state[p]``, in a parameter group or on a scheduler, saved
    in the checkpoint and read by later updates): :func:`~.steered_settings.decisions` — each optimizer's
    hyper-parameters and defaults, every key of its groups, what it keeps under keys that are not parameters, the
    schedulers' states, σ and C, the trainer's length decisions — and each parameter's state entries (``"optimizer 0
    state[0][1].exp_avg"``), a tensor by identity and version counter or, ``full``, by its values: the update has not
    run yet inside the hook, so whatever changed there is the hook's. Taken as a hook starts: :meth:`put_back` sets it
    back (as each run again starts, and when the write is refused)."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self._kept = [settings_kept(o, trainer) for o in getattr(trainer, "optimizers", None) or ()]
        self._attributes = [(s, set(vars(s))) for s in schedulers(trainer)]

    def put_back(self) -> None:
        """The optimizers' groups, defaults and state, the schedulers' states and attributes as taken."""
        for put in self._kept:
            put()
        for scheduler, attributes in self._attributes:
            for key in [k for k in vars(scheduler) if k not in attributes]:  # (set on it: not in the noted state)
                delattr(scheduler, key)

    def entries(self, full: bool) -> Fingerprint:
        """The fingerprint entries as they are now (class docstring)."""
        out = decisions(self.trainer)
        tensors: list[tuple[str, torch.Tensor]] = []
        for i, optimizer in enumerate(getattr(self.trainer, "optimizers", None) or ()):
            state = dict(zip(map(id, optimizer.state), optimizer.state.values()))
            for g, group in enumerate(optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    for key, value in (state.get(id(p)) or {}).items():
                        name = f"optimizer {i} state[{g}][{j}].{key}"
                        if not isinstance(value, torch.Tensor):
                            out[name] = freeze(value)
                        elif full:
                            tensors.append((name, value))
                        else:
                            out[name] = ("tensor", Same(value), value._version, tuple(value.shape))
        sums = content_sums([t for _, t in tensors]) if tensors else []
        out.update((name, ("tensor", tuple(t.shape), str(t.dtype), total)) for (name, t), total in zip(tensors, sums))
        return out


def _chained(*calls: Callable[[], None]) -> Callable[[], None]:
    """One call making ``calls`` in turn (as a run again starts: the optimizers' state put back, then the rest)."""
    def run() -> None:
        for call in calls:
            call()
    return run


def _refusal(boundary: Any, names: list[str], settled: list[str], where: str) -> PrivacyConfigurationError:
    """The refusal of a write between the release and the update: to kept state (``names``: the boundary's), or to
    the optimizers' and schedulers' state (``settled``: :class:`_Settings`)."""
    if not settled:
        return boundary.written_error(names, where)
    shown = ", ".join(repr(n) for n in [*settled, *names][:6])
    return PrivacyConfigurationError(
        f"Optimizer or scheduler state written outside the release: {shown}. Fix: set the optimizer's parameter "
        "groups, state and schedulers from the step count, the released weights and ĝ only (a warm-up of the "
        "learning rate from the step count, a clip of ĝ); keep a statistic of the training data nowhere, or compute "
        f"it from public data.\nState changed {where}: {shown}. The optimizer's and the schedulers' state is saved in "
        "checkpoints and read by later updates without noise; only the noised update may leave a private step.")


@contextmanager
def _originals(lists: list[list]) -> Iterator[None]:
    """Inside, the items of ``lists`` the run again gave other values (:func:`~.held_values.other_values`: each
    marked with its ``original``) read their own values again, the items the hook wrote as it wrote them: what the
    hook did with the list is compared with the first run's, not the other values it was given."""
    saved = [(items, list(items)) for items in lists]
    try:
        for items, now in saved:
            items[:] = [getattr(v, "original", v) for v in now]
        yield
    finally:
        for items, now in saved:
            items[:] = now


def _number_entry(token: Any) -> bool:
    """Whether a fingerprint entry's token is a Python number's (an attribute holding a float or an int)."""
    return isinstance(token, tuple) and len(token) == 2 and token[0] in ("float", "int")


def _variants(owner: Any, name: str, args: tuple, trainer: "pl.Trainer") -> list[tuple]:
    """The hook's arguments in each run again: at a batch's end, the batch exchanged with its outputs moved far, then
    its floating-point values exchanged with its outputs moved near zero; elsewhere as handed."""
    if name != "on_train_batch_end":
        return [args]
    at = 0 if owner is trainer.lightning_module else 2  # a callback's: (trainer, module, outputs, batch, batch_idx)
    outputs, batch = args[at], args[at + 1]
    return [(*args[:at], moved_far(outputs), exchanged_copy(batch), *args[at + 2:]),
            (*args[:at], moved_near(outputs), exchanged_copy(batch, floating_only=True), *args[at + 2:])]


_WHERE = ("in {hook}, outside the step: run again from the state it started from on other data (the training data "
          "exchanged, a batch's values exchanged and its loss moved, the other arrays of your state given other "
          "values, the logged values moved), it did not write the same, so the write depends on the training data "
          "(a write computed from the released weights and ĝ alone is reproduced and accepted)")

_LATE = ("in {hook}, outside the step: this hook wrote nothing at its first call, so its calls are not run again "
         "from where they start, and a write it starts making later cannot be judged (a value set from the data at "
         "step 5, on the second epoch or once the loss is low). Make the hook write from its first call on (an EMA "
         "updated from step 0), so that each of its calls is run again on other data and judged")

