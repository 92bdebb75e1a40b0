"""The user's Lightning hooks run again by the checks: the first step's replays and the checks' passes.

The release boundary judges what the loop's hooks do with the data by running them where the loop would not: the
probe and the batch check run ``on_train_batch_start`` before ``training_step`` (:func:`batch_start`), as the loop
does; the first step replays the hooks around a step (:func:`replay_batch_hooks`) and the epoch hooks
(:func:`replay_epoch_hooks`) on different data, as the module runs now and as it would run at the plan's last step
(:func:`progress_as`), and compares what they keep and decide (docs/release_boundary.md, rule 3). A replay must leave
the run as it found it (:func:`replaying`): nothing logged, no checkpoint written, the schedulers' states put back;
the snapshot (:mod:`.snapshot`) puts the user's state back, :func:`~.steered_settings.replay_records` the
optimizer's and the trainer's decisions.

Only the hooks of the module and of callbacks that are not Lightning's or lightning_dp's are run: the libraries'
callbacks see nothing of the data but what the loop hands them, and their hooks have effects of their own (timers,
progress bars, checkpoints).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.losses import loss_tensor
from lightning_dp.fingerprints.callback_state import trusted_callback
from lightning_dp.fingerprints.fingerprint_entries import moved_by_data
from lightning_dp.replays.runs_again import InterruptedRun, interrupts_failed
from lightning_dp.fingerprints.state_walker import binds, library_callable
from lightning_dp.records.library_objects import library_callback
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.schedule_state import scheduler_state
from lightning_dp.validators.steered_settings import settings
from lightning_dp.validators.probe import frozen_parameters, parameter_entry
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.value_copies import logged_names

if TYPE_CHECKING:
    import pytorch_lightning as pl

FIT_START_HOOKS = ("setup", "configure_model", "on_fit_start")
"""The hooks before training :func:`replay_epoch_hooks` runs first, in the loop's order: ``setup`` (``stage="fit"``)
of the datamodule, the callbacks and the module (a batch size or a sampling setting chosen from the training labels,
a teacher fitted to the training set), the module's ``configure_model`` (a buffer set from the training set's
statistics; not with several processes, where it shards the model) and ``on_fit_start`` (a non-private warm start,
a head fitted to the training set)."""

EPOCH_HOOKS = ("on_train_start", "on_train_epoch_start", "on_train_epoch_end")
"""The hooks :func:`replay_epoch_hooks` runs, in the loop's order: those that see no batch but may read the training
dataset (a teacher fitted to it in ``on_train_start``, a training-set accuracy at epoch end)."""

__all__ = ["EPOCH_HOOKS", "FIT_START_HOOKS", "BatchEndWrites", "batch_start", "checkpoints_saved",
           "configured_settings", "model_kept", "moved_far", "moved_near", "overrides_epoch_hooks",
           "overrides_fit_start", "progress_as", "raised_apart", "raised_error", "replay_batch_hooks",
           "replay_end_hooks", "replay_epoch_hooks", "replaying", "replaying_now", "runs_users_code",
           "silenced_logging", "users_hook", "weights_moved_by_data", "weights_sketch"]


_RAISING_HOOKS = ("on_train_batch_start", "training_step", "on_before_backward", "on_train_batch_end",
                  "on_train_epoch_start", "on_train_epoch_end", "on_validation_epoch_end", "on_validation_end",
                  "on_train_start")


def raised_apart(plain: Optional[BaseException], again: Optional[BaseException],
                 others: Sequence[tuple[Optional[BaseException], bool]]) -> Optional[tuple[BaseException, bool]]:
    """An exception a hook raised on the data and not on other data, or the other way round: a decision made by
    raising (a stop once the training loss is low enough, caught by the user's script: zoo13 exc1). ``plain`` and
    ``again``: what the two runs on the data raised (``None``: they finished); ``others``: each run on other data's,
    with whether one it alone raised is judged (the loss moved far or near zero: values the step can take; not the
    batch's values exchanged, which a hook may rightly reject). Returns (the exception, whether the runs on the data
    raised it), or ``None`` when every run ended alike (a hook that raises on every run keeps raising)."""
    if plain is not None and again is not None:
        return (plain, True) if any(other is None for other, _ in others) else None
    if plain is None and again is None:
        alone = [other for other, judged in others if other is not None and judged]
        return (alone[0], False) if alone else None
    return None  # the two runs on the data already end apart (a clock): not the data's


def _raising_hook(err: BaseException) -> str:
    """``Class.hook`` of the deepest frame of a Lightning hook the exception came through ("a hook" when none)."""
    found, tb = "a hook", err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in _RAISING_HOOKS and "self" in tb.tb_frame.f_locals:
            found = f"{type(tb.tb_frame.f_locals['self']).__name__}.{code.co_name}"
        tb = tb.tb_next
    return found


def raised_error(err: BaseException, on_data: bool, where: str) -> PrivacyConfigurationError:
    """The refusal of a decision made by raising (:func:`raised_apart`), naming the hook and the exception."""
    if isinstance(err, InterruptedRun) and err.__cause__ is not None:  # (a KeyboardInterrupt of the hook's)
        err = err.__cause__
    how = ("raised it on the data, and not when run again on other data" if on_data else
           "did not raise it on the data, and raised it when run again on other data")
    return PrivacyConfigurationError(
        f"{_raising_hook(err)} raised {type(err).__name__} {where} (its message is not quoted: it may hold the "
        f"data's values): the hooks {how}. An exception is a "
        "decision: a stop (or any exception your script catches) decided from the training loss or the training "
        "batch is a release no noise covers — the number of releases, and the model kept, then depend on one "
        "record. Stop from a held-out value (EarlyStopping on a validation metric), or decide from the released "
        "model (evaluated on public data after the fit), not from the training loss.")


@contextmanager
def progress_as(trainer: "pl.Trainer", step: int, epoch: int) -> Iterator[None]:
    """Inside, ``trainer.global_step``/``module.global_step`` read ``step`` and ``current_epoch`` reads ``epoch`` (the
    fit loop's two counters, restored on exit): the first step's checks run the user's code as it would run later."""
    optimizer_steps = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    epochs = trainer.fit_loop.epoch_progress.current
    saved = optimizer_steps.completed, epochs.completed
    optimizer_steps.completed, epochs.completed = step, epoch
    try:
        yield
    finally:
        optimizer_steps.completed, epochs.completed = saved


def overrides_epoch_hooks(module: "pl.LightningModule") -> bool:
    """Whether the module, a callback that is not Lightning's or lightning_dp's or the datamodule has a hook of its own
    among those :func:`replay_epoch_hooks` runs (one defined outside the libraries: Lightning's base classes define
    them all, empty)."""
    return any(users_hook(getattr(type(owner), name, None)) for name in (*FIT_START_HOOKS, *EPOCH_HOOKS)
               for owner in _hook_owners(module, name))


def _hook_owners(module: "pl.LightningModule", name: str) -> list[Any]:
    """Whose ``name`` hook :func:`replay_epoch_hooks` runs, in the loop's order: the callbacks that are not Lightning's
    or lightning_dp's, then the module; for ``setup`` the datamodule first (when its ``setup`` is the user's: it builds
    the datasets); ``configure_model`` the module's alone, in one process and on a model FSDP2 has not sharded (its
    ``fully_shard`` calls are not run again)."""
    trainer = module.trainer
    if name == "configure_model":
        sharded = any(base.__name__ == "FSDPModule" for m in module.modules() for base in type(m).__mro__)
        return [module] if getattr(trainer, "world_size", 1) == 1 and not sharded else []
    callbacks = [cb for cb in trainer.callbacks if not library_callback(cb)]
    datamodule = getattr(trainer, "datamodule", None) if name == "setup" else None
    first = [datamodule] if datamodule is not None and users_hook(getattr(type(datamodule), "setup", None)) else []
    return [*first, *callbacks, module]


def runs_users_code(module: "pl.LightningModule", hooks: Sequence[str]) -> bool:
    """Whether one of ``hooks`` may run the user's code: the module's own, or that of a callback that is not
    Lightning's or lightning_dp's and is not ``Callback``'s empty one (a subclass of a library's callback runs the
    user's methods from its hooks: ``BaseFinetuning.finetune_function``)."""
    import pytorch_lightning as pl  # here: Lightning imports lightning_dp's strategy, which imports this module

    callbacks = [cb for cb in module.trainer.callbacks if not library_callback(cb)]
    return any(users_hook(getattr(type(module), name, None)) for name in hooks) or any(
        getattr(type(cb), name, None) is not getattr(pl.Callback, name, None) for cb in callbacks for name in hooks)


def moved_far(value: Any) -> Any:
    """``value`` with every floating-point tensor and number in it moved far (1000·(value + 1); dicts, lists and
    tuples walked): a decision taken from the loss past a threshold differs from one taken on the value itself."""
    if isinstance(value, torch.Tensor):
        return (value.detach() + 1) * 1000 if value.is_floating_point() else value
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        return (value + 1) * 1000
    if isinstance(value, dict):
        return {k: moved_far(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(moved_far(v) for v in value)
    return value


def moved_near(value: Any) -> Any:
    """``value`` with every floating-point tensor and number in it moved near zero (a thousandth of it; dicts, lists
    and tuples walked): a decision taken once the loss is *above* a threshold (``if loss > 0.7: stop``) differs from
    one taken on the value itself, as :func:`moved_far` tells one taken below it."""
    if isinstance(value, torch.Tensor):
        return value.detach() * 1e-3 if value.is_floating_point() else value
    if isinstance(value, float):
        return value * 1e-3
    if isinstance(value, dict):
        return {k: moved_near(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(moved_near(v) for v in value)
    return value


def users_hook(hook: Any) -> bool:
    """Whether ``hook`` (a class's function) is the user's: defined outside Lightning and lightning_dp."""
    module = getattr(hook, "__module__", None) or ""
    return bool(hook) and not (module.startswith(("pytorch_lightning.", "lightning.", "lightning_dp."))
                               and library_callable(hook))  # (a user's hook claiming Lightning's module: the user's)


def replay_epoch_hooks(module: "pl.LightningModule", writers: Optional[dict[str, set[str]]] = None,
                       set_up: Optional[Callable[[], None]] = None) -> None:
    """The :data:`FIT_START_HOOKS` and :data:`EPOCH_HOOKS` (``setup``, ``configure_model``, ``on_fit_start``,
    ``on_train_start``, ``on_train_epoch_start``, ``on_train_epoch_end``) of every callback that is not Lightning's or
    lightning_dp's, of the module and (``setup``) of the datamodule, logging silenced, with gradients enabled as the
    loop runs them (a warm start's backward in ``on_train_start`` runs: the caller puts the engine aside, so its
    steps move the weights as they do for real); a hook that needs more of the loop than a replay gives (it raises)
    ends the replay (every replay alike). ``writers``: filled with the hooks that wrote the model's parameters
    (``"WarmStart.setup"`` → their names), for the refusal to name them. ``set_up``: called once the datamodule's
    ``setup`` ran (the caller notes what it set, then puts the datamodule back as the real one left it: datasets it
    builds anew from files or copies hold no exchanged values, and the hooks after it read the training data)."""
    trainer = module.trainer
    with replaying(module, rates=False, schedules=False), torch.enable_grad():  # (the schedulers: compared by the
        try:                                                                     # caller, then put back)
            for name in (*FIT_START_HOOKS, *EPOCH_HOOKS):
                stage = ("fit",) if name == "setup" else ()
                for owner in _hook_owners(module, name):
                    if name == "configure_model" and not users_hook(getattr(type(owner), name, None)):
                        continue
                    before = _parameter_versions(module) if writers is not None else {}
                    hook = getattr(owner, name)
                    hook(*stage) if owner is module or owner is trainer.datamodule else \
                        hook(trainer, module, *stage)
                    if owner is trainer.datamodule and set_up is not None:
                        set_up()
                    if writers is not None:
                        wrote = {n for n, v in _parameter_versions(module).items() if before.get(n) != v}
                        if wrote:
                            writers.setdefault(f"{type(owner).__name__}.{name}", set()).update(wrote)
        except Exception:  # noqa: BLE001  (checked as it runs: the boundary compares what it keeps)
            pass


def _parameter_versions(module: "pl.LightningModule") -> dict[str, tuple[int, int]]:
    """Each parameter's version counter and storage address (an in-place step, a ``.data`` assignment moves one)."""
    return {name: (p._version, p.data_ptr()) for name, p in module.named_parameters()}


def configured_settings(module: "pl.LightningModule") -> dict[str, Any]:
    """The hyper-parameters (:func:`~.steered_settings.settings`) of the optimizers the module's
    ``configure_optimizers`` builds now, and its schedulers' states (``"configured optimizer 0 param_groups[0].lr"``):
    run in the replays of the hooks that see no batch, a learning rate from the training data (``1 / L`` from its
    spectral norm) differs on its exchanged copy. The optimizers built are dropped; a module without one, or one that
    fails, gives nothing."""
    from pytorch_lightning.core.optimizer import _configure_optimizers

    try:
        optimizers, schedulers, _ = _configure_optimizers(module.configure_optimizers())
    except Exception:  # noqa: BLE001  (what configure_optimizers needs of the loop is not there: nothing compared)
        return {}
    out: dict[str, Any] = {}
    for i, optimizer in enumerate(optimizers):
        out.update({f"configured optimizer {i} {k.partition(' ')[2]}": v for k, v in settings(optimizer).items()})
    for i, config in enumerate(schedulers):  # (as configure_optimizers returned it: a scheduler, or a dict of one)
        scheduler = config.get("scheduler") if isinstance(config, dict) else getattr(config, "scheduler", config)
        try:
            state = scheduler_state(scheduler)
        except Exception:  # noqa: BLE001  (not a scheduler torch's way: nothing compared)
            continue
        out.update({f"configured scheduler {i} {k}": repr(v) for k, v in state.items()})
    return out


def model_kept(module: "pl.LightningModule", weights: bool = False) -> Callable[[], list[str]]:
    """A function that puts the model's structure (each module's class, its modules in their order, parameters and
    buffers, slot by slot; the user's module hooks: :func:`users_hooks_kept`) and, when a
    ``setup`` or ``on_fit_start`` of the user's may change them (or ``weights``), its parameters' values back as
    they are now: a
    ``setup`` that builds layers or warms the weights up runs again in a replay without changing the model trained
    (the replays compare the weights before this puts them back: a warm start on the training data differs on its
    exchanged copy). Values go back through ``.data`` (into the storage it had: a replay's ``p.data = renorm(p.data)``
    rebinds it), only where changed; the function returns the names of the parameters a replay wrote in place (their
    version counters moved: the release boundary takes them as they are)."""
    slots = [(m, type(m), dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    values = [(name, p, p.detach().clone(), p._version, p.data) for name, p in module.named_parameters()] \
        if weights or overrides_fit_start(module) else []
    hooks = users_hooks_kept(module)

    def restore() -> list[str]:
        hooks()
        for m, cls, modules, params, buffers in slots:
            if type(m) is not cls:  # (``layer.__class__ = nn.Sigmoid``)
                m.__class__ = cls
            for table, kept in ((m._modules, modules), (m._parameters, params), (m._buffers, buffers)):
                if table != kept or list(table) != list(kept):  # (the same items in another order: a forward's)
                    table.clear()
                    table.update(kept)
        for _, p, value, _, data in values:
            if p.data_ptr() != data.data_ptr() or p.shape != data.shape:  # rebound (``p.data = renorm(p.data)``)
                p.data = data  # its own storage back (the version counter stays)
            if not torch.equal(p.data, value):
                p.data.copy_(value)
        return [name for name, p, _, version, _ in values if p._version != version]
    return restore


def users_hooks_kept(module: "pl.LightningModule") -> Callable[[], None]:
    """A function that puts the user's module hooks (forward, forward-pre and backward hooks of every submodule, and
    torch's flags beside them) back as they are now: a hook registered or removed by a run again of a hook
    (``register_forward_pre_hook`` at a batch's end, chosen by the batch's labels) goes, so that every run starts from
    the same hooks and is compared by what it registers (``kept_state``: by place and code, not the handle's
    number). An engine's or another library's hooks (:func:`~.state_walker.library_callable`) are left as they are
    now: an engine attached again in between keeps its own."""
    tables = [(table, dict(table)) for m in module.modules() for kind in _HOOK_DICTS
              for table in [m.__dict__.get(kind)] if isinstance(table, dict)]
    flags = [(table, dict(table)) for m in module.modules() for kind in _HOOK_FLAGS
             for table in [m.__dict__.get(kind)] if isinstance(table, dict)]

    def users(table: dict) -> list[tuple[Any, Any]]:
        return [(k, fn) for k, fn in table.items() if _users_hook(fn)]

    def restore() -> None:
        changed: set[Any] = set()
        for table, kept in tables:
            now, before = users(table), users(kept)
            if len(now) == len(before) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(now, before)):
                continue
            changed.update(k for k, _ in now)
            changed.update(k for k, _ in before)
            mine = dict(before)
            theirs = {k: fn for k, fn in table.items() if not _users_hook(fn)}
            order = [k for k in kept if k in mine or k in theirs] + [k for k in theirs if k not in kept]
            table.clear()
            table.update((k, mine[k] if k in mine else theirs[k]) for k in order)
        for table, kept in flags if changed else ():
            for k in changed:
                if k in kept:
                    table[k] = kept[k]
                else:
                    table.pop(k, None)
    return restore


def _users_hook(fn: Any) -> bool:
    return not library_callable(fn) or binds(fn)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_FLAGS = ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


SKETCH_POSITIONS = 4096
"""How many evenly spread values of each parameter :func:`weights_sketch` keeps."""


def weights_sketch(module: "pl.LightningModule") -> dict[str, torch.Tensor]:
    """Each parameter's values at up to :data:`SKETCH_POSITIONS` evenly spread positions (copies where the parameter
    is, in float32 or wider; a sharded parameter's local shard): how far a replay of the hooks that see no batch moved
    the weights, for :func:`weights_moved_by_data`."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this rank's shard
        flat = t.reshape(-1)
        every = max(1, flat.numel() // SKETCH_POSITIONS)
        wide = torch.promote_types(flat.dtype, torch.float32) if flat.is_floating_point() else torch.float32
        out[name] = flat[::every][:SKETCH_POSITIONS].to(dtype=wide, copy=True)
    return out


ROUNDING_ULPS = 64
"""How far (in float32 units in the last place of a parameter's largest value) a replay may move the weights from
another and be taken for rounding (a solve that is not bit for bit repeatable), not for the data."""


def weights_moved_by_data(plain: dict[str, Any], again: dict[str, Any], other: dict[str, Any],
                          sketches: Sequence[dict[str, torch.Tensor]], ratio: float = 1000.0) -> list[str]:
    """Of the model's parameters (``"parameter head.weight"``), those the replay on other data moved from the first
    replay on the data; ``plain``, ``other`` and ``again`` are the replays' fingerprints, in that order, and
    ``sketches`` their :func:`weights_sketch`. Exactly as :func:`~.fingerprint_entries.moved_by_data` (which takes an
    entry the two replays on the same data set apart for a time stamp), except where the arithmetic of a fit is not bit
    for bit repeatable (a least-squares solve on several threads, a GPU's atomic sums): weights the plain replays
    leave apart are the data's when the other data moved them more than ``ratio`` times as far; and a move the
    sketches see and find within :data:`ROUNDING_ULPS` of the values' scale is rounding (the two plain replays
    happened to round alike), not the data. A warm start or a closed-form head fitted to the training set moves
    the weights on its exchanged copy by orders of magnitude more; a time stamp or an unseeded draw written into
    the weights moves both alike and is not returned."""
    noisy = set(StateFingerprint.changed(plain, again))
    first, apart, second = sketches
    out = []
    for key in StateFingerprint.changed(plain, other):
        if not key.startswith("parameter "):
            continue
        name = key.removeprefix("parameter ")
        moved, scale = _apart(first.get(name), apart.get(name))
        if moved is None:  # not comparable (no sketch, a parameter of another shape): as the fingerprint says
            if key not in noisy:
                out.append(key)
            continue
        rounding = moved <= ROUNDING_ULPS * torch.finfo(torch.float32).eps * scale
        if key not in noisy:
            if moved == 0 or not rounding:  # a move between the sampled positions, or beyond rounding
                out.append(key)
            continue
        noise, _ = _apart(first.get(name), second.get(name))
        if noise is not None and moved > ratio * noise and not rounding:
            out.append(key)
    return out


def _apart(values: Optional[torch.Tensor], other: Optional[torch.Tensor]) -> tuple[Optional[float], float]:
    """The largest difference between two sketches of a parameter, and the first's largest magnitude (``None``
    and 0 when they cannot be compared)."""
    if values is None or other is None or other.shape != values.shape or not values.numel():
        return None, 0.0
    return float((other - values).abs().max()), float(values.abs().max())


def overrides_fit_start(module: "pl.LightningModule") -> bool:
    """Whether the module or a user callback has a ``setup`` or ``on_fit_start`` of its own."""
    owners = [module, *(cb for cb in module.trainer.callbacks if not library_callback(cb))]
    return any(users_hook(getattr(type(owner), name, None)) for owner in owners for name in FIT_START_HOOKS)


def batch_start(module: "pl.LightningModule", batch: Any, batch_idx: int, raising: bool = False) -> None:
    """``on_train_batch_start`` of every callback that is not Lightning's or lightning_dp's, then of the module, on
    ``batch`` as the loop runs them before ``training_step``: the checks' passes see what they do to the batch (centre
    it on the data's mean, relabel it from neighbours). A hook that needs more of the loop than a check gives (it
    raises) is left out of that pass (``raising``: its exception raised, for a run again that fails)."""
    trainer = module.trainer
    try:
        for cb in trainer.callbacks:
            if not trusted_callback(cb):
                cb.on_train_batch_start(trainer, module, batch, batch_idx)
        module.on_train_batch_start(batch, batch_idx)
    except Exception:  # noqa: BLE001  (checked as it runs: the release boundary compares what it keeps)
        if raising:
            raise


def replay_batch_hooks(module: "pl.LightningModule", precision: Any, batch: Any, batch_idx: int,
                        moved: Union[bool, Callable[[Any], Any]] = False, before_end: Callable[[], None] = lambda: None,
                        end: bool = True, names: Optional[list[frozenset]] = None, hooks: bool = True) -> bool:
    """The hooks Lightning's loop runs around a training step that are handed the batch, its loss or its outputs
    (``on_train_batch_start``, ``on_before_backward``, ``on_train_batch_end``), of the module and of every callback
    that overrides one, run on ``batch`` with the outputs of the module's ``training_step`` (not differentiated);
    logging silenced. The release boundary compares the state before and after (:meth:`PrivateStep.verify_on`);
    ``before_end`` is called just before the batch-end hooks.
    ``moved``: the hooks are handed the loss moved far (1000·(loss + 1)), so a value set from it past a threshold
    (``if loss < 100: lr *= 0.5``) differs from the replay that was not; or moved by ``moved`` itself
    (:func:`moved_near`: a value set once the loss is above a threshold). ``end=False``: the hooks before the release
    only (the batch-end hooks not run). ``names``: given the (hook, name) pairs the hooks logged
    (:mod:`~lightning_dp.value_copies.logged_names`; also when a hook raised). ``hooks=False``: the module hooks the
    hooks register are left for the caller to compare and put back (:func:`users_hooks_kept`)."""
    trainer = module.trainer
    callbacks = [cb for cb in trainer.callbacks if not trusted_callback(cb)]
    with replaying(module, rates=False, schedules=False, hooks=hooks), logged_names.recording() as logged:
        try:
            return _batch_hooks(module, callbacks, precision, batch, batch_idx, moved, before_end, end)
        finally:
            if names is not None:
                names.append(frozenset(logged))


def _batch_hooks(module: "pl.LightningModule", callbacks: list[Any], precision: Any, batch: Any, batch_idx: int,
                 moved: Union[bool, Callable[[Any], Any]], before_end: Callable[[], None], end: bool) -> bool:
    """The body of :func:`replay_batch_hooks` (inside its :func:`replaying`), each hook's logging told apart."""
    trainer = module.trainer

    def by(owner: Any, name: str) -> Any:
        return logged_names.hook(name if owner is module else f"{type(owner).__name__}.{name}")

    for cb in callbacks:
        with by(cb, "on_train_batch_start"):
            cb.on_train_batch_start(trainer, module, batch, batch_idx)
    with by(module, "on_train_batch_start"):
        ended = module.on_train_batch_start(batch, batch_idx) == -1
    with precision.train_step_context(), by(module, "training_step"):
        outputs = module.training_step(batch, batch_idx)
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:  # a sampled batch skipped: refused by its cause, as the loop would (before the names it logs)
        loss_tensor(outputs, 1)
    if moved and isinstance(loss, torch.Tensor):
        loss = moved(loss) if callable(moved) else moved_far(loss)
        outputs = {**outputs, "loss": loss} if isinstance(outputs, dict) else loss
    if isinstance(loss, torch.Tensor):
        for cb in callbacks:
            with by(cb, "on_before_backward"):
                cb.on_before_backward(trainer, module, loss)
        with by(module, "on_before_backward"):
            module.on_before_backward(loss)
    if isinstance(loss, torch.Tensor) and not isinstance(outputs, dict):
        outputs = {"loss": loss.detach()}
    before_end()  # what the batch-end hooks alone write (after the release, in the loop) is told apart
    for cb in callbacks if end else ():
        with by(cb, "on_train_batch_end"):
            cb.on_train_batch_end(trainer, module, outputs, batch, batch_idx)
    if end:
        with by(module, "on_train_batch_end"):
            module.on_train_batch_end(outputs, batch, batch_idx)
    return ended


@contextmanager
def replaying(module: "pl.LightningModule", rates: bool = True, schedules: bool = True,
              hooks: bool = True) -> Iterator[None]:
    """What a replay of the user's hooks, or a check's pass through them, must not do to the run: log (``self.log``,
    a logger's ``log_metrics``), write a checkpoint (``trainer.save_checkpoint`` in an epoch hook), leave a module
    hook registered (``on_train_start`` registering a forward hook: the replays' go again), or advance a
    learning-rate scheduler stepped by hand (its state and the optimizers' hyper-parameters are put back: a schedule
    from ``last_epoch`` would otherwise run ahead). ``rates=False``: the hyper-parameters are left as the hooks set
    them (the replays compare them, then put them back: :func:`~.steered_settings.replay_records`); ``schedules=False``:
    so are the schedulers' states (a scheduler told the batch's loss by ``on_train_batch_start``: compared among the
    loop's controls, :mod:`.schedule_state`); ``hooks=False``: so are the module hooks (the caller compares them)."""
    trainer = module.trainer
    schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or ()] \
        if schedules else []
    states = [scheduler_state(scheduler) for scheduler in schedulers]
    groups = [(group, {k: v for k, v in group.items() if k != "params"})
              for optimizer in getattr(trainer, "optimizers", None) or () for group in optimizer.param_groups] \
        if rates else []
    loggers = getattr(trainer, "_loggers", None)
    listed = list(loggers) if isinstance(loggers, list) else None
    unique = list({id(logger): logger for logger in trainer.loggers}.values())  # a logger listed twice: muted once
    muted = [(trainer, "save_checkpoint"), *((logger, name) for logger in unique
                                              for name in ("log_metrics", "log_hyperparams"))]
    tables = [(table, dict(table)) for m in module.modules() for kind in _HOOK_TABLES
              for table in [getattr(m, kind, None)] if isinstance(table, dict)] if hooks else []
    saved = [vars(obj).get(name, _ABSENT) for obj, name in muted]
    _REPLAYS.append(module)
    with silenced_logging(module):
        for obj, name in muted:
            setattr(obj, name, _counted if name == "save_checkpoint" else lambda *args, **kwargs: None)
        try:
            with interrupts_failed():  # a KeyboardInterrupt of the user's hook: a failed run, not the user's interrupt
                yield
        finally:
            _REPLAYS.remove(module)
            if listed is not None:  # a replayed on_train_start adding a logger (``trainer.loggers += [lg]``) adds none
                loggers[:] = listed
                trainer._loggers = loggers
            for (obj, name), value in zip(muted, saved):
                if value is _ABSENT:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)
            for table, entries in tables:  # a hook registered by a replayed on_train_start goes again
                if len(table) != len(entries) or any(k not in entries for k in table):
                    table.clear()
                    table.update(entries)
            for scheduler, state in zip(schedulers, states):
                scheduler.load_state_dict(state)
            for group, values in groups:  # the rates a scheduler stepped by hand set
                params = group["params"]
                group.clear()
                group.update(values, params=params)


_ABSENT = object()
_REPLAYS: list[Any] = []  # the modules whose hooks a replay runs now


def replaying_now() -> bool:
    """Whether a replay (:func:`replaying`) runs the user's hooks now: a logger's media calls write nothing."""
    return bool(_REPLAYS)


_SAVED: list[str] = []  # the paths of the checkpoints the replays' hooks saved (``trainer.save_checkpoint``, muted)


def _counted(*args: Any, **kwargs: Any) -> None:
    _SAVED.append(str(kwargs.get("filepath", args[0] if args else "")))


def checkpoints_saved() -> tuple[str, ...]:
    """The paths of the checkpoints the replays' hooks saved so far (none written): whether a run saves, and under
    which name (``f"loss={trainer.callback_metrics['train_loss']:.4f}.ckpt"`` carries the value), is a decision."""
    return tuple(_SAVED)


_HOOK_TABLES = (*_HOOK_DICTS, *_HOOK_FLAGS)
"""The dicts in which a module keeps its hooks (and their flags)."""


@contextmanager
def silenced_logging(module: "pl.LightningModule") -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing while the probe runs the user's step (its values are not a step's);
    the names they are given are noted (:func:`~lightning_dp.value_copies.logged_names.recording`)."""
    module.log = lambda *a, **k: logged_names.logged(a, k)  # type: ignore[method-assign]
    module.log_dict = lambda *a, **k: logged_names.logged(a, k, many=True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


class BatchEndWrites:
    """What the first step's replays of the batch hooks write (``step_replays.StepReplays._replay_now_and_later``),
    when the module or a callback of the user's has such hooks, or the probe found ``training_step`` writing (``users``:
    those callbacks and the datamodule). Every run starts from the state as it was (the snapshot, the weights put
    back); of each group of three (the batch twice, then other data) the first is watched before and after the
    batch-end hooks, every run's state after them is compared, and — when the first wrote before them — every run's
    state before them too (:meth:`judged`)."""

    def __init__(self, boundary: Any, module: "pl.LightningModule", users: list[Any]) -> None:
        self.boundary = boundary
        self.users = users
        self.fingerprint = boundary.fingerprint(module)
        self.snapshot = StateSnapshot(module, self.users, boundary.engine_keys, boundary.global_modules(),
                                      settings=False)  # the library settings: compared and put back by replay_records
        self.model_back = model_kept(module, weights=True)
        self.base = self.fingerprint.take(self.users, full=True)
        self.runs: list[dict[str, Any]] = []  # each run's state after its hooks (contents)
        self.marks: dict[str, Any] = {}  # the first run's: contents and writes before the batch-end hooks, writes after
        self.rewritten: set[str] = set()  # parameters a run wrote and put_back() put back (their versions moved)
        self.early: list[Any] = []  # each run's state before the batch-end hooks, when the first wrote before them
        self.before_release: set[str] = set()  # what the hooks before the release write alike on every data
        self.frozen = frozen_parameters(module)  # no gradient (a momentum copy): judged as a buffer
        self.module = module
        self.versions = _parameter_versions(module)  # a frozen copy written to the values it had (the first step's
        # EMA of weights it equals) moves its version counter only, which the release compares

    def before_end(self) -> None:
        if self.runs:  # a later run of the group: its state before the batch-end hooks, when the first's wrote
            if self.early:
                self.early.append(self.fingerprint.take(self.users, full=True))
            return
        contents = self.fingerprint.take(self.users, full=True)
        frozen = [f"parameter {name}" for name, v in _parameter_versions(self.module).items()
                  if name in self.frozen and self.versions.get(name) != v]
        self.marks = {"contents": contents, "writes": self.fingerprint.take(self.users), "frozen": frozen}
        self.early = [contents] if StateFingerprint.changed(self.base, contents) or frozen else []

    def ran(self, first: bool) -> None:
        if first:
            self.marks["writes after"] = self.fingerprint.take(self.users)
        self.runs.append(self.fingerprint.take(self.users, full=True))

    def put_back(self) -> None:
        self.snapshot.restore()
        self.rewritten.update(self.model_back())

    def judged(self) -> set[str]:
        """What the batch-end hooks may keep writing. What the hooks before them write (``on_train_batch_start``,
        ``training_step``, ``on_before_backward``: before the release) is refused when the other data set it apart
        (a running mean of the batch, a count of its positives) or when it is a parameter; what every run writes alike
        (a counter, a frozen momentum copy updated from the weights: :func:`~.probe.frozen_parameters`) or what the
        two runs on the batch already set apart (a time stamp) is added to
        :attr:`before_release` (accepted at every release, judged again at the batch check's steps). What the
        batch-end hooks write (after the release, in the loop) is refused when the other data set it apart, and
        otherwise — an EMA of the weights, a counter — is returned (accepted when a batch's window closes, judged
        again at the sampled checks' steps: :mod:`~lightning_dp.validators.decisions`)."""
        if len(self.runs) != 3 or "writes after" not in self.marks:
            return set()
        early = list(dict.fromkeys([*StateFingerprint.changed(self.base, self.marks["contents"]),
                                    *self.marks.get("frozen", ())]))
        refused = [name for name in early if parameter_entry(name, self.frozen)] + \
            (moved_by_data(*self.early) if len(self.early) == 3 else early)
        if refused:
            raise self.boundary.written_error(list(dict.fromkeys(refused)), (
                "in the hooks the loop runs around a step before its release (on_train_batch_start, training_step, "
                "on_before_backward), from the batch, its loss or the training set: replayed on the first step's "
                "examples, moved far and exchanged (the training set's copies with them), before any release, the "
                "hooks set it apart or wrote a trainable parameter outside "
                "the gradient. A parameter written there (a momentum copy of the weights) is accepted when it is "
                "frozen (requires_grad=False) and set from the parameters only; else update it at "
                "the batch's end (on_train_batch_end) from the parameters only"))
        self.before_release.update(early)
        moved = moved_by_data(*self.runs)
        if moved:
            raise self.boundary.written_error(moved, "at a batch's end (on_train_batch_end), from the batch or its "
                                              "loss: replayed on the first step's examples, moved far and "
                                              "exchanged, the hooks set it apart")
        return set(StateFingerprint.changed(self.marks["writes"], self.marks["writes after"]))


def replay_end_hooks(module: "pl.LightningModule", hooks: Sequence[str]) -> None:
    """The hooks that end a fit (``on_train_end``, ``on_fit_end``, ``teardown`` among ``hooks``) of the datamodule
    (its ``teardown``), of every callback that is not Lightning's or lightning_dp's and of the module, in the loop's
    order; an error is the caller's (a run that fails is not compared)."""
    trainer = module.trainer
    callbacks = [cb for cb in trainer.callbacks if not library_callback(cb)]
    datamodule = getattr(trainer, "datamodule", None)
    for name in hooks:
        stage = ("fit",) if name == "teardown" else ()
        if name == "teardown" and datamodule is not None:
            datamodule.teardown("fit")
        for cb in callbacks:
            getattr(cb, name)(trainer, module, *stage)
        getattr(module, name)(*stage)
