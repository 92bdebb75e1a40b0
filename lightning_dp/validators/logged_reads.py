"""Values logged from the training data are reports, not inputs: the user's code reading them back is watched.

``self.log("train_loss", loss)`` in a training hook puts an un-noised statistic of the private batch into the
trainer's ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics``. Shown by a logger or the progress bar
it is a report, outside the guarantee and said so (the README's caveats). Read back by the user's code it can steer
training without noise: a loss scaled by the last logged loss, a learning rate set from it, a callback that keeps it
for the model to read. During a private fit those three dicts are :class:`LoggedMetrics`; when the user's code (the
first caller outside the standard library that is not a library's: torch, Lightning, lightning_dp, …) reads a value a
training hook logged (:func:`~lightning_dp.validators.monitored.training_logged`, kept for the whole fit):

* inside a step, before its update (``training_step``, the forward, ``backward``, ``on_train_batch_start``,
  ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, ``optimizer_step``, the schedulers'
  ``lr_scheduler_step``): refused at once; there it can only steer the release or the update;
* anywhere else (``on_train_batch_end``, epoch hooks, validation): allowed (a callback printing the loss), and the
  reader is told to the release boundary (:attr:`LoggedReads.on_read`), which from then on fingerprints the reading
  callback, so that keeping the value is refused before the next release; and the optimizers' hyper-parameters as
  they were at the read are compared before the next release (:meth:`LoggedReads.check_release`: a learning rate
  set from the value is refused; a scheduler's step, which may change ``lr`` and momenta, is not). During validation
  (unwatched by the boundary) the Lightning glue takes the state at the read, and validation must end with it.

Reads through ``[]``, ``get``, ``items``, ``values``, ``pop``, ``copy``, ``copy.copy``, ``copy.deepcopy``, ``dict(m)``
and ``{**m}`` are seen; Lightning's private ``trainer._results`` is not. A torchmetrics ``Metric`` of the module is the
same kind of value (its states accumulate the training batches and are not fingerprinted): its ``compute()`` by the
user's code inside a step is refused too (:meth:`LoggedReads.watch_metrics`).
"""

from __future__ import annotations

import collections
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators import logger_copies, metric_values
from lightning_dp.validators.hook_replays import moved_far, moved_near
from lightning_dp.validators.monitored import training_logged
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.records.call_sites import STANDARD as _STANDARD, first_caller, package_of
from lightning_dp.records.library_objects import LIBRARY_PREFIXES
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.steered_settings import decisions, hyperparameters, hyperparameters_error
from lightning_dp.value_copies.logged_names import StepNames, due as names_due

STEP_HOOKS = frozenset({
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "training_step", "backward", "on_train_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "optimizer_step", "configure_gradient_clipping", "on_before_zero_grad",
    "optimizer_zero_grad", "lr_scheduler_step"})
"""The hooks Lightning runs inside a step before its update (as ``LightningModule._current_fx_name`` names them; the
batch-transfer hooks also run for validation batches), and the schedulers' step: a training-logged value read there
can only steer the release or the update."""

SCHEDULED = frozenset({"lr", "initial_lr", "momentum", "betas", "max_lr", "base_lr", "max_momentum", "base_momentum"})
"""The hyper-parameters torch's schedulers set (learning rates, momenta): their change is a scheduler's when one
stepped."""

_LIBRARIES = frozenset(LIBRARY_PREFIXES) | {"lightning_utilities", "tensorboardX", "tqdm", "rich", "pandas", "yaml",
                                              "fsspec", "wandb", "mlflow", "neptune", "comet_ml", "_pytest", "pluggy"}
_THIS = __name__
_KEPT = 4096  # the values of one name sent to the loggers kept, the latest (their copies are found by value)
_ABSENT = object()


