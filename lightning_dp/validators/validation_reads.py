"""Evaluation hooks that read the training records by another path than their loader (valtrain31; zoo30 m06;
after the fit: validate31, zoo32 v10).

A validation loader may hold out its records while ``validation_step`` computes its metric on the training rows
reached another way — ``self.trainer.train_dataloader.dataset.tensors``, ``self.trainer.datamodule.train_set``, a
copy the module took in ``setup`` (``self.train_x``), a global of the user's script — and an
``EarlyStopping(monitor="val_loss")`` then stops the fit on an un-noised statistic of the training set: the number of
releases is steered by the private data. :mod:`.monitored` sees only the validation *loaders*.

:class:`EvaluationReads` watches the torch calls made while a validation loop runs inside a private fit (a
``TorchFunctionMode`` the Lightning glue enters when validation starts and leaves when it ends) from the user's
evaluation hooks (:data:`EVALUATION_HOOKS`, as ``LightningModule._current_fx_name`` names them: the module's and the
callbacks'; the loader's own fetches run outside them). A call handed one of the training data's copies in memory
— what the batch check exchanges (:func:`~lightning_dp.record_checks.outside_records.training_copies`: the training
dataset's tensors, NumPy arrays and lists, and the copies the model, the datamodule, the callbacks and the user's
globals keep), or a view of their memory — reads the training records, unless it only asks for their metadata
(:data:`METADATA`: ``len``, ``shape``, ``size()``, ``dtype``, ``device``), or the call is lightning_dp's own (its
callbacks' fingerprints of the state, its replays: past torch's frames and the relays on the user's path — the
engines' layer hooks, its models' forwards —, :func:`library_call`). A call is checked only when the tensors handed
to it lie on the storage of a copy (a set lookup; then their byte ranges): about 5 µs a torch call of the hooks.
From that read on, every value validation
logs in this fit is the training data's (:func:`read_in_evaluation`, asked by
:func:`~.monitored.validates_on_training_data`): a scheduler or callback monitoring any value is refused at once,
naming the hook (:func:`validation_read_error`), a read back of a validation-logged value is judged as one of a
training-logged value (:mod:`.logged_reads`), and the state validation keeps after the read is refused (the glue).
``public_state=["trainer.validate"]`` declares such evaluation a report, as outside a fit
(:mod:`.evaluated_records`).

After the fit (zoo32 v10: ``trainer.validate(model, held_out_loader)`` whose ``validation_step`` computes the loss of
a global copy of the training rows returned it un-noised), the glue opens the same watch for ``trainer.validate``,
``test`` and ``predict`` under a private strategy, over the copies of the training dataset of that strategy's or that
module's last private fit (:func:`~.evaluated_records.trained_dataset`; :func:`copies_after_fit`): outside a fit the
strategy cannot see where the result goes, so a read refuses the evaluation at once
(:func:`evaluation_read_error`), unless ``trainer.<stage>`` is declared public; the strategy's ``on_*_end`` closes the
watch (and raises again a refusal a handler swallowed), its teardown when the evaluation failed.

The watch opens as the evaluation loop starts (:func:`watch_from_run_start`: Lightning's ``on_run_start`` of the
fit's validation loop and of ``validate``'s, ``test``'s and ``predict``'s, wrapped on the loop for the run), before
the first hook of the user's — ``on_validation_model_eval``, the callbacks' and the module's ``on_validation_start``
(``on_test_start``, ``on_predict_start``), which Lightning calls before the strategy's (zoo32 residue).

Not seen here: a read during the sanity check (before training: no training loader yet; judged as training starts
by :mod:`.sanity_reads`, zoo39), of a copy the walk does not
find (transformed, in a file, beyond its bounds), through a NumPy or Python operation alone (a statistic computed by
NumPy on the training arrays and never handed to torch), and held-out rows of a tensor that also holds training
rows (a ``random_split``'s base tensor) read by a hook: taken for a training read.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.callback_state import trusted_callback
from lightning_dp.fingerprints.state_walker import user_modules
from lightning_dp.record_checks.holders import RowItems
from lightning_dp.record_checks.outside_records import training_copies
from lightning_dp.records.call_sites import first_caller, package_of
from lightning_dp.records.memory_spans import memory_span
from lightning_dp.validators.loop_wraps import wrap_method

EVALUATION_HOOKS = frozenset({
    "validation_step", "test_step", "predict_step",
    "on_validation_start", "on_test_start", "on_predict_start",
    "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end", "on_validation_epoch_end",
    "on_validation_end", "on_validation_model_eval", "on_validation_model_train", "on_test_model_eval",
    "on_test_model_train",
    "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end", "on_test_epoch_end", "on_test_end",
    "on_predict_epoch_start", "on_predict_batch_start", "on_predict_batch_end", "on_predict_epoch_end",
    "on_predict_end", "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"})
"""The user's hooks an evaluation loop runs (the batch-transfer hooks: on its batches, while it runs)."""

