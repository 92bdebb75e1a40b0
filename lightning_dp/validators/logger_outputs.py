"""Media and distributions written to a logger by the training hooks are the training records: refused.

``self.logger.experiment.add_images("train/batch", x)`` in ``training_step`` writes the private batch itself into
the event file, without noise; so do a histogram of per-example losses, an embedding of the batch's features, its
texts or audio, a figure drawn from it, a precision-recall curve of its predictions. While a private fit trains
(installed by the strategy when it attaches the mechanism, before any ``on_train_start`` — a grid of training images
logged at train start is refused too —, removed when the fit ends: :func:`watch`, :func:`unwatch`), the methods
that publish such things (:data:`MEDIA`) of every logger in ``trainer.loggers`` and of its ``experiment`` — by name,
at the class level, so a ``SummaryWriter`` the user made is watched too, and any logger whose experiment has those
names (wandb, MLflow, Comet: duck typing) — refuse a call made in a hook of the training loop
(:data:`TRAINING_HOOKS`, while ``trainer.training``) with a :class:`~lightning_dp.errors.PrivacyConfigurationError`
naming the method and the fix, before anything is written. A generic ``log(dict)`` (wandb's ``run.log``) is refused
when a value is not a scalar (an image, a table, a histogram's tensor).

Not refused:

* calls outside the training hooks (``validation_step``, ``on_validation_epoch_end``, test, predict, the sanity
  check: held-out data), and calls made by lightning_dp's own code (``SecondMomentMonitor`` writes histograms of the
  released, noised second moment v̂, and of the opt-in non-private diagnostics: a report, rule 10);
* a call whose array arguments are all released state, equal to a parameter of the model, its ``.grad`` (ĝ) or an
  optimizer's state: post-processing (the weights' histogram each epoch, first-layer filters as images);
* in the hooks handed no batch (:data:`~.logger_judge.JUDGED`), a call the hook run again on the exchanged data
  reproduces: held back (:class:`Calls`) until :mod:`.logger_judge` judges it;
* ``add_graph`` (the model's structure and the input's shapes, no values), ``add_hparams``, ``add_custom_scalars``;
* scalars (``add_scalar``, ``add_scalars``, a logger's ``log_metrics`` called directly): a statistic of the batch,
  a report as ``self.log``'s values are (rule 10 of docs/release_boundary.md: outside the guarantee, not read back).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import pickle
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.call_sites import first_caller, package_of
from lightning_dp.records.library_objects import library_callback
from lightning_dp.validators.hook_replays import replaying_now, users_hook
from lightning_dp.validators.logged_reads import STEP_HOOKS

__all__ = ["MEDIA", "TRAINING_HOOKS", "Calls", "digest", "recorded", "recording", "refused_now", "unwatch", "watch",
           "watch_fit", "watching"]

MEDIA = frozenset({
    # TensorBoard's SummaryWriter (torch.utils.tensorboard, tensorboardX)
    "add_image", "add_images", "add_image_with_boxes", "add_figure", "add_video", "add_audio", "add_text",
    "add_embedding", "add_histogram", "add_histogram_raw", "add_mesh", "add_pr_curve", "add_pr_curve_raw",
    "add_tensor",
    # wandb's WandbLogger, MLflow's client, Comet's experiment and the like
    "log_image", "log_images", "log_figure", "log_video", "log_audio", "log_text", "log_table", "log_histogram_3d",
    "log_embedding", "log_curve", "log_confusion_matrix", "log_dict", "log_artifact", "log_artifacts", "log_asset"})
"""The methods that publish media, texts or distributions (per-example values), by name."""

GENERIC = "log"
"""wandb's ``run.log({...})``: refused when a value is not a scalar."""

TRAINING_HOOKS = STEP_HOOKS | {"on_train_start", "on_train_batch_end", "on_train_epoch_start", "on_train_epoch_end",
                               "on_train_end"}
"""The hooks of the training loop (the module's and the callbacks', as ``_current_fx_name`` names them) in which the
methods refuse, while the trainer trains (not during validation)."""

