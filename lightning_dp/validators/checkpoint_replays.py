"""What the user's checkpoint hooks put into a checkpoint, judged by running them again on other data.

A checkpoint may carry only what the release boundary verified (docs/release_boundary.md, rule 3). The weights, the
optimizer's and the loop's state are checked where they are kept; but a module's ``on_save_checkpoint``, a callback's
``on_save_checkpoint`` or ``state_dict`` and a datamodule's ``state_dict`` run while the checkpoint is written and may
put anything into it without keeping it on themselves: class means and a covariance of the training features for an OOD
detector, read back by ``on_load_checkpoint`` on a resume. So does the code the model's own ``state_dict()`` runs
(:func:`state_dict_code_of_users`: a state dict hook of a module, a ``state_dict``, ``_save_to_state_dict`` or
``get_extra_state`` of the user's class — the training set's mean added to every state dict, zoo33 L46): then the
checkpoint's ``"state_dict"`` is built again in each run too; and so do an optimizer's and a scheduler's ``state_dict``
when it runs the user's code (:func:`optimizer_code_of_users`: a state dict hook registered on the optimizer, a class
overriding it; :func:`scheduler_code_of_users`, zoo34 L40/L41): their ``"optimizer_states"``/``"lr_schedulers"`` too.
:func:`written_from_data` runs those hooks of the user's again on a structural copy of the checkpoint being written
(its dicts and lists copied, what they hold shared), from the
same state and seeds: on the training data, with the training data's copies in memory exchanged for other values
(:mod:`lightning_dp.record_checks.outside_records`), and — when those two differ — on the training data again. A key the
exchanged run sets apart from the first, and the second plain run does not (a time stamp is not the data's), was
computed from the training data and is refused. What the hooks store alike — an epoch counter, a configuration string, a
public list of class names, ``ModelCheckpoint``'s and the library's own keys (their hooks are not run again) — is
written. Cost: nothing unless a hook of the user's is there, then two or three runs of those hooks per checkpoint.

This module imports no Lightning at import time (the glue imports it; Lightning imports the glue).
"""

from __future__ import annotations

from functools import partial

import hashlib
import pickle
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.validators.held_vocabulary import vocabulary_error, vocabulary_in
from lightning_dp.validators.hook_replays import replaying, users_hook
from lightning_dp.fingerprints.callback_state import is_datamodule
from lightning_dp.fingerprints.checksums import numpy_token, content_sums
from lightning_dp.fingerprints.fingerprint_entries import moved_by_data
from lightning_dp.records.library_objects import library_callback
from lightning_dp.replays.clock import ClockReads
from lightning_dp.replays.draws import DrawReads
from lightning_dp.replays.runs_again import plain_exchanged_again, run_once, set_apart
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.fingerprints.state_walker import binds, library_callable
from lightning_dp.record_checks.outside_records import records_in, records_in_checkpoint_error
from lightning_dp.validators.snapshot import StateSnapshot

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["check_checkpoint_hooks", "check_checkpoint_records", "checkpoint_hooks_of_users",
           "checkpoint_from_data_error", "optimizer_code_of_users", "scheduler_code_of_users",
           "state_dict_code_of_users", "written_from_data"]

MAX_DEPTH = 8
"""How deep the checkpoint's dicts, lists and tuples are walked (deeper values are compared as one object)."""


def _owners(trainer: "pl.Trainer") -> list[Any]:
    """The user's callbacks (not Lightning's or lightning_dp's) and the datamodule whose checkpoint hooks are theirs."""
    datamodule = getattr(trainer, "datamodule", None)
    return [*(cb for cb in trainer.callbacks if not library_callback(cb) and not is_datamodule(cb)),
            *([datamodule] if datamodule is not None else [])]


def checkpoint_hooks_of_users(trainer: "pl.Trainer", module: Any) -> bool:
    """Whether the module's ``on_save_checkpoint``, a user callback's ``on_save_checkpoint`` or ``state_dict``, the
    datamodule's ``state_dict``, or code run by the model's ``state_dict()`` (:func:`state_dict_code_of_users`) is the
    user's code."""
    return users_hook(getattr(type(module), "on_save_checkpoint", None)) or any(
        users_hook(getattr(type(owner), name, None)) for owner in _owners(trainer)
        for name in ("on_save_checkpoint", "state_dict")) or state_dict_code_of_users(module) \
        or optimizer_code_of_users(trainer) or scheduler_code_of_users(trainer)


