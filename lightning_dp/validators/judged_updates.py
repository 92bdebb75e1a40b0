"""The optimizer's update, judged when it runs code of the user's (docs/release_boundary.md, rules 2 and 3).

The optimizer post-processes the release: what its step computes from ĝ_t, its own state and public
hyper-parameters is covered by the guarantee, and the release boundary takes the state ``optimizer.step`` leaves as
what later releases are compared with. Code of the user's that runs inside the step could read the training data
itself there — a class of the user's overriding ``step`` and handed the dataset (zoo34 L03: the output bias pulled
toward the training set's mean), a step pre- or post-hook registered on the optimizer
(``Optimizer.register_step_post_hook``; zoo34 L48: the mean copied into the first layer's bias after every step) or
globally (``torch.optim.optimizer.register_optimizer_step_post_hook``) — and write it into the weights, ĝ, the
optimizer's state or any kept state. When :func:`users_update_code` finds such code, the update is judged at every
step as the hooks between the release and the update are (:mod:`.judged_writes`, whose judge it shares):

1. as the step starts, the user's state, the weights, ``.grad``, the generators, the optimizers' and schedulers'
   state, the optimizer's own attributes and what the methods of its class of the user's keep (a cache in a closure
   cell) are taken (:meth:`UpdateJudge.closure`); as the closure returns (``training_step``, the backward, the
   release, ``on_before_optimizer_step`` and the gradient clipping ran), ĝ_t, the loss, the generators and the kept
   state the closure itself wrote (judged where it is written, not here) are noted — what the step's code wrote
   before calling its closure (a counter) is accepted for the release, to be judged here;
2. after the step, it runs again from its start (:meth:`UpdateJudge.judge`): on the training data's exchanged copies
   with the other tensors of the user's state given other values, handed the same closure wrapper, which now only
   puts ĝ_t and the generators as the real closure left them and returns its loss (the closure it is handed does
   not tell the two apart, zoo35 R02; code that inspects the call stack or its frames can, zoo36 T52–T54: not
   seen), the library's step post-hooks left out, the user's and the pre-hooks run; the clocks and
   unseeded draws the step's own code read are served again;
3. the update is accepted only when the run again leaves the weights, ĝ, the optimizers' and schedulers' state and
   the kept state bit for bit as the real step left them (a Lion or a sign-SGD of the user's, weight decay by hand, a
   Lookahead's slow weights, counters kept on the optimizer train); otherwise everything is put back as the step
   found it — ĝ_t as released — and the update is refused, before any later release.

Code of the user's is found by :func:`users_update_code`: a ``step`` of the user's, a class of the user's among the
optimizer's bases (an overridden ``_init_group`` torch's step calls: zoo35 R04), step hooks, and objects of the
user's torch's own step calls into — parameter groups or a ``state`` that are no plain dicts, a learning rate of a
float subclass, a parameter class with its own ``__torch_function__`` (zoo35 R05, R06, R29, R30).

A step whose class and hooks are torch's or another library's is not run again: its code is trusted as the
post-processing of ĝ_t (docs/release_boundary.md, "What the boundary cannot see"). Cost: nothing for those; else, at
every step, a copy of the weights and ĝ, four full fingerprints of the kept state and one or two more optimizer steps.
The exchanged copies include those the optimizers, the schedulers, their rate functions and their classes of the
user's hold and the dataset behind a ``DataLoader`` the walk meets
(:func:`~lightning_dp.record_checks.holders.code_holders`); a memo in a ``__slots__`` object or in a function's own
attributes is put back (:mod:`.snapshot`). Not seen: state the step keeps where neither the snapshot nor the
fingerprint reaches (a module of another library, a ctypes buffer, a file), read back on its run again to reproduce
the real write. A statistic (not a copy) of the training data computed before the fit and held by the optimizer is
the data statistics' check's (:mod:`lightning_dp.record_statistics.data_statistics`): refused as the fit starts.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch.optim import optimizer as torch_optimizer

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.fingerprint_entries import changed_entries
from lightning_dp.fingerprints.state_walker import binds, library_callable, library_class, written_name
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.validators import judged_writes
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.replays.starting_state import Generators, StartingState as Saved
from lightning_dp.validators.held_values import user_generators
from lightning_dp.validators.logger_judge import StartingState
from lightning_dp.validators.snapshot import class_state, object_state
from lightning_dp.validators.step_replays import users_objects

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["UpdateJudge", "library_post_hooks_off", "users_update_code"]

_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
"""Where a torch optimizer keeps the hooks its ``step`` calls (``register_step_pre_hook``,
``register_step_post_hook``)."""


def _chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and every optimizer it wraps (Lightning's, lightning_dp's: ``_optimizer``, ``optimizer``), each
    once."""
    out: dict[int, Any] = {}
    while optimizer is not None and id(optimizer) not in out:
        out[id(optimizer)] = optimizer
        optimizer = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
    return list(out.values())