class LoggedReads:
    """The watch over one trainer's logged metrics during a private fit.

    Args:
        trainer: the Lightning trainer.
        private: the names whose values are the training data's now (logged by a training hook, not declared public
            nor ε's), as :func:`~lightning_dp.validators.monitored.training_logged` finds them.
        on_read: told ``(reader, names)`` when the user's code reads such values outside a step; ``reader`` is the
            object whose method read them (a callback, the module) or ``None``.
    """

    def __init__(self, trainer: Any, private: Callable[[], Iterable[str]],
                 on_read: Callable[[Any, list[str]], None] = lambda reader, names: None) -> None:
        self.trainer = trainer
        self.private = private
        self.on_read = on_read
        self.active = False
        self._names: set[str] = set()  # every name logged by a training hook this fit (the results reset each epoch)
        self._read: Optional[tuple[list[str], Fingerprint, list[Any]]] = None  # names, hyper-parameters, schedulers
        self.count = 0  # the reads by the user's code outside a step so far (a decision window tells its own)
        self.started = time.time()  # files the loggers changed since are theirs (logger_copies)
        self._values: dict[str, collections.deque] = {}  # name -> the values sent to the loggers (the latest _KEPT)
        self._moving = 0
        self.rebuilt = logger_copies.refeeds(trainer, self.started - 1)  # the user's loggers: rebuilt, not searched
        self.step_names = StepNames()  # the names the batch hooks log, batch by batch (logged_names)

    def install(self) -> None:
        """Watch the trainer's three metric dicts (again: Lightning replaces them when it resets its metrics); called
        as each batch's step begins: a set of names the batch hooks logged not seen before (:mod:`.logged_names`)
        makes this batch checked, its replays judging the names."""
        connector = getattr(self.trainer, "_logger_connector", None)
        if connector is None:
            return
        self.step_names.close(_batches(self.trainer))
        schedule = getattr(getattr(getattr(self.trainer, "strategy", None), "private_step", None), "schedule", None)
        if names_due() and schedule is not None:
            schedule.force()
        for attribute in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics"):
            current = getattr(connector, attribute, None)
            if isinstance(current, dict) and not (isinstance(current, LoggedMetrics) and current.reads is self):
                setattr(connector, attribute, LoggedMetrics(current, self))
        _watch_results(self)
        self.active = True

    @contextmanager
    def moved(self, up: bool = True, states: bool = True, training_only: bool = False) -> Iterator[None]:
        """Inside, the training-logged values in the trainer's three metric dicts are moved far (1000·(value + 1)), or
        near zero (``up`` false: a thousandth), and so are the metrics updated while the trainer trained
        (:func:`.metric_values.moved`; not with ``states`` false; ``training_only``: the training loop's logged
        names only — the checkpoint hooks' runs, where a validation metric's value read back stays as it is), and so
        are the loggers' own copies of those values (:mod:`.logger_copies`, by name and by value: a logger's history,
        its files): a run of the user's hooks on other data reads other logged values too, on either side of a
        threshold (:mod:`.decisions`)."""
        connector = getattr(self.trainer, "_logger_connector", None)
        names = set(self.private())
        if training_only:  # the training loop's names only (not validation's, even on the training records)
            names &= training_logged(self.trainer)
        saved: list[tuple[dict, Any, Any]] = []
        for attribute in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics"):
            metrics = getattr(connector, attribute, None)
            for key in [k for k in dict.keys(metrics) if k in names] if isinstance(metrics, dict) else ():
                value = dict.__getitem__(metrics, key)
                saved.append((metrics, key, value))
                dict.__setitem__(metrics, key, _moved(value, up))
        if training_only:  # what Lightning recomputes from its results inside (callback_metrics) moves too
            _MOVING[0] = (names, up)
        self._moving += 1
        try:
            with metric_values.moved(up) if states else nullcontext(), \
                    logger_copies.moved(getattr(self.trainer, "loggers", None) or (), names, lambda v: _moved(v, up),
                                        files=bool(getattr(self.trainer, "is_global_zero", True)),
                                        other=lambda v: _moved(v, not up), values=self.logged_values(names),
                                        since=self.started - 1, rebuilt=self.rebuilt):
                yield
        finally:
            self._moving -= 1
            _MOVING[0] = None
            for metrics, key, value in reversed(saved):
                dict.__setitem__(metrics, key, value)

    def note(self, metrics: dict) -> None:
        """Keep the values Lightning sends the loggers (``metrics["log"]``, as :func:`_watch_results` sees them
        computed; not while :meth:`moved`), the last :data:`_KEPT` of each name: their copies are found by value."""
        if self._moving or not isinstance(logged := metrics.get("log"), dict):
            return
        for name, value in logged.items():
            kept = self._values.setdefault(name, collections.deque(maxlen=_KEPT))
            if not kept or kept[-1] is not value:
                kept.append(value.detach() if isinstance(value, torch.Tensor) else value)

    def logged_values(self, names: Iterable[str]) -> dict[str, list[float]]:
        """The values of ``names`` sent to the loggers so far (:meth:`note`), as floats (converted once)."""
        out: dict[str, list[float]] = {}
        for name in names:
            kept = list(self._values.get(name) or ())
            tensors = [v.float().reshape(()) for v in kept if isinstance(v, torch.Tensor) and v.numel() == 1]
            if tensors:
                try:  # one copy to the host for them all
                    floats = torch.stack(tensors).tolist()
                except RuntimeError:  # on several devices
                    floats = [float(t) for t in tensors]
                kept = [v for v in kept if not isinstance(v, torch.Tensor)] + floats
                self._values[name] = collections.deque(kept, maxlen=_KEPT)
            out[name] = [float(v) for v in kept if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return out

    def watch_metrics(self, module: nn.Module, public: Callable[[str], bool] = lambda name: False) -> None:
        """Watch every torchmetrics ``Metric`` (at the class level: wherever it lives, the module, a dict, a callback,
        a global): its states accumulate the training batches (they are not fingerprinted: they feed ``self.log``),
        so its value read back inside a step — ``compute()`` or its states by the user's code, or what ``forward``
        returns carried into the loss — is refused as a logged value would be (:mod:`.metric_values`); one updated
        while the trainer trains (its name not ``public``) reads moved in :meth:`moved`."""
        def inside() -> Optional[str]:
            hook = getattr(getattr(self.trainer, "lightning_module", None), "_current_fx_name", None)
            return hook if self.active and hook in STEP_HOOKS else None

        def name(metric: Any) -> str:
            found = next((n for n, m in module.named_modules() if m is metric and n), None)
            return found or type(metric).__name__

        def training(metric: Any) -> bool:
            trainer = self.trainer
            return self.active and bool(getattr(trainer, "training", False)) and not public(name(metric))

        metric_values.watch(inside, lambda read, hook: logged_read_error([read], f"in {hook}"), name, training)

    def unwatch_metrics(self) -> None:
        """The metrics compute as they did."""
        metric_values.unwatch()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside are not watched: the first step's replays of the batch hooks (what the hooks keep or set there
        is judged by the replays themselves; the real hooks' reads are watched when they run)."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def stop(self) -> None:
        """Training is over: the logged values may be read (a report of the run); the trainer's dicts are plain
        dicts again (Lightning copies them by their type and saves them: a spawned process's results), and the
        metrics compute as they did."""
        self.active = False
        self.unwatch_metrics()
        self.rebuilt.stop()
        _watch_results(None)
        connector = getattr(self.trainer, "_logger_connector", None)
        for attribute in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics"):
            current = getattr(connector, attribute, None)
            if isinstance(current, LoggedMetrics):
                setattr(connector, attribute, dict(super(LoggedMetrics, current).items()))

    def check(self, keys: Iterable[Any]) -> None:
        """Called by :class:`LoggedMetrics` before ``keys`` are read: refuse or report a read by the user's code."""
        if not self.active:
            return
        hook = getattr(getattr(self.trainer, "lightning_module", None), "_current_fx_name", None)
        reader = _users_frame()
        if reader is None and (hook not in STEP_HOOKS or _logging()):
            return
        self._names |= set(self.private())
        names = sorted(str(k) for k in keys if k in self._names)
        if not names:
            return
        if hook in STEP_HOOKS:  # whoever reads (a progress bar's get_metrics, the connector's metrics), for the step
            raise logged_read_error(names, f"in {hook}")
        self.count += 1
        if self._read is None:
            self._read = (names, self._hyperparameters(), self._scheduler_steps())
        self.on_read(reader.f_locals.get("self"), names)

    def check_results(self, metrics: Any) -> None:
        """Called when Lightning's results are turned into the metric dicts (``_logger_connector.metrics``):
        inside a step hook, unless for ``self.log``, the library's own code or the trainer's dict properties (whose
        dicts are watched key by key), a dict holding training-logged values is read for the step: refused."""
        if not self.active or not isinstance(metrics, dict):
            return
        hook = getattr(getattr(self.trainer, "lightning_module", None), "_current_fx_name", None)
        if hook not in STEP_HOOKS or _logging():
            return
        self._names |= set(self.private())
        names = sorted({str(k) for part in metrics.values() if isinstance(part, dict) for k in dict.keys(part)
                        if k in self._names})
        if names:
            raise logged_read_error(names, f"in {hook} (trainer._logger_connector.metrics)")

    def check_release(self, judged: Optional[Fingerprint] = None) -> None:
        """Before a release: refuse if the optimizers' hyper-parameters changed since the user's code read a
        training-logged value (outside a step), other than by a scheduler's step (``lr``, momenta) or as ``judged``
        (decision → value: a window's hooks run again on other data with the logged values moved, found to decide alike,
        :attr:`~.decisions.DecisionWindows.judged` — a layer unfrozen at an epoch's start from the epoch count)."""
        taken, self._read = self._read, None
        if taken is None:
            return
        names, before, steps = taken
        stepped, now, judged = self._scheduler_steps() != steps, self._hyperparameters(), judged or {}
        changed = [n for n in StateFingerprint.changed(before, now)
                   if not (stepped and (n.rpartition(".")[2] in SCHEDULED or n.startswith("scheduler ")))
                   and judged.get(re.sub(r"^\[(\d+)\] optimizer ", r"optimizer \1 ", n), _ABSENT) != now.get(n)]
        if changed:
            error = hyperparameters_error(changed, f"after the user's code read {', '.join(repr(n) for n in names)}, "
                                          "logged from the training data (outside a step)")
            raise PrivacyConfigurationError(
                f"{error} If the value was only reported (printed) and the rate is set from the step count, declare "
                f"the name public: DPStrategy(public_state={names!r}).")

    def _hyperparameters(self) -> Fingerprint:
        """The optimizers' hyper-parameters and state, and the other decisions (:func:`~.steered_settings.decisions`:
        which optimizers step and which parameters train, the schedulers, the trainer's stop)."""
        return {**{f"[{i}] {k}": v for i, opt in enumerate(getattr(self.trainer, "optimizers", ()) or ())
                   for k, v in hyperparameters(opt).items()}, **decisions(self.trainer)}

    def _scheduler_steps(self) -> list[Any]:
        return [getattr(c.scheduler, "last_epoch", None) for c in getattr(self.trainer, "lr_scheduler_configs", ())]


def logged_read_error(names: list[str], where: str) -> PrivacyConfigurationError:
    """The refusal of a training-logged value read back inside a step."""
    return PrivacyConfigurationError(
        f"The logged value(s) {', '.join(repr(n) for n in names)} were read back {where}: they were logged by a "
        "training hook from the private batch, without noise, and read here they steer this step's release or update "
        "(a loss scaled by the last loss, a learning rate set from it) or go into a checkpoint, outside the guarantee. "
        "Nothing more was released. Steer training (and fill checkpoints) by the step count or by metrics of held-out "
        "data (logged in validation_step); or, "
        "if the value is computed from public data only, declare it: DPStrategy(public_state=[name]) "
        "(docs/release_boundary.md, rule 10).")


class LoggedMetrics(dict):
    """One of the trainer's metric dicts, whose reads are shown to :class:`LoggedReads` first."""

    def __init__(self, data: Any = (), reads: Optional[LoggedReads] = None) -> None:
        super().__init__(data)
        self.reads = reads  # None: a copy Lightning made of it (``apply_to_collection`` at teardown), not watched

    def _check(self, keys: Iterable[Any]) -> None:
        if self.reads is not None:
            self.reads.check(keys)

    def __getitem__(self, key: Any) -> Any:
        self._check((key,))
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            self._check((key,))
        return super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self._check((key,))
        return super().pop(key, *default)

    def items(self) -> Any:
        self._check(self.keys())
        return super().items()

    def values(self) -> Any:
        self._check(self.keys())
        return super().values()

    def copy(self) -> dict:
        self._check(self.keys())
        return dict(super().items())

    def __copy__(self) -> dict:
        return self.copy()

    def __iter__(self) -> Iterator[Any]:  # its own: CPython's ``dict(m)`` and ``{**m}`` then read through __getitem__
        return iter(list(self.keys()))

    def __deepcopy__(self, memo: dict) -> dict:
        import copy

        self._check(self.keys())
        return copy.deepcopy(dict(super().items()), memo)

    def __reduce__(self) -> Any:  # pickled (a checkpoint, a spawned process) as the plain dict it stands for
        return (dict, (dict(super().items()),))


_RESULTS: list[Any] = []  # (the results class, its own ``metrics`` and ``log``) while a fit is watched
_WATCHING: list[Optional[LoggedReads]] = [None]


_MOVING: list[Optional[tuple[set[str], bool]]] = [None]  # (names, up) while LoggedReads.moved() runs


def _move(out: dict, names: set[str], up: bool) -> None:
    """Move the training-logged values in the metric dicts Lightning computes from its results (``callback_metrics``
    is refreshed from them at every read while a loop's results exist), as :meth:`LoggedReads.moved` moved the kept
    ones."""
    for part in out.values():
        if isinstance(part, dict):
            for key in [k for k in part if k in names]:
                part[key] = _moved(part[key], up)


def _batches(trainer: Any) -> int:
    """The loop's count of the batches made ready this fit (0 before the first)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(getattr(getattr(loop, "batch_progress", None), "total", None), "ready", 0) or 0)


def _moved(value: Any, up: bool) -> Any:
    """A logged value moved far (``up``) or near zero, as the runs on other data read it."""
    return moved_far(value) if up else moved_near(value)


def _watch_results(reads: Optional[LoggedReads]) -> None:
    """Watch Lightning's ``_ResultCollection.metrics`` (at the class level) for ``reads``; ``None``: restore it."""
    _WATCHING[0] = reads
    if reads is None:
        while _RESULTS:
            cls, own, log = _RESULTS.pop()
            cls.metrics, cls.log = own, log
        return
    if _RESULTS:
        return
    for prefix in ("pytorch_lightning", "lightning.pytorch"):
        module = sys.modules.get(f"{prefix}.trainer.connectors.logger_connector.result")
        cls = getattr(module, "_ResultCollection", None)
        own = vars(cls).get("metrics") if cls is not None else None
        log = vars(cls).get("log") if cls is not None else None
        if own is None or log is None:
            continue

        def metrics(results: Any, *args: Any, _own: Any = own, **kwargs: Any) -> Any:
            out = _own(results, *args, **kwargs)
            watching = _WATCHING[0]
            if watching is not None:
                watching.check_results(out)
                if isinstance(out, dict):
                    watching.note(out)
            if _MOVING[0] is not None and isinstance(out, dict):
                _move(out, *_MOVING[0])
            return out

        def logging(results: Any, fx: str, name: str, *args: Any, _log: Any = log, **kwargs: Any) -> Any:
            watching = _WATCHING[0]  # the names the batch hooks log, batch by batch (a name is a channel too)
            if watching is not None and watching.active and getattr(watching.trainer, "training", False):
                watching.step_names.note(fx, name, _batches(watching.trainer))
            return _log(results, fx, name, *args, **kwargs)

        _RESULTS.append((cls, own, log))
        cls.metrics, cls.log = metrics, logging


_LOGGING = frozenset({"callback_metrics", "logged_metrics", "progress_bar_metrics", "log", "log_dict",
                      "__to_tensor", "_LightningModule__to_tensor", "__check_not_nested", "__check_allowed"})


def _logging() -> bool:
    """Whether the read is on the path of Lightning's ``self.log``, of the trainer's dict properties (their dicts are
    watched key by key) or lightning_dp's own code, reached
    before any of the user's code: the only reads of the metric dicts allowed while a step hook runs; anything else
    (a library's accessor the step called) reads them for the step."""
    frame = first_caller(2, also=lambda f: package_of(f) in _PASSED and not _logging_frame(f))
    return frame is not None and _logging_frame(frame)  # not: the user's code (a progress bar's get_metrics it calls)


_PASSED = _LIBRARIES | _STANDARD
"""The libraries' and the standard library's frames, passed over on the way to the user's code or to logging."""


def _logging_frame(frame: FrameType) -> bool:
    """A frame of lightning_dp's own code (not this module), or of Lightning's ``self.log`` or metric dicts."""
    name = frame.f_globals.get("__name__", "") or ""
    return (name.split(".")[0] == "lightning_dp" and name != _THIS) or (frame.f_code.co_name in _LOGGING and (
        name.endswith("core.module") or name.endswith("logger_connector.logger_connector")))


def _users_frame() -> Optional[Any]:
    """The frame of the first caller that is neither this module nor the standard library, if it is the user's code
    (not a library's)."""
    frame = first_caller(2, modules=(_THIS,), standard=True)
    return None if frame is None or package_of(frame) in _LIBRARIES else frame