_INSIDE: list[Callable[[], Optional[str]]] = []  # the current training hook (None elsewhere), while watched
_RELEASED: list[Callable[[], Iterable[torch.Tensor]]] = []  # the released state, while watched
_PUBLIC: list[Callable[[str], bool]] = []  # whether the user declared "logger.<method>" public, while watched
_SAVED: list[tuple[type, str, Any]] = []  # (class, name, its own attribute or _ABSENT) while watched
_SHARED: list[Callable[[], bool]] = []  # whether the fit runs on several processes, while watched
_PENDING: list[PrivacyConfigurationError] = []  # this rank's refusal, kept until every rank raises it
_ABSENT = object()


def watch_fit(trainer: Any, public: Callable[[str], bool] = lambda name: False) -> None:
    """:func:`watch` the loggers of ``trainer``'s fit: refused in its training hooks while it trains, the released
    state its module's parameters, their gradients and its optimizers' state; ``public("logger.<method>")`` true
    (``DPStrategy(public_state=["logger.add_histogram"])``) lets that method write."""
    module = trainer.lightning_module
    watch(trainer.loggers, lambda: module._current_fx_name if trainer.training else None,
          lambda: released_state(module, lambda: trainer.optimizers), public,
          lambda: getattr(getattr(trainer.strategy, "private_step", None), "distribution", None) is not None
          and trainer.strategy.private_step.distribution.all_reduce is not None)


def watch(loggers: Iterable[Any], inside: Callable[[], Optional[str]],
          released: Callable[[], Iterable[torch.Tensor]] = lambda: (),
          public: Callable[[str], bool] = lambda name: False, shared: Callable[[], bool] = lambda: False) -> None:
    """From now on the :data:`MEDIA` methods (and ``log``) of each logger's class and of its experiment's class refuse
    a call by the user's code while ``inside()`` names a training hook, unless every array argument equals one of
    ``released()`` (the model's parameters, their gradients, the optimizers' state) or the user declared the method
    public (``public("logger.add_histogram")``: what it writes is computed from the released model only — the epoch's
    weight change, samples from a generative model's prior, norms of the released update). When ``shared()`` (several
    processes), a refusal is not raised where it is made — a rank-0-only call would stop rank 0 alone and leave the
    other ranks waiting in the next collective — but kept (:func:`refused_now`): nothing of it, nor of any later call,
    is written, and every rank raises at the next check they share (``StepChecks.on_every_rank``)."""
    unwatch()
    _PENDING.clear()
    _INSIDE.append(inside)
    _RELEASED.append(released)
    _PUBLIC.append(public)
    _SHARED.append(shared)
    objects = []
    for logger in loggers:
        objects.append(logger)
        try:
            objects.append(logger.experiment)  # created now if not yet (Lightning's hyper-parameter log does so too)
        except Exception:  # noqa: BLE001  (an experiment that cannot start here is watched by no one)
            continue
    classes = {type(obj) for obj in objects}
    for module in ("torch.utils.tensorboard", "tensorboardX"):  # a writer the user made is the same door
        writer = getattr(sys.modules.get(module), "SummaryWriter", None)
        if isinstance(writer, type):
            classes.add(writer)
    for cls in classes:
        for name in (*MEDIA, GENERIC):
            _wrap(cls, name)


def watching() -> bool:
    """Whether some logger's methods are watched now."""
    return bool(_SAVED)


def put_back(saved: list[tuple[type, str, Any]]) -> None:
    """Empty ``saved`` ((class, name, its own attribute or :func:`own_attribute`'s absent mark), as noted before a
    wrapper replaced it), putting each class attribute back as it was, last first."""
    while saved:
        cls, name, own = saved.pop()
        if own is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


