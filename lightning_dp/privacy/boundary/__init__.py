"""The release boundary: nothing derived from the private batch leaves a step except the noised mean.

The guarantee covers what the Gaussian mechanism releases, ĝ_t = (Σ_i clip_C(g_i) + σ C z_t) / B, and the
ledger that counts those releases. Everything else a step computes from the batch must stay inside it. The
rules, each enforced here (:class:`ReleaseBoundary`) and nowhere else; a violation is refused before the
release it would corrupt, naming the fix:

1. **Optimizer ⊆ mechanism** (:mod:`~lightning_dp.validators.optimizer_coverage`): every tensor of every parameter
   group that requires grad is one the release writes, at every release.
2. **No raw gradient observable** (:mod:`.hooks`): no gradient hook on a parameter; the strategies release *inside*
   Lightning's backward, before ``on_after_backward``, so every hook and logger reading ``p.grad`` reads ĝ_t; the
   optimizer steps with ĝ_t as released (:meth:`ReleaseBoundary.check_gradients`); no tensor outside the parameters
   holds a gradient at the release (a temperature with requires_grad, an activation's ``retain_grad()``).
3. **Kept state** (:mod:`~lightning_dp.validators.kept_state`): the module's parameters, buffers and attributes (torch
   layers' configuration too), and the state of every callback not Lightning's or lightning_dp's, are fingerprinted
   after each update (the optimizer applying ĝ_t) and compared before the next release: a change in between — in
   ``training_step``, a batch hook, an epoch hook — is a write from the batch the noise does not cover; an epoch's
   hooks' change that their runs on exchanged training data leave alike is not the data's
   (:mod:`lightning_dp.validators.decisions`). Validation is outside (held-out data): checked at its start, baselined at
   its end. A checkpoint is checked before it is written. ``public_state`` is skipped: the user says it is not derived
   from the training data.
4. **The parameter set** (:func:`parameter_signature`): the trainable parameters and their names are those the
   engine was attached to and the probe verified; a change re-attaches and re-verifies, or is refused.
5. (Examples do not interact: :mod:`lightning_dp.validators`, the probe and the batch check.)
6. **No logged value feeds back** (:mod:`.feedback`, :mod:`lightning_dp.validators.logged_reads`): nothing monitors,
   or reads back inside a step, a value a training hook logged; a reader's later writes are kept state.
What it cannot see: docs/release_boundary.md, the user-facing statement.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp.engine_api import mark_released
from lightning_dp.power_iteration import PowerIterations
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.identity import Same
from lightning_dp.privacy.boundary.feedback import Finding, feedback_error
from lightning_dp.privacy.boundary.hooks import HookKeys, gradient_hooks, hooked_error, user_hooked
from lightning_dp.validators.optimizer_coverage import uncovered_error, uncovered_tensors
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.fingerprints.callback_state import trusted_callback
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, accepted
from lightning_dp.fingerprints.replaced_objects import replaced_entries
from lightning_dp.validators.kept_state import (StateFingerprint, StateWrittenError, attribute_keys, raw_gradient_error,
                                                same_parameters, state_written_error)
from lightning_dp.validators.steered_settings import OptimizerState, hyperparameters, hyperparameters_error

__all__ = ["ReleaseBoundary", "StateSnapshot", "StateWrittenError", "attribute_keys", "gradient_hooks",
           "hyperparameters", "hyperparameters_error", "parameter_signature", "state_written_error",
           "trusted_callback"]

ParameterSignature = tuple[tuple[str, Same], ...]


def parameter_signature(module: nn.Module) -> ParameterSignature:
    """(name, identity) of every trainable parameter, in the module's order (held: a new one never takes its id)."""
    return tuple((name, Same(p)) for name, p in module.named_parameters() if p.requires_grad)


