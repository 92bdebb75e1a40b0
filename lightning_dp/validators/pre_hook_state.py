"""The state as the fit started, before the hooks that see no batch ran: where their replays start.

The replays of ``setup``, ``configure_model``, ``on_fit_start``, ``on_train_start`` and the epoch hooks
(:meth:`~.step_replays.StepReplays._replay_epoch_hooks`) run at the first step, after the real hooks ran. Started from
the state those hooks left, a write made only on one side of a threshold (``if p > 0.5: trainer.limit_train_batches =
3``, with no other branch) cannot be seen: the replay on the exchanged data skips the write and leaves the value the
real run wrote, which the replay on the data writes again, so the two agree. :class:`PreHookState` records what those
hooks may write, as the fit starts — the strategy's ``connect``, before any ``setup`` — and
:meth:`PreHookState.put_back` sets it back before every replay, so each replay starts from the state as it was before
the real hooks and what each leaves is compared:

- the user's state (:class:`~.snapshot.StateSnapshot`: the module's and its layers' attributes and buffers, the
  user's callbacks' and the datamodule's attributes, the user's globals and class bodies) as at ``connect``; what the
  library and Lightning added since that no snapshot of the user's holds (the engine's attributes, Lightning's) stays,
  and a buffer the strategy moved to a device or a dtype since is moved there again;
- the trainer's length decisions (``should_stop``, ``max_epochs``, ``max_steps``) and the library settings
  (:func:`~.steered_settings.library_settings`: ``limit_train_batches``, validation and logging intervals, a library
  callback's patience or threshold) as at ``connect``;
- the model's weights as at ``connect``, by name, where the shapes still agree (copied in; the model's own values are
  put back after every replay: :func:`~.hook_replays.model_kept`), unless the model holds more than
  :data:`WEIGHTS_LIMIT` numbers (then the replays start from the weights as they are); a parameter FSDP2 sharded
  since (a ``DTensor``) is left as it is;
- the optimizers' hyper-parameters and defaults and the learning-rate schedulers' states as they were built, before
  ``on_fit_start`` (:meth:`PreHookState.note_optimizers`, from the strategy's setup).

After every replay the state the real hooks left is put back (the replays' own snapshot and
:func:`~.steered_settings.replay_records`), so a fit the judge accepts trains as it would without it. Not recorded:
the mechanism's σ and C (the strategy keeps them: :mod:`.mechanism_settings`), callbacks a module's
``configure_callbacks`` adds (attached after ``connect``: their replays start from the state they were found in), and
what lies outside the user's state (a file written, a library's object the user's state does not reach).
"""

from __future__ import annotations

from typing import Any, Callable, Container, Sequence

import torch
from torch.nn.parameter import is_lazy

from lightning_dp.fingerprints.module_tree import engine_forward
from lightning_dp.records.library_objects import framework_keys
from lightning_dp.validators.schedule_state import schedule_controls
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.steered_settings import library_settings

__all__ = ["WEIGHTS_LIMIT", "PreHookState"]

WEIGHTS_LIMIT = 1 << 24
"""Models with more parameters than this (64 MiB of float32) are not copied as the fit starts: their replays start
from the weights as the real hooks left them (a write to the weights made on one side of a threshold is not seen)."""

_ABSENT = object()