def wrap_users_hooks(trainer: Any, names: Iterable[str],
                     make: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> list[tuple[type, str, Any, Any]]:
    """Replace, for a fit, each of the user's hooks ``names`` of the module and of the callbacks that are not
    Lightning's or lightning_dp's by ``make(hook, name)`` — at the class level, once per class (a class's own
    function, not an inherited library one). Returns ``(class, name, own attribute, wrapper)`` for each, for
    :func:`put_back` (the logger judge's and the judged writes' watches)."""
    wrapped: list[tuple[type, str, Any, Any]] = []
    module = trainer.lightning_module
    for owner in (module, *(cb for cb in trainer.callbacks if not library_callback(cb))):
        cls = type(owner)
        for name in names:
            hook = getattr(cls, name, None)
            raw = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
            if users_hook(hook) and inspect.isfunction(raw) and not any(c is cls and n == name
                                                                         for c, n, _, _ in wrapped):
                wrapper = make(hook, name)
                wrapped.append((cls, name, own_attribute(cls, name), wrapper))
                setattr(cls, name, wrapper)
    return wrapped


def own_attribute(cls: type, name: str) -> Any:
    """``cls``'s own attribute ``name`` (not an inherited one), or a mark that it has none, for :func:`put_back`."""
    return vars(cls).get(name, _ABSENT)


def unwatch() -> None:
    """The loggers' methods are as they were (the fit is over)."""
    put_back(_SAVED)
    _INSIDE.clear()
    _RELEASED.clear()
    _PUBLIC.clear()
    _SHARED.clear()  # a refusal kept (_PENDING) is raised by the end of the fit's shared check


def refused_now() -> None:
    """Raise the refusal this rank kept (:func:`watch`'s ``shared``), once: called by the checks every rank runs
    together (``StepChecks.on_every_rank``), so that the other ranks raise with it."""
    if _PENDING:
        error = _PENDING.pop()
        _PENDING.clear()
        raise error


def _wrap(cls: type, name: str) -> None:
    fallback = getattr(cls, "__getattr__", None)  # Lightning's _DummyExperiment (ranks other than 0): every name
    raw = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), _ABSENT)
    if raw is _ABSENT and fallback is None or not (raw is _ABSENT or callable(raw)) or isinstance(raw, type):
        return
    if isinstance(raw, (staticmethod, classmethod)):
        return

    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        def write(*args: Any, **kwargs: Any) -> Any:
            return fallback(self, name)(*args, **kwargs) if raw is _ABSENT else raw(self, *args, **kwargs)
        return _writing(write, *args, **kwargs) if _check(self, name, args, kwargs, write) else None

    watched.__wrapped__ = raw  # type: ignore[attr-defined]
    own = own_attribute(cls, name)
    try:
        setattr(cls, name, watched)
    except (TypeError, AttributeError):  # a class that cannot be patched (a C type): not watched
        return
    _SAVED.append((cls, name, own))


def _check(obj: Any, name: str, args: tuple, kwargs: dict, write: Callable[..., Any]) -> bool:
    """Whether the call writes now; ``False``: held back by the judge of the hook (:mod:`.logger_judge`), recorded by
    its run again, or made by a replay of the checks (written by none); refused: raises."""
    if _WRITING:  # a call made by a writing one (add_figure's add_image): judged with it
        return True
    if _PENDING:  # a refusal kept on this rank until every rank raises it: nothing more is written
        return False
    calls = _CALLS[-1] if _CALLS else None
    if calls is not None and calls.again:  # the judge's run again: every call recorded, none written
        calls.add(name, "", digest([*args, *kwargs.values()]))
        return False
    if replaying_now():  # the checks' replays of the user's hooks leave no trace in the logs
        return False
    hook = _INSIDE[0]() if _INSIDE else None
    if hook not in TRAINING_HOOKS or _library_call() or (_PUBLIC and _PUBLIC[0](f"logger.{name}")):
        return _allowed(calls, name)
    hook = _calling_hook(hook)
    values = [*args, *kwargs.values()]
    method = f"{type(obj).__name__}.{name}"
    if name == GENERIC:
        bad = [str(k) for v in values if isinstance(v, dict) for k, x in v.items() if not _scalar(x)]
        if not bad:
            return _allowed(calls, name)
        method = f"{type(obj).__name__}.log (the entries {', '.join(repr(b) for b in bad)})"
    else:
        arrays = [v for v in values if isinstance(v, torch.Tensor) or type(v).__module__ == "numpy"
                  and hasattr(v, "shape")]
        if arrays and all(_released(a) for a in arrays) and len(arrays) == sum(_is_data(v) for v in values):
            return _allowed(calls, name)
    if calls is None or hook not in calls.judged:
        if not (_SHARED and _SHARED[0]()):
            raise output_error(method, hook)
        _PENDING.append(output_error(method, hook))  # raised on every rank together (watch)
        return False
    held = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]  # as they are now
    kept = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    calls.add(name, method, digest(values), lambda: _writing(write, *held, **kept), hook)
    return False


