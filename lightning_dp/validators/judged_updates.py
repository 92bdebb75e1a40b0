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

1. as the closure returns (``training_step``, the backward, the release, ``on_before_optimizer_step`` and the
   gradient clipping ran), the user's state, the weights, ĝ_t, the generators, the optimizers' and schedulers' state
   and the kept state's full fingerprint are taken (:meth:`UpdateJudge.closure`);
2. after the step, it runs again from there (:meth:`UpdateJudge.judge`): on the training data's exchanged copies
   with the other tensors of the user's state given other values, ĝ_t as released, the closure standing in with the
   loss it returned, the library's step hooks left out and the user's run; the clocks and unseeded draws the real
   step read are served again;
3. the update is accepted only when the run again leaves the weights, ĝ, the optimizers' and schedulers' state and
   the kept state bit for bit as the real step left them (a Lion or a sign-SGD of the user's, weight decay by hand, a
   Lookahead's slow weights, a step counter kept on the optimizer train); otherwise everything is put back as the
   closure left it and the update is refused, before any later release.

A step whose class and hooks are torch's or another library's is not run again: its code is trusted as the
post-processing of ĝ_t (docs/release_boundary.md, "What the boundary cannot see"). Cost: nothing for those; else, at
every step, a copy of the weights and ĝ, two full fingerprints of the kept state and one or two more optimizer steps.
Not seen: the user's code run before the closure inside the step that leaves the state as it found it (it runs again
too, but from the closure's end).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch.optim import optimizer as torch_optimizer

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.fingerprint_entries import changed_entries
from lightning_dp.fingerprints.state_walker import binds, library_callable
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.validators import judged_writes
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.logger_judge import StartingState
from lightning_dp.validators.snapshot import object_state

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["UpdateJudge", "users_update_code"]

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


def users_update_code(optimizer: Any) -> list[str]:
    """Where code of the user's runs inside ``optimizer.step`` (module docstring): its class's ``step`` or that of an
    optimizer it wraps, a step hook registered on one of them or globally; none: ``[]``."""
    found = []
    for opt in _chain(optimizer):
        step = getattr(type(opt), "step", None)
        if step is not None and not library_callable(step):
            found.append(f"{type(opt).__qualname__}.step")
        for kind in _STEP_HOOKS:
            found += [f"a step {kind.split('_')[3]}-hook of {type(opt).__qualname__} "
                      f"({getattr(hook, '__qualname__', type(hook).__qualname__)})"
                      for hook in (vars(opt).get(kind) or {}).values() if _users(hook)]
    for table in _global_hooks():
        found += [f"a global optimizer step hook ({getattr(hook, '__qualname__', type(hook).__qualname__)})"
                  for hook in table.values() if _users(hook)]
    return found


@contextmanager
def users_hooks_only(optimizer: Any) -> Iterator[None]:
    """Inside, the step hooks of ``optimizer`` (and of those it wraps) and the global ones are the user's alone: the
    library's (the release boundary's re-baseline, the released-gradient marks, the steps counted outside a fit) do
    not run for a run again of the step; all put back as they were, in order."""
    tables = [t for opt in _chain(optimizer) for kind in _STEP_HOOKS
              if isinstance(t := vars(opt).get(kind), dict)] + _global_hooks()
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
    """What the judge takes as the closure returns (module docstring, 1.)."""

    def __init__(self, judge: Any, optimizer: Any, loss: Any) -> None:
        trainer = judge.trainer
        self.optimizer, self.loss = optimizer, loss
        self.judge = judge
        judge.mark_released()
        self.state = StartingState(trainer)
        self.fingerprint = judge.fingerprint()
        self.callbacks = judge.step.boundary.callbacks()
        self.full = self.fingerprint.take(self.callbacks, full=True)
        self.params = list(trainer.lightning_module.named_parameters())
        self.grads = [(p, p.grad, -1 if p.grad is None else p.grad._version) for _, p in self.params]
        self.settings = judged_writes._Settings(trainer)
        self.before = self.settings.entries(full=True)
        objects = [object_state(opt) for opt in _chain(optimizer)]  # its state's tensors' values, its attributes
        self.state.restored = judged_writes._chained(self.settings.put_back, *objects, judge.mark_released)
        step = type(optimizer).step
        self.clock = ClockReads(step, optimizer)  # the clocks and unseeded draws the real step reads: served again
        self.draws = DrawReads(step, optimizer)
        self.recording = ExitStack()
        self.recording.enter_context(self.clock.recording())
        self.recording.enter_context(self.draws.recording())


class UpdateJudge:
    """The judge of one fit's updates (module docstring): :meth:`closure` wraps the step's closure when the user's code
    runs in the step, :meth:`judge` runs after the step."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self._start: Optional[_Start] = None
        self._where: list[str] = []

    def closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, wrapped to take the starting state as it returns when ``optimizer``'s step runs the user's
        code and the fit's hooks are judged (:func:`~.judged_writes.watch_fit`); else ``closure`` itself."""
        self._start = None
        judge = judged_writes.current()
        self._where = users_update_code(optimizer) if judge is not None else []
        if not self._where:
            return closure

        def taken() -> Any:
            loss = closure()
            if self._start is None:  # (the first return: a step calling its closure again is refused elsewhere)
                with _own_reads():
                    self._start = _Start(judge, optimizer, loss)
            return loss
        return taken

    def judge(self) -> None:
        """After the step: run it again from the closure's end on other data, refuse what it does not reproduce
        (module docstring, 2. and 3.)."""
        start, self._start = self._start, None
        if start is not None:
            with _own_reads():
                self._judge(start)

    def _judge(self, start: _Start) -> None:
        start.recording.close()
        judge, boundary = start.judge, start.judge.step.boundary
        first = start.fingerprint.take(start.callbacks, full=True)
        names = list(dict.fromkeys([*StateFingerprint.changed(start.full, first), *(
            f"parameter {n}" for n, p in start.params if p.requires_grad or not p.is_leaf)]))
        settled = changed_entries(start.before, after := start.settings.entries(full=True))
        again = judged_writes._RunAgain(judge, start.state, first, names, start.grads,
                                        start.state.written(library=True))
        again.clock, again.draws = start.clock, start.draws
        again.settings, again.settled, again.first_settings = start.settings, settled, after
        as_written = judged_writes._chained(judged_writes._Settings(self.trainer).put_back,
                                            *(object_state(opt) for opt in _chain(start.optimizer)))
        optimizer, loss = start.optimizer, start.loss

        def step_again(_: tuple) -> None:
            with users_hooks_only(optimizer):
                optimizer.step(closure=lambda: loss)
        reproduced = again.every_run(step_again, [()])
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