METADATA = frozenset({
    "__len__", "size", "dim", "ndimension", "numel", "nelement", "shape", "ndim", "dtype", "device", "layout",
    "is_floating_point", "is_complex", "is_signed", "stride", "element_size", "is_contiguous", "storage_offset",
    "requires_grad", "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_leaf", "names", "itemsize", "nbytes"})
"""Tensor methods and properties that read no value of the records: the training set's length, its shape."""

_READ: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
"""A trainer -> the first evaluation hook that read the training records during its current fit."""


def watch_from_run_start(trainer: Any, open_watch: Callable[[], None]) -> Callable[[], None]:
    """Wrap the evaluation loops' ``on_run_start`` (the fit's validation loop, ``trainer.validate_loop``,
    ``test_loop`` and ``predict_loop``) so that ``open_watch`` runs before their first hook; return the function that
    restores them (module docstring)."""
    loops = {id(loop): loop for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop,
                                         trainer.test_loop, trainer.predict_loop)}

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def on_run_start(*args: Any, **kwargs: Any) -> Any:
            open_watch()
            return original(*args, **kwargs)
        return on_run_start

    undos = [wrap_method(loop, "on_run_start", make) for loop in loops.values()]

    def undo() -> None:
        for restore in undos:
            restore()
    return undo


def read_in_evaluation(trainer: Any) -> Optional[str]:
    """The evaluation hook that read the training records during ``trainer``'s fit (``None``: none did)."""
    try:
        return _READ.get(trainer)
    except TypeError:  # a trainer without weak references
        return None


def forget(trainer: Any) -> None:
    """The fit is over: its evaluation reads no longer mark a later fit's."""
    try:
        _READ.pop(trainer, None)
    except TypeError:
        pass


class EvaluationReads(TorchFunctionMode):
    """Notes the first read of the training data's ``copies`` ((name, tensor, NumPy array, list or
    :class:`~lightning_dp.record_checks.holders.RowItems`)) by the user's evaluation hooks (module docstring), then
    calls ``on_read(hook)``; an error it raises is kept in :attr:`error` as well (raised again by :meth:`close` if a
    handler in the hook swallowed it).

    Args:
        trainer: the fitting trainer (its module names the hook running: ``_current_fx_name``).
        copies: the training data's copies in memory.
        on_read: told the hook that read (after :func:`read_in_evaluation` says so).
        replaying: whether the library runs the user's hooks again now (its replays judge their own reads).
    """

    def __init__(self, trainer: Any, copies: Sequence[tuple[str, Any]], on_read: Callable[[str], None],
                 replaying: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self._trainer, self._on_read, self._replaying = trainer, on_read, replaying
        self._module = trainer.lightning_module
        self._lists = {id(v) for _, v in copies if isinstance(v, list)}
        self._storages: set[int] = set()  # the tensors' storages: a tensor on none of them is no copy (checked first)
        spans: dict[str, list[tuple[int, int]]] = {}
        for _, value in copies:
            for array in value.arrays if isinstance(value, RowItems) else [value]:
                span = memory_span(array) if isinstance(array, (Tensor, np.ndarray)) else None
                if span is not None:
                    spans.setdefault(span[0], []).append(span[1:])
                if isinstance(array, Tensor) and span is not None:
                    self._storages.add(array.untyped_storage().data_ptr())
        self._spans = {device: _merged(found) for device, found in spans.items()}
        self._numpy = any(isinstance(a, np.ndarray) for _, v in copies for a in (v.arrays if isinstance(v, RowItems)
                                                                                  else [v]))
        self.read: Optional[str] = None
        self.error: Optional[BaseException] = None
        self._open = False

    def open(self) -> "EvaluationReads":
        """Start watching (pushes the mode)."""
        if self._spans or self._lists:
            self.__enter__()
            self._open = True
        return self

    def close(self) -> None:
        """Stop watching (the mode popped when it is still the innermost); raise again an error
        :meth:`__torch_function__` raised that a handler swallowed."""
        if self._open:
            self._open = False
            pop_mode(self)
        error, self.error = self.error, None
        if error is not None:
            raise error

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._open and self.read is None:
            hook = getattr(self._module, "_current_fx_name", None)
            if hook in EVALUATION_HOOKS and function_name(func) not in METADATA and self._reads(args, kwargs) \
                    and not self._replaying() and not library_call():
                self.read = hook
                try:
                    _READ[self._trainer] = hook
                except TypeError:
                    pass
                try:
                    self._on_read(hook)
                except BaseException as error:
                    self.error = error
                    raise
        return func(*args, **kwargs)

    def _reads(self, args: tuple, kwargs: dict) -> bool:
        """Whether a tensor, NumPy array or list among the call's arguments (and in a list or tuple of them) is, or
        views the memory of, a training copy."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)) and id(value) not in self._lists:
                if any(self._is_copy(v) for v in value[:64]):
                    return True
            elif self._is_copy(value):
                return True
        return False

    def _is_copy(self, value: Any) -> bool:
        if isinstance(value, list):
            return id(value) in self._lists
        if isinstance(value, Tensor):
            try:
                if value.untyped_storage().data_ptr() not in self._storages and not (self._numpy and value.is_cpu):
                    return False  # (a tensor over a NumPy copy's memory, torch.from_numpy, has a storage of its own)
            except (RuntimeError, NotImplementedError):  # no storage (a sparse or a wrapper tensor)
                return False
        elif not isinstance(value, np.ndarray):
            return False
        span = memory_span(value)
        return span is not None and self.covers(span)

    def covers(self, span: tuple[str, int, int]) -> bool:
        """Whether the bytes (device, first, end) overlap a training copy's memory (:func:`memory_span`'s form)."""
        if span[0] not in self._spans:
            return False
        starts, ends = self._spans[span[0]]
        at = bisect.bisect_right(starts, span[1]) - 1  # the last interval starting at or before the value
        return (at >= 0 and ends[at] > span[1]) or (at + 1 < len(starts) and starts[at + 1] < span[2])


_RELAYS = ("lightning_dp.models", "lightning_dp.losses", "lightning_dp.data", "lightning_dp.grad_sample",
           "lightning_dp.validators.record_reads")
"""lightning_dp's code on the user's own path, passed over: the models and losses it offers (a ``DigitsCNN``'s
forward), the engines' hooks around the layers' forwards, the watch wrapping the training dataset's item access."""