class PreHookState:
    """What the hooks that see no batch may write, recorded as the fit starts (see the module docstring).

    Args:
        trainer: the trainer, as the strategy connects the model.
        module: the model.
        users: the user's objects whose attributes are recorded (callbacks that are not the libraries', the
            datamodule).
        modules: the Python modules of the user's code (their globals and class bodies).
        engine_keys: the attribute names the engine sets on the model's layers (read as the state is put back: the
            engine attaches later).
    """

    def __init__(self, trainer: Any, module: torch.nn.Module, users: Sequence[Any], modules: Sequence[Any],
                 engine_keys: Callable[[], Container[str]]) -> None:
        self._trainer, self._module, self._engine_keys = trainer, module, engine_keys
        self._snapshot = StateSnapshot(module, users, (), modules, settings=False)
        fit = getattr(trainer, "fit_loop", None)
        self._stops = (bool(getattr(trainer, "should_stop", False)), getattr(fit, "max_epochs", None),
                       getattr(getattr(fit, "epoch_loop", None), "max_steps", None))
        self._settings = library_settings(trainer)
        params = [(name, p) for name, p in module.named_parameters() if not is_lazy(p) and not p.is_meta]
        self._weights = [(name, p.detach().clone()) for name, p in params] \
            if sum(p.numel() for _, p in params) <= WEIGHTS_LIMIT else []  # (a lazy or meta one: as it is)
        self._optimizers: list[tuple[Any, list[dict[str, Any]], dict[str, Any]]] = []
        self._schedules: dict[str, Any] = {}

    def note_optimizers(self, optimizers: Sequence[Any]) -> None:
        """The optimizers' hyper-parameters and defaults and the schedulers' states as they were built (the
        strategy's setup, after ``configure_optimizers``, before ``on_fit_start``)."""
        self._optimizers = [(o, [{k: v for k, v in group.items() if k != "params"} for group in o.param_groups],
                             dict(getattr(o, "defaults", None) or {})) for o in optimizers]
        self._schedules = schedule_controls(self._trainer)

    def put_back(self) -> None:
        """Set what was recorded back (see the module docstring): where a replay of the hooks that see no batch
        starts. The state the real hooks left is the caller's to put back after the replay."""
        module, trainer = self._module, self._trainer
        skip = framework_keys() | frozenset(self._engine_keys())
        unheld = [(m, key, value) for m in module.modules() for key, value in vars(m).items()
                  if key.startswith("_dp_") or (key in skip and (key != "forward" or engine_forward(value)))]
        placed = [(m, name, b.device, b.dtype) for m in module.modules() for name, b in m._buffers.items()
                  if b is not None]
        self._snapshot.restore()
        for m, key, value in unheld:  # what no snapshot of the user's holds (the engine's, Lightning's): as it is
            if m.__dict__.get(key, _ABSENT) is not value:
                m.__dict__[key] = value
        for m, name, device, dtype in placed:  # a buffer recorded before the strategy moved the model: moved again
            b = m._buffers.get(name)
            if b is not None and (b.device != device or b.dtype != dtype):
                m._buffers[name] = b.to(device=device, dtype=dtype)
        self._put_settings(trainer)
        now = dict(module.named_parameters())
        with torch.no_grad():
            for name, value in self._weights:
                p = now.get(name)  # (a parameter FSDP2 sharded since, a DTensor, as it is: its shards are its own)
                if p is not None and not p.is_meta and p.shape == value.shape and type(p.data) is torch.Tensor:
                    value = value.to(device=p.device, dtype=p.dtype)
                    if not torch.equal(p.data, value):
                        p.data.copy_(value)
        for optimizer, groups, defaults in self._optimizers:
            for group, values in zip(optimizer.param_groups, groups):
                params = group["params"]
                group.clear()
                group.update(values, params=params)
            if isinstance(getattr(optimizer, "defaults", None), dict):
                optimizer.defaults.clear()
                optimizer.defaults.update(defaults)
        now_schedules = schedule_controls(trainer)
        for name, note in self._schedules.items():
            if name in now_schedules and now_schedules[name] != note:
                note.put()

    def _put_settings(self, trainer: Any) -> None:
        """The trainer's length decisions and the library settings as recorded."""
        should_stop, max_epochs, max_steps = self._stops
        trainer.should_stop = should_stop
        fit = getattr(trainer, "fit_loop", None)
        if fit is not None and getattr(fit, "max_epochs", None) != max_epochs:
            fit.max_epochs = max_epochs
        epoch_loop = getattr(fit, "epoch_loop", None)
        if epoch_loop is not None and getattr(epoch_loop, "max_steps", None) != max_steps:
            epoch_loop.max_steps = max_steps
        current = library_settings(trainer)  # only those that are settings still (what is put back after a replay:
        for name, (obj, key, value) in self._settings.items():  # a callback's None its setup made an object is not)
            if name not in current or current[name][0] is not obj:
                continue
            now = vars(obj).get(key, _ABSENT)
            if now is not value and (type(now) is not type(value) or now != value):
                setattr(obj, key, value)