_OPTIMIZER_STATE_DICT_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")
"""Where a torch optimizer keeps the hooks its ``state_dict()`` calls (``register_state_dict_pre_hook``,
``register_state_dict_post_hook``)."""


def _optimizers(trainer: "pl.Trainer") -> list[Any]:
    """The trainer's optimizers and every optimizer they wrap (Lightning's, lightning_dp's: ``_optimizer``,
    ``optimizer``), each once."""
    out: dict[int, Any] = {}
    for opt in getattr(trainer, "optimizers", None) or ():
        while opt is not None and id(opt) not in out:
            out[id(opt)] = opt
            opt = getattr(opt, "_optimizer", None) or getattr(opt, "optimizer", None)
    return list(out.values())


def optimizer_code_of_users(trainer: "pl.Trainer") -> bool:
    """Whether an optimizer's ``state_dict()`` — the checkpoint's ``"optimizer_states"`` — runs code of the user's: a
    state dict hook registered on it, or a class of the user's overriding ``state_dict`` (zoo34 L40: the training
    set's mean added to every checkpoint's optimizer state by a post-hook)."""
    for opt in _optimizers(trainer):
        if not library_callable(getattr(type(opt), "state_dict", None)):
            return True
        if any(not library_callable(hook) or binds(hook)
               for kind in _OPTIMIZER_STATE_DICT_HOOKS for hook in (vars(opt).get(kind) or {}).values()):
            return True
    return False


def scheduler_code_of_users(trainer: "pl.Trainer") -> bool:
    """Whether a learning-rate scheduler's ``state_dict()`` — the checkpoint's ``"lr_schedulers"`` — is the user's
    (a scheduler class overriding it: zoo34 L41, the training labels' rate added to it)."""
    return any(not library_callable(getattr(type(config.scheduler), "state_dict", None))
               for config in getattr(trainer, "lr_scheduler_configs", None) or ())


_STATE_DICT_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")
"""The methods of a module that build its part of ``state_dict()`` (a class of the user's may override them)."""

_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks")
"""Where a module keeps the hooks ``state_dict()`` calls (``_register_state_dict_hook``,
``register_state_dict_post_hook``, ``register_state_dict_pre_hook``)."""


def state_dict_code_of_users(module: Any) -> bool:
    """Whether the model's ``state_dict()`` — the checkpoint's ``"state_dict"`` — runs code of the user's: a state dict
    hook of a module of the tree that is no library's (its pre- and post-hooks), or a class of the user's overriding
    ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state`` (a library's, torchmetrics' or peft's, is not)."""
    for m in module.modules():
        cls = type(m)
        if any(fn is not None and not library_callable(fn)
               for fn in (getattr(cls, name, None) for name in _STATE_DICT_METHODS)):
            return True
        if any(not library_callable(hook) or binds(hook)
               for kind in _STATE_DICT_HOOKS for hook in (getattr(m, kind, None) or {}).values()):
            return True
    return False


def _structure(value: Any, depth: int = 0) -> Any:
    """``value`` with its dicts and lists copied (to :data:`MAX_DEPTH`), every other object shared."""
    if depth >= MAX_DEPTH:
        return value
    if type(value) is dict:
        return {k: _structure(v, depth + 1) for k, v in value.items()}
    if type(value) is list:
        return [_structure(v, depth + 1) for v in value]
    return value