class ReleaseBoundary:
    """The rules of the module docstring for one attached model and optimizer.

    Args:
        public_state: names of state declared public (:func:`~lightning_dp.fingerprints.public_names.is_public`).

    Life cycle (driven by :class:`~lightning_dp.privacy.private_step.PrivateStep` and the Lightning glue):
    :meth:`attach`, :meth:`baseline` when training starts, :meth:`check_release` before every release, the
    optimizer's step post-hook re-baselines (:meth:`updated`), :meth:`pause`/:meth:`baseline` around validation,
    :meth:`check_kept` before a checkpoint is written, :meth:`detach`.
    """

    def __init__(self, public_state: Sequence[str] = ()) -> None:
        if isinstance(public_state, str) or not all(isinstance(n, str) and n for n in public_state):
            raise ValueError(f"public_state must be a list of non-empty names, got {public_state!r}")
        self.public_state = tuple(public_state)
        self.callbacks: Callable[[], Sequence[Any]] = tuple
        """The callbacks whose state is fingerprinted too (set by the Lightning glue: ``trainer.callbacks``)."""
        self.datasets: Callable[[], Sequence[Any]] = tuple
        """The training data whose records must stay as they are (set by the private step's loader)."""
        self.library_objects: Callable[[], Sequence[tuple[str, Any]]] = tuple
        """The loop's own objects whose added attributes are kept state (set by the Lightning glue)."""
        self.global_modules: Callable[[], Sequence[Any]] = tuple
        """The Python modules whose globals are kept state too (set by the Lightning glue: the user's code)."""
        self.fed_back: Callable[[], Sequence[Finding]] = tuple
        """Schedulers and callbacks monitoring a value logged from the training data (rule 6; set by the glue)."""
        self._module: Optional[nn.Module] = None
        self._hyper: Optional[tuple[Any, OptimizerState]] = None  # (the optimizer, its hyper-parameters) at step begin
        self._fingerprint: Optional[StateFingerprint] = None
        self._baseline: Optional[Fingerprint] = None
        self._allowed: HookKeys = {}
        self._signature: list[tuple[str, Tensor]] = []  # trainable() as attached: the parameters held
        self._step_hook: Any = None
        self._pre_hook: Any = None
        self._released: Optional[list[tuple[str, Tensor, Any, int]]] = None  # (name, p, p.grad, its version)
        self._watched: Optional[Optimizer] = None
        self._iterations: Optional[PowerIterations] = None  # spectral norms: advanced after each update only
        self.engine_keys: frozenset[str] = frozenset()
        """Attribute names the engine keeps on the model's modules (never fingerprinted nor restored)."""
        self.parameters: Optional[Callable[[], Any]] = None
        """Where the kept parameters are read (``None``: the module's; FSDP2: the sharded parameters)."""
        self.on_update: Optional[Callable[[], None]] = None
        """Called after each update (:meth:`updated`: the written statistics' watch notes the parameters)."""

    # ------------------------------------------------------------------ life cycle
    def attach(self, module: nn.Module, optimizer: Optional[Optimizer], hooks_before: HookKeys,
               keys_before: set[str], engine_owned: frozenset[str] = frozenset()) -> None:
        """Start guarding ``module``: the gradient hooks and module attributes the engine added since
        ``hooks_before`` and ``keys_before`` (:func:`~lightning_dp.validators.kept_state.attribute_keys`), and
        the attribute names it declares (``engine_owned``), are its own; the optimizer's steps re-baseline the
        state."""
        self.detach()
        params = [p for p in module.parameters() if p.requires_grad]
        after = gradient_hooks(params)
        self._allowed = {k: v - hooks_before.get(k, frozenset()) for k, v in after.items()}
        self.engine_keys = self.engine_keys | engine_owned | (attribute_keys(module) - keys_before)
        if module is not self._module:
            self._baseline = None
        if self._fingerprint is None or self._fingerprint.module is not module \
                or not self.engine_keys <= self._fingerprint.skip_keys:
            self._fingerprint = self.fingerprint(module)
        self._fingerprint.refresh()
        self._module, self._iterations = module, PowerIterations(module)
        self._signature = self.trainable()
        self._watch(optimizer)

    def _watch(self, optimizer: Optional[Optimizer]) -> None:
        """Re-baseline after each step of ``optimizer`` (a callback may swap the optimizer: the one a release is
        for is watched from that release on)."""
        if optimizer is None or optimizer is self._watched:
            return
        if self._step_hook is not None:
            self._step_hook.remove()
            self._pre_hook.remove()
        self._step_hook = optimizer.register_step_post_hook(lambda *_: self.updated())
        self._pre_hook = optimizer.register_step_pre_hook(self._before_step)
        self._watched = optimizer

    def detach(self) -> None:
        """Stop guarding (removes the optimizer hook)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._pre_hook.remove()
            self._step_hook = self._pre_hook = None
        self._watched = None
        if self._iterations is not None:
            self._iterations.release()  # (then empty: advance() does nothing)

    def baseline(self) -> None:
        """The state as it is now is the state a later release is compared with (training starts, validation
        ended, a verified re-attachment)."""
        if self._fingerprint is not None:
            self._baseline, self._held = self._fingerprint.take(self.callbacks()), self._fingerprint.held

    def fingerprint(self, module: nn.Module) -> StateFingerprint:
        """A fingerprint of ``module``'s state as this boundary sees it (public names and the engine's attributes
        skipped, parameters read from :attr:`parameters`)."""
        fingerprint = StateFingerprint(module, self.public_state, self.engine_keys, self.parameters)
        fingerprint.modules = lambda: self.global_modules()
        fingerprint.datasets = lambda: self.datasets()
        fingerprint.library_objects = lambda: self.library_objects()
        fingerprint.every_callback = True  # a callback the step reaches (trainer.callbacks) may hold what it keeps
        return fingerprint

    def accept(self, names: Sequence[str]) -> None:
        """These entries, as they are now, are what the next release compares with (judged not the data's)."""
        if self._fingerprint is not None and self._baseline is not None:
            self._baseline = accepted(self._baseline, self._fingerprint.take(self.callbacks()), names)

    def new_datasets(self) -> None:
        """The loader was built on (other) records: the baseline takes them as they are now."""
        if self._fingerprint is not None and self._baseline is not None:
            self._baseline = self._fingerprint.with_new_datasets(self._baseline, self.callbacks())

    def watch(self, callback: Any) -> None:
        """``callback`` read a value logged from the data: its state is kept state from now on (baseline: as it is)."""
        if self._fingerprint is not None and self._baseline is not None:
            self._baseline = self._fingerprint.watch(callback, self._baseline, self.callbacks())

    def ensure_baseline(self, replaced: bool = False) -> None:
        """Take a baseline if none was taken (a plain loop: after its ``verify()``); ``replaced``: in one taken, the
        entries of the layers and parameters put in place since (new objects: a layer replaced) are taken as now."""
        if self._baseline is None:
            self.baseline()
        elif replaced and self._fingerprint is not None:
            now = self._fingerprint.take(self.callbacks())
            names = replaced_entries(self._held, self._fingerprint.module, [*self._baseline, *now])
            self._baseline = accepted(self._baseline, now, names)

    def untrusted_callbacks(self) -> list[Any]:
        """The callbacks whose state is fingerprinted (not Lightning's or lightning_dp's own)."""
        return [cb for cb in self.callbacks() if not trusted_callback(cb)]

    def updated(self) -> None:
        """The optimizer applied the release: the spectral norms' power iteration runs on the updated weights
        (:mod:`~lightning_dp.power_iteration`), and the state after it is the new baseline."""
        if self._iterations is not None:
            self._iterations.advance()
        self.baseline()
        if self.on_update is not None:
            self.on_update()

    @property
    def watched(self) -> Optional[Optimizer]:
        """The optimizer whose steps re-baseline the state (the last release's)."""
        return self._watched

    def pause(self, where: str) -> None:
        """Validation starts: check what changed since the update, then stop comparing until :meth:`baseline`."""
        self.check_feedback()
        self.check_kept(where)
        self._baseline = None

    # ------------------------------------------------------------------ checks
    def parameters_changed(self) -> bool:
        """Whether the trainable parameters (identities or names) differ from those attached."""
        return self._module is not None and not same_parameters(self.trainable(), self._signature)

    def trainable(self) -> list[tuple[str, Tensor]]:
        """(name, parameter) of the model's trainable parameters now (cheap: no walk of the module tree)."""
        assert self._fingerprint is not None, "attach() first"
        return self._fingerprint.trainable()

    def step_begins(self) -> None:
        """A step's first batch begins: what its release compares the optimizer with (:meth:`check_hyperparameters`)."""
        if self._hyper is None and self._watched is not None:
            self._hyper = (self._watched, OptimizerState(self._watched))

    def check_hyperparameters(self, optimizer: Optional[Optimizer],
                              where: str = "within the step (in training_step, the forward or the backward)") -> None:
        """Rule 3 for the optimizer: nothing changed since :meth:`step_begins` (schedulers step after the update)."""
        taken, self._hyper = self._hyper, None
        if taken is None or optimizer is None or taken[0] is not optimizer:
            return
        changed = taken[1].changed(OptimizerState(optimizer))
        if changed:
            raise hyperparameters_error(changed, where)

    def check_release(self, optimizer: Optional[Optimizer], named: Sequence[tuple[str, Tensor]]) -> None:
        """Before privatising: rules 1–3 (module docstring). Raises :class:`PrivacyConfigurationError`."""
        assert self._module is not None, "attach() first"
        self.check_hyperparameters(optimizer)
        self._watch(optimizer)
        if optimizer is not None:
            missing = uncovered_tensors(optimizer, [p for _, p in named])
            if missing:
                raise uncovered_error(self._module, missing)
        self.check_hooks(named)
        self.check_feedback()
        self.check_kept(contents=True, where="between the last update and this release (in training_step, the "
                        "forward or backward, or "
                        "a hook or callback around them: on_train_batch_start/end, epoch hooks)")

    def released(self, params: Sequence[Tensor], named: Optional[Sequence[tuple[str, Tensor]]] = None) -> None:
        """The release wrote ĝ_t into these ``.grad``: what the optimizer steps with (rule 2; ``named``: trainable)."""
        names = {id(p): name for name, p in (self.trainable() if named is None else named)}
        self._released = [(names.get(id(p), "?"), p, p.grad, mark_released(p.grad)) for p in params]  # ĝ held

    def post_processed(self, apply: Callable[[], Any]) -> Any:
        """``apply()``, torch's clipping of ĝ_t to a public constant in a plain loop between the release and the
        update (:mod:`~lightning_dp.validators.plain_loop`), its result held as released: a function of ĝ_t alone,
        when ĝ_t is still as released (else the change before it stays refused at the update)."""
        held = self._released
        intact = held is not None and not _changed_gradients(held)
        result = apply()
        if intact and held is self._released:
            self.released([p for _, p, _, _ in held], [(name, p) for name, p, _, _ in held])
        return result

    def check_gradients(self) -> None:
        """Rule 2 after the release: the optimizer steps with ĝ_t as released (a hook rewriting ``p.grad`` with data
        it read itself would not); refused before the update unless ``"p.grad"`` is declared public."""
        taken, self._released = self._released, None
        if taken is None or "p.grad" in self.public_state:
            return
        changed = _changed_gradients(taken)
        if changed:
            raise PrivacyConfigurationError(
                f"The released gradient ĝ_t was changed before the optimizer stepped with it: .grad of "
                f"{', '.join(changed[:6])}{' and more' if len(changed) > 6 else ''} (in on_after_backward, "
                "on_before_optimizer_step, configure_gradient_clipping or a callback's; in a loop of your own, "
                "between step.release() and optimizer.step()). A gradient from data the "
                "hook read itself (a batch fetched from the dataset, a backward of its own) is not noised, so the "
                "update would leave the guarantee; the update was not made. Post-process ĝ_t inside the optimizer, "
                "or, if the change is a function of ĝ_t and public values only (clipping ĝ_t to a constant norm), "
                "declare it: DPStrategy(public_state=['p.grad']), or PrivateStep(..., public_state=['p.grad']).")

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The step pre-hook: :meth:`check_gradients` just before the update (after the closure, if given one)."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args: (the optimizer, closure?)
        if closure is None:
            self.check_gradients()
            return None

        def checked() -> Any:
            result = closure()
            self.check_gradients()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return (args[0], checked, *args[2:]), kwargs

    def check_feedback(self) -> None:
        """Rule 6: no scheduler or callback monitors a value logged from the training data."""
        found = self.fed_back()
        if found:
            raise feedback_error(found)

    def check_hooks(self, named: Sequence[tuple[str, Tensor]]) -> None:
        """Rule 2: no gradient hook on a parameter but the engine's (before the probe and every release)."""
        hooked = user_hooked(named, self._allowed)
        if hooked:
            raise hooked_error(hooked)

    def written_error(self, changed: Sequence[str], where: str) -> StateWrittenError:
        """The refusal of a write to kept state (:func:`state_written_error`), for the checks that find one."""
        return state_written_error(changed, where)

    def check_kept(self, where: str, contents: bool = False, skip: tuple[str, ...] = ()) -> None:
        """Refuse if the fingerprinted state differs from the baseline (none taken: nothing to compare). ``contents``:
        also the norms (before a release; elsewhere weight averaging swaps its average in through ``.data``);
        entries starting with one of ``skip`` are not compared (``"parameter "``: weight averaging at train end)."""
        if self._fingerprint is None or self._baseline is None:
            return
        now = self._fingerprint.take(self.callbacks())
        if contents and self._fingerprint.graded:
            raise raw_gradient_error(self._fingerprint.graded)
        changed = [c for c in StateFingerprint.changed(self._baseline, now)
                   if (contents or not c.startswith("contents of ")) and not c.startswith(skip)]
        if changed:
            raise state_written_error(changed, where)


def _changed_gradients(held: Sequence[tuple[str, Tensor, Any, int]]) -> list[str]:
    """The names of the parameters whose ``.grad`` is no longer ĝ_t as released (another tensor, or written)."""
    return [name for name, p, grad, version in held
            if p.grad is not grad or (p.grad is not None and p.grad._version != version)]