def _users(hook: Any) -> bool:
    """Whether a step hook is the user's code (a library's hook binding arguments holds the user's values too)."""
    return not library_callable(hook) or binds(hook)


def _global_hooks() -> list[dict]:
    return [torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks]


_PLAIN = (bool, int, float, str, bytes, type(None))


def _plain_value(value: Any, depth: int = 0) -> bool:
    """Whether a parameter group's value is a builtin number, string or tensor of torch's (or a tuple or list of
    them): no object of the user's whose methods torch's step would call (zoo35 R06: a float subclass reading the
    labels in ``__neg__``)."""
    if type(value) in _PLAIN:
        return True
    if isinstance(value, torch.Tensor):
        return library_class(type(value)) and not _overrides_torch_function(type(value))
    return type(value) in (tuple, list) and depth < 2 and all(_plain_value(v, depth + 1) for v in value)


def _overrides_torch_function(cls: type) -> bool:
    """Whether a tensor class runs a ``__torch_function__`` of the user's (zoo35 R30: a parameter of such a class
    acting on torch's own ``add_``)."""
    return any(not library_class(c) and "__torch_function__" in vars(c) for c in cls.__mro__)


def _users_objects_in(opt: Any) -> list[str]:
    """What of the user's torch's own step would call into: a class of the user's among the optimizer's bases (an
    overridden ``_init_group``: zoo35 R04), parameter groups that are no plain dicts (R05), a value in them that is
    no builtin (R06), a ``state`` that is no plain dict (R29), a parameter whose class is the user's (R30)."""
    found = [f"{c.__qualname__} (a base class of yours)" for c in type(opt).__mro__[1:] if not library_class(c)][:1]
    if not isinstance(opt, torch.optim.Optimizer):
        return found
    if type(opt.state) not in (dict, defaultdict):
        found.append(f"{type(opt).__qualname__}.state of class {type(opt.state).__qualname__}")
    for i, group in enumerate(opt.param_groups):
        if type(group) is not dict:
            found.append(f"param_groups[{i}] of class {type(group).__qualname__}")
            continue
        for key, value in group.items():
            if key == "params":
                found += [f"param_groups[{i}] holds a parameter of class {type(p).__qualname__}" for p in value
                          if not library_class(type(p)) or _overrides_torch_function(type(p))][:1]
            elif not _plain_value(value):
                found.append(f"param_groups[{i}][{key!r}] of class {type(value).__qualname__}")
    return found


def users_update_code(optimizer: Any) -> list[str]:
    """Where code of the user's runs inside ``optimizer.step`` (module docstring): its class's ``step`` or that of an
    optimizer it wraps, a class of the user's among their bases, a step hook registered on one of them or globally,
    an object of the user's that torch's step calls into (:func:`_users_objects_in`); none: ``[]``."""
    found = []
    for opt in _chain(optimizer):
        step = getattr(type(opt), "step", None)
        if step is not None and not library_callable(step):
            found.append(f"{type(opt).__qualname__}.step")
        elif not library_class(type(opt)):
            found.append(f"{type(opt).__qualname__} (a class of yours)")
        found += _users_objects_in(opt)
        for kind in _STEP_HOOKS:
            found += [f"a step {kind.split('_')[3]}-hook of {type(opt).__qualname__} "
                      f"({written_name(hook)})"
                      for hook in (vars(opt).get(kind) or {}).values() if _users(hook)]
    for table in _global_hooks():
        found += [f"a global optimizer step hook ({written_name(hook)})"
                  for hook in table.values() if _users(hook)]
    return found