def library_call(*watchers: str) -> bool:
    """Whether the call comes from lightning_dp's own code (a fingerprint of the state in a callback of its own), past
    the frames of this module and of the ``watchers`` (the modules whose torch-function modes ask), torch's and the
    standard library's, and lightning_dp's relays (:data:`_RELAYS`)."""
    caller = first_caller(0, modules=(__name__, *watchers), packages=("torch",), standard=True,
                          also=lambda frame: (frame.f_globals.get("__name__") or "").startswith(_RELAYS))
    return caller is not None and package_of(caller) == "lightning_dp"


def pop_mode(mode: TorchFunctionMode) -> None:
    """Exit the torch-function ``mode`` when it is still the innermost one (else a mode pushed later stays)."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)


def function_name(func: Any) -> str:
    """A torch function's name; a property's (``Tensor.shape``) for its getter."""
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


def _merged(spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Byte intervals [start, end) merged into sorted disjoint ones: (their starts, their ends)."""
    starts: list[int] = []
    ends: list[int] = []
    for lo, hi in sorted(spans):
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def validation_read_error(hook: str, monitors: Sequence[tuple[str, str]]) -> PrivacyConfigurationError:
    """The refusal of a validation whose ``hook`` read the training records while ``monitors`` ((who, name)) steer
    training by what it logs (names, not values)."""
    lines = "\n".join(f"- {who} monitors {name!r}" for who, name in monitors)
    return PrivacyConfigurationError(
        f"{hook} read the training records during validation (the training dataset reached through the trainer, the "
        "datamodule, or a copy of it held by the model, a callback or a global), so what validation logs is an "
        "un-noised statistic of the private data, and it steers training:\n" + lines + "\nThe stopping step, the "
        "learning rate or the kept checkpoint chosen from it would leak the training data outside the guarantee. "
        "Evaluate on held-out data (the batch validation_step is handed, from records the fit does not train on), or, "
        "if you accept that validation's results leave unprotected like a logged metric, declare it: "
        "DPStrategy(public_state=['trainer.validate']) (docs/release_boundary.md, rule 10).")


def copies_after_fit(dataset: Any, module: Any, callbacks: Sequence[Any]) -> list[tuple[str, Any]]:
    """The copies in memory of a finished fit's training ``dataset`` an evaluation outside the fit may read (those the
    batch check exchanges: the dataset's, and those ``module``, the ``callbacks`` — the datamodule among them — and the
    user's globals keep)."""
    modules = user_modules([type(module)] + [type(cb) for cb in callbacks if not trusted_callback(cb)])
    holders = [("model", module), *((type(cb).__name__, cb) for cb in callbacks), *((m.__name__, m) for m in modules)]
    return training_copies(dataset, holders)


def evaluation_read_error(hook: str, stage: str, label: str) -> PrivacyConfigurationError:
    """The refusal of ``trainer.<stage>`` outside a fit whose ``hook`` read the training records of a private fit."""
    return PrivacyConfigurationError(
        f"trainer.{stage}(...) under {label}: {hook} read the training records of a private fit of this model (the "
        "training dataset reached through the trainer, the datamodule, or a copy of it held by the model, a callback "
        "or a global), so its losses, metrics and predictions are computed from the private data without noise, and "
        "whatever they decide next (a learning rate, example weights, the next fit) leaves the guarantee. Evaluate on "
        "held-out data (the batch the hook is handed, from records the fit did not train on), or, if you accept that "
        f"the result leaves unprotected like a logged metric, declare it: {label}(public_state=['trainer.{stage}']) "
        "(docs/release_boundary.md, rule 10).")