_WRITING: list[bool] = []  # a watched call writes now


def _writing(write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _WRITING.append(True)
    try:
        return write(*args, **kwargs)
    finally:
        _WRITING.pop()


def _drawn(figure: Any) -> Any:
    """A matplotlib figure's pixels, drawn as a writer draws it (None when it cannot be drawn)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        return torch.as_tensor(bytearray(canvas.buffer_rgba()), dtype=torch.uint8)
    except Exception:  # noqa: BLE001  (not drawn: judged as changed)
        return object()


def _allowed(calls: Optional["Calls"], name: str) -> bool:
    if calls is not None:  # its place among the hook's calls (the run again records it too)
        calls.add(name, "", None)
    return True


class Calls:
    """The logger calls of one run of a training hook, in order, while :mod:`.logger_judge` judges it: ``again``
    false, those refused by the rule above are held back (not written) when made in one of ``judged``, the others
    written and counted; ``again`` true (the hook run again on exchanged data), every call is recorded, none
    written."""

    def __init__(self, again: bool = False, judged: Iterable[str] = ()) -> None:
        self.again = again
        self.judged = frozenset(judged)
        self.entries: list[tuple[str, str, Any, Optional[Callable[[], Any]], str]] = []

    def add(self, name: str, method: str, value: Any, write: Optional[Callable[[], Any]] = None,
            hook: str = "") -> None:
        self.entries.append((name, method, value, write, hook))

    def held(self) -> list[tuple[int, str, Any, Callable[[], Any], str]]:
        """(position, method, digest, write, hook) of each call held back."""
        return [(i, method, value, write, hook) for i, (_, method, value, write, hook) in enumerate(self.entries)
                if write is not None]


_CALLS: list[Calls] = []  # the calls of the hook being judged, or of its run again (innermost last)


@contextmanager
def recorded(calls: Calls) -> Iterator[None]:
    """Inside, the watched methods' calls go to ``calls`` (held back, or recorded: :class:`Calls`)."""
    _CALLS.append(calls)
    try:
        yield
    finally:
        _CALLS.remove(calls)


def recording() -> bool:
    """Whether a hook's calls are being recorded now (a hook run inside a judged one: the outer judges)."""
    return bool(_CALLS)


def digest(values: Iterable[Any]) -> Any:
    """A comparable stand-in for the values a call writes: arrays by dtype, shape and bytes; numbers and strings as
    they are; dicts, lists and tuples walked; other objects (a figure, a wandb.Histogram) by their pickled bytes
    (one that does not pickle: a token equal to nothing)."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "shape"):
            try:
                array = torch.as_tensor(value).detach().cpu()
                array = array.double() if array.is_floating_point() else array
                out.append(("array", str(value.dtype), tuple(array.shape),
                            hashlib.sha256(array.numpy().tobytes()).hexdigest()))
            except Exception:  # noqa: BLE001  (sparse, complex, objects: judged as changed)
                out.append(object())
        elif isinstance(value, (str, bool, int, float, type(None))):
            out.append(value)
        elif isinstance(value, dict):
            out.append(("dict", tuple((str(k), digest([v])) for k, v in value.items())))
        elif isinstance(value, (list, tuple)):
            out.append(("list", digest(value)))
        elif callable(getattr(value, "savefig", None)):  # a matplotlib figure: as drawn (its number aside)
            out.append(("figure", digest([_drawn(value)])))
        else:
            try:
                buffer = io.BytesIO()
                _TensorsByContents(buffer).dump(value)
                out.append(("object", hashlib.sha256(buffer.getvalue()).hexdigest()))
            except Exception:  # noqa: BLE001  (not comparable: judged as changed)
                out.append(object())
    return tuple(out)


class _TensorsByContents(pickle.Pickler):
    """Pickles an object's tensors as their digests: a tensor's own pickle names its storage by its memory address,
    so a logger object holding a fresh tensor (a wandb-like Histogram or Image of the weights) would differ in each
    run of the same hook."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            token = digest([obj])[0]
            if not isinstance(token, tuple):
                raise pickle.PicklingError("a tensor without comparable contents")
            return token
        return None


def output_error(method: str, hook: str) -> PrivacyConfigurationError:
    """The refusal of ``method`` called in the training hook ``hook``."""
    short = method.split(" ")[0].rpartition(".")[2]  # "SummaryWriter.add_histogram" → "add_histogram"
    return PrivacyConfigurationError(
        f"{method} was called in {hook} while a private fit trains: what it writes to the logs (images, texts, audio, "
        "figures, histograms or embeddings of the batch, per-example values) is the training records or statistics "
        "of them, un-noised, outside the guarantee. Nothing was written. Log media of held-out data in "
        "validation_step or on_validation_epoch_end; log the model's parameters as they are (released state); log a "
        "scalar with self.log (a report), or a statistic you noised yourself, its ε accounted for. If what this call "
        "writes is computed from the released model only (the epoch's weight change, samples from the model's "
        f"prior), declare the method public: DPStrategy(public_state=['logger.{short}']).")


def _library_call() -> bool:
    """Whether the caller (outside this module and the standard library) is lightning_dp's own code."""
    frame = first_caller(2, modules=(__name__,), standard=True)
    return frame is not None and package_of(frame) == "lightning_dp"


def _calling_hook(current: str) -> str:
    """The training hook the call was made in: the nearest caller named as one (the library's replays call the
    batch-end hooks inside its step), else Lightning's current hook."""
    frame: Any = sys._getframe(3)
    while frame is not None:
        if frame.f_code.co_name in TRAINING_HOOKS:
            return frame.f_code.co_name
        frame = frame.f_back
    return current


def _scalar(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        return getattr(value, "size", None) == 1 or (isinstance(value, torch.Tensor) and value.numel() == 1)
    if isinstance(value, dict):
        return all(_scalar(v) for v in value.values())
    if isinstance(value, (list, tuple)):  # numbers (each group's learning rate): scalars reported as self.log's are
        return all(isinstance(v, (bool, int, float)) for v in value)
    return False


def _is_data(value: Any) -> bool:
    """Whether an argument carries values (not a tag, a step, a format flag)."""
    return not isinstance(value, (str, bool, int, float, type(None)))


def _released(array: Any) -> bool:
    """Whether ``array`` equals a released tensor (a parameter, its gradient, an optimizer's state) as a whole."""
    try:
        value = torch.as_tensor(array).detach()
    except Exception:  # noqa: BLE001  (not an array torch reads: not released state)
        return False
    if value.is_complex() or value.numel() == 0:
        return False
    flat = value.reshape(-1)
    for tensor in _RELEASED[0]() if _RELEASED else ():
        if tensor.numel() == flat.numel() and tensor.dtype.is_floating_point:
            if torch.equal(tensor.detach().reshape(-1).to(device=flat.device, dtype=flat.dtype), flat):
                return True
    return False


def released_state(module: torch.nn.Module, optimizers: Callable[[], Iterable[Any]]) -> list[torch.Tensor]:
    """The model's parameters, their gradients and the optimizers' tensor state: released (or post-processing)."""
    out = []
    for p in module.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for optimizer in optimizers():
        for state in getattr(optimizer, "state", {}).values():  # (under a key that is no parameter: any value)
            values = state.values() if isinstance(state, dict) else [state]
            out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out
