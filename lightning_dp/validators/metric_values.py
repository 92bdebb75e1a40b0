"""A torchmetrics ``Metric``'s value inside a step is a report: ``self.log`` may take it, the step may not use it.

A metric's states accumulate the training batches (``update`` in ``training_step`` or at batch end), without noise,
and they are not fingerprinted (they feed ``self.log``). Its value read back by a step — ``compute()``, or what its
``forward`` returns (the batch's accuracy), carried into the loss, a learning rate or a branch — steers the release by
the private data, outside the guarantee; and it does so wherever the metric lives: a submodule of the module, a plain
dict (``self.mets = {"train_acc": ...}``), a callback, the datamodule, a global. So, while a private fit trains, at
the class level (every ``Metric``, made before or during the fit), and restored when it ends:

* what ``compute()`` returns inside a step hook (:data:`~lightning_dp.validators.logged_reads.STEP_HOOKS`), to the
  user's code or to a library (``forward``'s batch value, a ``MetricCollection``, a wrapper), is a
  :class:`SealedMetric`: a tensor whose value the user's code may not read (``float()``, ``.item()``, arithmetic, a
  comparison) while a step hook runs. Lightning's ``self.log`` takes it (its operations are Lightning's, and give
  plain tensors), so ``acc = self.train_acc(preds, y); self.log("train_acc", acc)``,
  ``self.log("train_acc", self.train_acc)`` and ``self.log("running_loss", self.running_loss.compute())`` (torchmetrics'
  ``RunningMean``) train as before; ``loss * (2 - acc)`` and ``float(self.running_loss.compute())`` are refused
  (an earlier rule refused the user's ``compute()`` itself, though ``self.log`` was all it fed). Outside a step (the
  batch end, validation, after the fit) it is an ordinary tensor (what batch-end hooks decide from it is
  :mod:`.decisions`' to judge);
* a metric's states (``tp``, ``mean_value``, …, its cached ``_computed`` and ``_forward_cache``) read by the user's
  code inside a step hook are refused, as a read of its value is; its own ``update``, ``compute``, ``reset`` and
  ``merge_state`` (a custom metric's ``self.correct += …``, and the methods of its own they call) are its machinery;
* a metric updated while the trainer trains is the training data's (unless its name is declared public): in
  :func:`moved`, the contexts in which :mod:`.decisions` runs the hooks of a window again on other data, what its
  ``compute()`` returns to anyone, and its states read by the user's code, are moved far (``up``) or near zero
  (integer counts too), so that a stop, a rate, a change of what trains or a buffer set from it at an epoch's end
  is set apart and refused, as one set from a logged value is (rule 10 of docs/release_boundary.md).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lightning_dp.records.call_sites import first_caller, package_of

__all__ = ["SealedMetric", "moved", "unwatch", "watch"]

_INSIDE: Callable[[], Optional[str]] = lambda: None  # noqa: E731  (the current step hook, or None; set by :func:`watch`)
_REFUSE: Callable[[str, str], Exception] = lambda read, hook: RuntimeError(read)  # noqa: E731
_NAME: Callable[[Any], str] = lambda metric: type(metric).__name__  # noqa: E731  (a metric's name in the errors)
_LIBRARIES = frozenset({"torch", "torchmetrics", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_dp",
                        "lightning_utilities"})
_CACHES = frozenset({"_computed", "_forward_cache"})
_PASSED_ON = frozenset({"detach", "clone", "size", "dim", "numel", "is_floating_point", "__get__", "requires_grad_",
                        "to", "cpu", "cuda", "__hash__"})
_THIS = __name__
_saved: Optional[tuple[Any, Any]] = None  # (Metric, its own __getattribute__ if it had one)
_MACHINERY = frozenset({"update", "compute", "reset", "merge_state"})
_TRAINING: Callable[[Any], bool] = lambda metric: False  # noqa: E731  (whether an update now is the training data's)
_TRAINED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # by id: Metric hashes its states
_MOVE: list[Optional[bool]] = [None]  # inside :func:`moved`: up (far) or down (near zero)


def _users_caller(depth: int, metric: Any = None) -> bool:
    """Whether the first caller (``depth`` frames up) outside torch and the standard library is the user's code;
    given ``metric``, not when that code is ``metric``'s own machinery (one of its methods, called by its ``update``,
    ``compute``, ``reset`` or ``merge_state``)."""
    def helper(frame: Any) -> bool:  # one of the metric's own methods called by its machinery: passed over
        return frame.f_locals.get("self") is metric and frame.f_code.co_name not in _MACHINERY \
            and package_of(frame) not in _LIBRARIES

    frame = first_caller(depth, modules=(_THIS,), packages=("torch",), standard=True,
                         also=None if metric is None else helper)
    return frame is not None and package_of(frame) not in _LIBRARIES and (
        metric is None or frame.f_locals.get("self") is not metric)


def _move(value: Any, up: bool) -> Any:
    """``value`` moved far (``up``: 1000·(v + 1)) or near zero (v / 1000; integer counts floor-divided), tensors and
    numbers in dicts, lists and tuples."""
    if isinstance(value, Tensor) and value.dtype != torch.bool and not value.is_complex():
        with torch._C.DisableTorchFunctionSubclass():
            plain = value.detach()
            if up:
                return (plain + 1) * 1000
            return plain * 1e-3 if value.is_floating_point() else torch.div(plain, 1000, rounding_mode="floor")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (value + 1) * 1000 if up else (value * 1e-3 if isinstance(value, float) else value // 1000)
    if isinstance(value, dict):
        return {k: _move(v, up) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_move(v, up) for v in value)
    return value


@contextmanager
def moved(up: bool) -> Iterator[None]:
    """Inside, the metrics updated while the trainer trained read moved (module docstring): what their ``compute()``
    returns and their states read by the user's code."""
    before, _MOVE[0] = _MOVE[0], up
    try:
        yield
    finally:
        _MOVE[0] = before