def _rerun(trainer: "pl.Trainer", module: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The user's checkpoint hooks run on a structural copy of ``checkpoint``, as Lightning's ``dump_checkpoint``
    runs them (callbacks' ``state_dict`` under ``"callbacks"``, the datamodule's under its class name, then the
    callbacks' and the module's ``on_save_checkpoint``); returns the copy."""
    copy = _structure(checkpoint)
    owners = _owners(trainer)
    if "state_dict" in checkpoint and state_dict_code_of_users(module):  # built first, as dump_checkpoint builds it
        copy["state_dict"] = trainer.strategy.lightning_module_state_dict()
    if "optimizer_states" in checkpoint and optimizer_code_of_users(trainer):
        copy["optimizer_states"] = [trainer.strategy.optimizer_state(opt) for opt in trainer.optimizers]
    if "lr_schedulers" in checkpoint and scheduler_code_of_users(trainer):
        copy["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    full = "callbacks" in checkpoint  # weights_only checkpoints run neither callbacks' state nor their hook
    for owner in owners:
        if not users_hook(getattr(type(owner), "state_dict", None)):
            continue
        state = owner.state_dict()
        if not state:
            continue
        if is_datamodule(owner):
            copy[type(owner).__qualname__] = state
        elif full:
            copy.setdefault("callbacks", {})[owner.state_key] = state
    if full:
        for owner in owners:
            if not is_datamodule(owner) and users_hook(getattr(type(owner), "on_save_checkpoint", None)):
                owner.on_save_checkpoint(trainer, module, copy)
    if users_hook(getattr(type(module), "on_save_checkpoint", None)):
        module.on_save_checkpoint(copy)
    return copy


def _entries(checkpoint: dict[str, Any], known: set[int]) -> dict[str, Hashable]:
    """Every leaf of ``checkpoint`` by its path (``ood.means``, ``callbacks.Stats.mean``, ``items[0]``): an object the
    checkpoint being written holds already (``known``: its identity) by its identity, a new tensor or array by its
    contents, a number or string by its value, another object by a digest of its pickle."""
    out: dict[str, Hashable] = {}
    tensors: list[tuple[str, Tensor]] = []

    def visit(value: Any, path: str, depth: int) -> None:
        if value is None or isinstance(value, (bool, int, str, bytes)):
            out[path] = (type(value).__name__, value)
        elif isinstance(value, float):
            out[path] = ("float", repr(value))
        elif id(value) in known:
            out[path] = ("held", id(value))
        elif isinstance(value, Tensor):
            tensors.append((path, value))
        elif isinstance(value, dict) and depth < MAX_DEPTH:
            out[path] = ("dict", len(value))
            for k, v in value.items():
                visit(v, f"{path}.{k}" if path else str(k), depth + 1)
        elif isinstance(value, (list, tuple)) and depth < MAX_DEPTH:
            out[path] = (type(value).__name__, len(value))
            for i, v in enumerate(value):
                visit(v, f"{path}[{i}]", depth + 1)
        else:
            token = numpy_token(value)
            out[path] = token if token is not None else _pickled(value)

    visit(checkpoint, "", 0)
    sums = content_sums([t for _, t in tensors])
    for (path, t), digest in zip(tensors, sums):
        out[path] = ("tensor", str(t.dtype), tuple(t.shape), digest)
    return out


def _pickled(value: Any) -> Hashable:
    try:
        return ("object", type(value).__qualname__, hashlib.blake2b(pickle.dumps(value), digest_size=16).digest())
    except Exception:  # noqa: BLE001  (not picklable: it could not be saved either; compared by identity)
        return ("object", type(value).__qualname__, id(value))


def _known(value: Any, into: set[int], depth: int = 0) -> set[int]:
    into.add(id(value))
    if depth < MAX_DEPTH and isinstance(value, dict):
        for v in value.values():
            _known(v, into, depth + 1)
    elif depth < MAX_DEPTH and isinstance(value, (list, tuple)):
        for v in value:
            _known(v, into, depth + 1)
    return into


def written_from_data(trainer: "pl.Trainer", module: Any, checkpoint: dict[str, Any],
                      exchanged: Callable[[], AbstractContextManager], settings: Callable[[], AbstractContextManager],
                      skip_keys: frozenset[str], public: Callable[[str], bool],
                      any_rank: Callable[[bool], bool] = bool, modules: Sequence[Any] = (),
                      logs_moved: Callable[[], AbstractContextManager] = nullcontext) -> list[str]:
    """The keys of ``checkpoint`` (paths) the user's checkpoint hooks computed from the training data: run again
    from the same state (put back after each run) in ``settings()`` (the same seeds, the watches paused), on the
    training data and inside ``exchanged()`` (its copies in memory holding other values), and on the training data
    again when those two differ; what the exchanged run set apart and the second plain one did not. A run that
    fails (a hook that needs more of the loop) compares nothing. Paths ``public`` accepts are not returned.
    ``any_rank`` (one all-reduce when distributed) makes whether the hooks run again a decision every rank takes
    alike, so that a collective in them (a broadcast in ``on_save_checkpoint``) meets its peers'. ``modules``: the
    user's Python modules whose globals are put back after each run too (the boundary's ``global_modules()``).
    ``logs_moved()``: the values the training hooks logged moved far in the exchanged run too
    (:meth:`~.logged_reads.LoggedReads.moved`: ``checkpoint["last_train_loss"] = trainer.callback_metrics[...]``, a
    model card's ``dict(trainer.logged_metrics)`` are set apart; a held-out metric copied there is not)."""
    snapshot = StateSnapshot(module, _owners(trainer), skip_keys, modules)
    known = _known(checkpoint, set())
    clock = ClockReads(owners=[module, *_owners(trainer)])  # the first run's clock values, read by the others
    draws = DrawReads(owners=[module, *_owners(trainer)])  # and its unseeded draws

    def run(exchange: bool) -> Optional[dict[str, Hashable]]:  # (what the hook needs of the loop may be missing)
        return run_once(lambda: _entries(_rerun(trainer, module, checkpoint), known),
                        exchanged() if exchange else nullcontext(), logs_moved() if exchange else nullcontext(),
                        settings(), clock.next_run(), draws.next_run(), replaying(module), torch.no_grad(),
                        then=snapshot.restore)

    runs = plain_exchanged_again(run, lambda plain: any_rank(plain is not None), any_rank,  # alike on every rank
                                 differ=lambda plain, other: plain is not None and other is not None and plain != other)
    moved = set_apart(runs[0], runs[2], runs[1:2], moved_by_data) if len(runs) == 3 else []
    return [path for path in moved if not public(path)]


def checkpoint_from_data_error(paths: list[str]) -> Exception:
    """The refusal of a checkpoint whose keys the user's hooks computed from the training data."""
    from lightning_dp.errors import PrivacyConfigurationError, listed

    shown = listed(paths)
    return PrivacyConfigurationError(
        f"A checkpoint hook computed checkpoint entries from the training data: {shown}. The user's "
        "on_save_checkpoint (of the module or a callback), a callback's or the datamodule's state_dict, or the code "
        "the model's state_dict() runs (a state dict hook of a module, a state_dict, _save_to_state_dict or "
        "get_extra_state of the user's class), or an optimizer's or a learning-rate scheduler's state_dict code of the "
        "user's (a state dict hook registered on the optimizer, a state_dict its class overrides), run again "
        "while the checkpoint was written with the training data's values exchanged, put other values there: a "
        "statistic of the training set (class means or a covariance of its features for OOD scoring, a "
        "normalisation, a threshold) that no noise covers, saved with the model and read back on a resume "
        "(on_load_checkpoint). The checkpoint was not written. Compute it from public or held-out data, or from the "
        "released model alone (its parameters), or estimate it with a DP mechanism of your own and account for its "
        "ε; if it is not derived from the training data, or you accept that it leaves unprotected like a logged "
        f"metric, declare it public: DPStrategy(public_state={paths[:3]!r}).")


def check_checkpoint_records(step: Any, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint holding training records (:func:`~lightning_dp.record_checks.outside_records.records_in`: an
    ``on_save_checkpoint``
    adding examples, data passed to ``save_hyperparameters``) or a vocabulary read from them
    (:mod:`.held_vocabulary`)."""
    datasets = step.boundary.datasets()
    held = [p for d in datasets for p in records_in(checkpoint, d, "checkpoint")]
    if held:
        raise records_in_checkpoint_error(held)
    public = step.boundary.public_state
    kept = [f for d in datasets for f in vocabulary_in(checkpoint, d, public)]
    if kept:
        raise vocabulary_error(kept, "in the checkpoint about to be written; nothing was written")


def check_checkpoint_hooks(step: Any, module: Any, checkpoint: dict[str, Any],
                           replay_settings: Callable[[], AbstractContextManager[None]],
                           logs_moved: Callable[[], AbstractContextManager] = nullcontext) -> None:
    """Refuse a checkpoint entry the user's checkpoint hooks computed from the training data: they run again on
    its exchanged copy (:func:`written_from_data`, each run inside ``replay_settings``); only while the training data
    is there to exchange and a hook of the user's runs."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or step._source is None or not step.boundary.datasets() \
            or not checkpoint_hooks_of_users(trainer, module):
        return
    public = step.boundary.public_state
    moved = written_from_data(trainer, module, checkpoint,
                              partial(step.exchanged_training_data().exchanged, fixed_integers=True),
                              replay_settings, step.boundary.engine_keys, lambda path: is_public(path, public),
                              any_rank=step.any_rank, modules=step.boundary.global_modules(), logs_moved=logs_moved)
    if moved:
        raise checkpoint_from_data_error(moved)