@contextmanager
def library_post_hooks_off(optimizer: Any) -> Iterator[None]:
    """Inside, the library's step post-hooks on ``optimizer`` (and on those it wraps) and the global ones do not run
    for a run again of the step (the release boundary's re-baseline, the released-gradient marks, the steps counted
    outside a fit); the user's do, and so do the pre-hooks (the boundary's wraps the closure as in the real step: the
    step is handed the same kind of closure). All put back as they were, in order."""
    tables = [t for opt in _chain(optimizer) if isinstance(t := vars(opt).get(_STEP_HOOKS[1]), dict)] \
        + [torch_optimizer._global_optimizer_post_hooks]
    saved = [(table, dict(table)) for table in tables]
    try:
        for table, items in saved:
            table.clear()
            table.update((k, hook) for k, hook in items.items() if _users(hook))
        yield
    finally:
        for table, items in saved:
            table.clear()
            table.update(items)


def _own_reads() -> Any:
    """Inside, the judge's own reads of the state (its fingerprints, copies and comparisons) see a loss the
    optimizer kept as a plain tensor: the loss the closure handed it is sealed against the user's reads
    (:mod:`.sealed_loss`, which refuses them where they happen), not against the library's."""
    return torch._C.DisableTorchFunctionSubclass()


class _Start:
    """What the judge takes as the step starts and as its closure returns (module docstring, 1.)."""

    def __init__(self, judge: Any, optimizer: Any) -> None:
        trainer = judge.trainer
        self.optimizer, self.judge = optimizer, judge
        judge.mark_released()
        self.state = StartingState(trainer)  # the user's state, the weights, .grad and the generators as it starts
        self.fingerprint = judge.fingerprint()
        self.callbacks = judge.step.boundary.callbacks()
        self.full = self.fingerprint.take(self.callbacks, full=True)
        self.params = list(trainer.lightning_module.named_parameters())
        self.settings = judged_writes._Settings(trainer)
        self.before = self.settings.entries(full=True)
        chain = _chain(optimizer)
        objects = [object_state(opt) for opt in chain]  # its state's tensors' values, its attributes, and what
        objects += class_state([type(opt) for opt in chain])  # the methods of a class of the user's keep
        self.state.restored = judged_writes._chained(self.settings.put_back, *objects, judge.mark_released)
        step = type(optimizer).step
        self.clock = ClockReads(step, optimizer)  # the clocks and unseeded draws the step's own code reads (not
        self.draws = DrawReads(step, optimizer)  # its closure's): served again in the runs again
        self.recording = self._record()
        self.closed = False  # the closure returned: what follows is filled
        self.loss: Any = None
        self.released: list[tuple[Any, Optional[torch.Tensor]]] = []  # (p, ĝ as the closure left it)
        self.generators: Any = None  # the generators as the closure left them
        self.closure_names: set[str] = set()  # the kept state the closure itself wrote (training_step's: judged
        # there, not here)

    def _record(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(self.clock.recording())
        stack.enter_context(self.draws.recording())
        return stack

    def opening(self) -> None:
        """The real closure starts: what the step's code wrote before it is accepted for the release (the runs again
        from the step's start judge it), the closure's own reads of clocks and entropy are not recorded."""
        self.recording.close()
        self.at_call = self.fingerprint.take(self.callbacks, full=True)
        written = StateFingerprint.changed(self.full, self.at_call)
        if written:  # (a step counter kept on the optimizer, `self.n += 1` before the closure)
            self.judge.step.boundary.accept(written)

    def closing(self, loss: Any) -> None:
        """The real closure returned ``loss``: ĝ, the generators and what the closure wrote are noted."""
        after = self.fingerprint.take(self.callbacks, full=True)
        self.closure_names = set(StateFingerprint.changed(self.at_call, after))
        self.released = [(p, None if p.grad is None else p.grad.detach().clone()) for _, p in self.params]
        self.generators = Saved(Generators, lambda: user_generators([self.state.module,
                                                                    *users_objects(self.judge.trainer)]))
        self.loss, self.closed = loss, True
        self.recording = self._record()

    def replayed(self) -> Any:
        """The closure in a run again: ĝ and the generators as the real closure left them, its loss."""
        for p, grad in self.released:
            p.grad = None if grad is None else grad.clone()
        self.generators.put_back()
        return self.loss


class UpdateJudge:
    """The judge of one fit's updates (module docstring): :meth:`closure` takes the step's start and wraps its closure
    when the user's code runs in the step, :meth:`judge` runs after the step."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self._start: Optional[_Start] = None
        self._where: list[str] = []
        self._replaying = False
        self._closure: Optional[Callable[[], Any]] = None

    def closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, wrapped, with the step's starting state taken now, when ``optimizer``'s step runs the user's
        code and the fit's hooks are judged (:func:`~.judged_writes.watch_fit`); else ``closure`` itself. In a run
        again the same wrapper stands in for the closure (:meth:`_Start.replayed`): the closure does not tell the two
        apart (the call stack does: module docstring)."""
        self._start = None
        judge = judged_writes.current()
        self._where = users_update_code(optimizer) if judge is not None else []
        if not self._where:
            return closure
        with _own_reads():
            self._start = _Start(judge, optimizer)

        def taken() -> Any:
            start = self._start
            if start is not None and self._replaying:
                return start.replayed()
            if start is None or start.closed:  # (a step calling its closure again is refused elsewhere)
                return closure()
            with _own_reads():
                start.opening()
            loss = closure()
            with _own_reads():
                start.closing(loss)
            return loss
        self._closure = taken
        return taken

    def judge(self) -> None:
        """After the step: run it again from its start on other data, refuse what it does not reproduce (module
        docstring, 2. and 3.)."""
        start, self._start = self._start, None
        if start is not None:
            start.recording.close()
            if start.closed:
                with _own_reads():
                    self._judge(start)

    def _judge(self, start: _Start) -> None:
        judge, boundary = start.judge, start.judge.step.boundary
        first = start.fingerprint.take(start.callbacks, full=True)
        names = list(dict.fromkeys([*StateFingerprint.changed(start.full, first), *(
            f"parameter {n}" for n, p in start.params if p.requires_grad or not p.is_leaf)]))
        settled = changed_entries(start.before, after := start.settings.entries(full=True))
        grads = [(p, p.grad, -1 if p.grad is None else p.grad._version) for _, p in start.params]
        again = judged_writes._RunAgain(judge, start.state, first, names, grads, start.state.written(library=True))
        again.clock, again.draws, again.excused = start.clock, start.draws, start.closure_names
        again.settings, again.settled, again.first_settings = start.settings, settled, after
        chain = _chain(start.optimizer)
        as_written = judged_writes._chained(judged_writes._Settings(self.trainer).put_back,
                                            *(object_state(opt) for opt in chain),
                                            *class_state([type(opt) for opt in chain]))
        optimizer, closure = start.optimizer, self._closure

        def step_again(_: tuple) -> None:
            self._replaying = True
            try:
                with library_post_hooks_off(optimizer):
                    optimizer.step(closure=closure)
            finally:
                self._replaying = False
        self._start = start  # (the stand-in closure reads it)
        try:
            reproduced = again.every_run(step_again, [()])
        finally:
            self._start = None
        as_written()  # (the last run again's: not kept)
        where = ", ".join(self._where[:3])

        def refuse() -> None:
            if not reproduced:
                start.state.put_back()  # nothing of the refused update stays in memory
                start.settings.put_back()
                raise update_error(where, self.trainer.global_step)
        judge.step.on_every_rank(refuse, "refused an update")
        boundary.baseline()  # the state as the real step left it (the runs again put it back): what the next
        # release compares with


def update_error(where: str, step: int) -> PrivacyConfigurationError:
    """The refusal of an update that code of the user's inside ``optimizer.step`` computed from more than ĝ_t."""
    return PrivacyConfigurationError(
        f"The optimizer's update read the training data beyond the released gradient ĝ_t at step {step}: the user's "
        f"code inside optimizer.step ({where}), run again from the state the step started from with the training "
        "data's values exchanged for others and ĝ_t held as released, left other weights, gradients, optimizer or "
        "kept state. An update may be any function of ĝ_t, the optimizer's own state and public hyper-parameters "
        "(post-processing, which the guarantee covers); a statistic of the training set read there (a dataset handed "
        "to the optimizer, a step hook reading the training loader) is released without noise. The update was not "
        "made. Compute such values from public or held-out data, or from the released model alone.")