class SealedMetric(Tensor):
    """A metric's value computed inside a step: unreadable by the user's code while a step hook runs."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", str(func))
        hook = _INSIDE()
        if hook is None or not _users_caller(2):
            with torch._C.DisableTorchFunctionSubclass():  # a library's operation (self.log): a plain tensor
                return func(*args, **(kwargs or {}))
        if name not in _PASSED_ON:
            named = [a._dp_read for a in _flat(args, kwargs) if isinstance(a, SealedMetric) and "_dp_read" in vars(a)]
            raise _REFUSE(named[0] if named else f"a torchmetrics metric's value ({name})", hook)
        return super().__torch_function__(func, types, args, kwargs or {})


def _flat(args: tuple, kwargs: Optional[dict]) -> list:
    """The arguments of a torch call, one level of lists and tuples opened (``torch.stack([a, b])``)."""
    out: list = []
    for a in (*args, *(kwargs or {}).values()):
        out.extend(a if type(a) in (list, tuple) else (a,))
    return out


def _sealed(value: Any, read: Optional[str] = None) -> Any:
    """``value`` (a tensor, or a dict/list/tuple of them) sealed; ``read``: how the user's code obtained it
    (``running.compute()``), named when it is read."""
    if isinstance(value, Tensor) and not isinstance(value, SealedMetric):
        with torch._C.DisableTorchFunctionSubclass():
            sealed = value.as_subclass(SealedMetric)
        if read is not None:
            sealed._dp_read = read
        return sealed
    if isinstance(value, dict):
        return {k: _sealed(v, read) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_sealed(v, read) for v in value) if type(value) in (list, tuple) else value
    return value


def watch(inside: Callable[[], Optional[str]], refuse: Callable[[str, str], Exception],
          name: Callable[[Any], str] = lambda metric: type(metric).__name__,
          training: Callable[[Any], bool] = lambda metric: False) -> None:
    """From now on every torchmetrics ``Metric`` is watched (module docstring). ``inside``: the current step hook
    (``None`` outside one); ``refuse(read, hook)``: the error for a read by the user's code; ``name``: a metric's
    name in it; ``training(metric)``: whether its update now is from the training data (moved in :func:`moved`)."""
    global _INSIDE, _REFUSE, _NAME, _TRAINING, _saved
    try:
        from torchmetrics import Metric
    except ImportError:  # no torchmetrics, no metrics
        return
    _INSIDE, _REFUSE, _NAME, _TRAINING = inside, refuse, name, training
    _TRAINED.clear()
    if _saved is not None:
        return
    own = vars(Metric).get("__getattribute__")
    base = own if own is not None else object.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        value = base(self, name)
        if name == "compute":
            hook = _INSIDE()
            if hook is not None:
                return _guarded(self, value, hook)
            if _MOVE[0] is not None and id(self) in _TRAINED:
                return _moved_compute(value, _MOVE[0])
        elif name == "update":
            if id(self) not in _TRAINED and _TRAINING(self):
                _TRAINED[id(self)] = self
        elif name in _CACHES or name in base(self, "__dict__").get("_defaults", ()):
            if _INSIDE() is not None and _users_caller(2, self):
                raise _REFUSE(f"{_NAME(self)}.{name}", str(_INSIDE()))
            if _MOVE[0] is not None and id(self) in _TRAINED and _users_caller(2, self):
                return _move(value, _MOVE[0])
        return value

    _saved = (Metric, own)
    Metric.__getattribute__ = __getattribute__  # type: ignore[method-assign]


def _guarded(metric: Any, compute: Any, hook: str) -> Any:
    def compute_watched(*args: Any, **kwargs: Any) -> Any:  # whoever calls it: its value unreadable, self.log takes it
        return _sealed(compute(*args, **kwargs), f"{_NAME(metric)}.compute()" if _users_caller(2) else None)
    compute_watched.__wrapped__ = compute  # type: ignore[attr-defined]
    return compute_watched


def _moved_compute(compute: Any, up: bool) -> Any:
    def compute_moved(*args: Any, **kwargs: Any) -> Any:
        return _move(compute(*args, **kwargs), up)
    compute_moved.__wrapped__ = compute  # type: ignore[attr-defined]
    return compute_moved


def unwatch() -> None:
    """The metrics are as they were (the fit is over); the fit's callbacks let go (they hold its module, and through
    its trainer the training data: kept by this module's globals, the data outlived the fit)."""
    global _INSIDE, _TRAINING, _REFUSE, _NAME, _saved
    _INSIDE, _TRAINING = lambda: None, lambda metric: False  # noqa: E731
    _REFUSE, _NAME = (lambda read, hook: RuntimeError(read)), (lambda metric: type(metric).__name__)  # noqa: E731
    _TRAINED.clear()
    if _saved is None:
        return
    metric, own = _saved
    if own is None:
        del metric.__getattribute__
    else:
        metric.__getattribute__ = own
    _saved = None
