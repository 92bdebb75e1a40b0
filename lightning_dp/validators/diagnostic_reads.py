"""The opt-in non-private diagnostics are a report, like a logged value: a step may not read them, a replay moves them.

:attr:`DPStrategy.non_private_diagnostics` (``private_step.diagnostics``, a
:class:`~lightning_dp.diagnostics.StepDiagnostics`) holds per-example gradient norms, the clip fraction and the clean
clipped mean of the last step: un-noised statistics of the private batch. Logged or printed they are a report, outside
the guarantee and said so; fed back into training (a learning rate or C set from them, a loss scaled by them, a
checkpoint entry written from them) they steer later releases without noise. Like the values logged from the
training data (:mod:`.logged_reads`), while a private fit trains:

* inside a step (:data:`~.logged_reads.STEP_HOOKS`: ``training_step``, ``on_before_optimizer_step``, …) a read of
  their data (``norms``, ``clip_fraction``, ``clean_mean``, ``batch_size``, and what is computed from them) by the
  user's code (not a library's: lightning_dp's own callbacks read them) is refused at once (:func:`watch`, at the
  class level, as :mod:`.metric_values` watches torchmetrics), and again before the release if a handler swallowed
  the refusal (:func:`check`);
* wherever the library runs the user's hooks again on other data — the training data's copies exchanged
  (:meth:`~.step_checks.StepChecks.exchanged_training_data`: the epoch and validation windows of :mod:`.decisions`,
  the checkpoint replays, the end of the fit, the first step's epoch hooks), a batch's loss moved far or its values
  exchanged (the batch-end windows, the first step's batch hooks) — the diagnostics read as other values
  (:func:`moved`: every norm far above C, or far below it, the clean mean scaled likewise) for the whole run, and as
  they were after it. A learning rate, C, a stop or a checkpoint entry set from them is then set apart by the other
  run and refused, as one set from the data; a callback that only logs or prints them sets nothing apart and trains.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

from lightning_dp.diagnostics import StepDiagnostics
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.call_sites import first_caller, package_of

__all__ = ["DATA_FIELDS", "check", "moved", "moved_diagnostics", "paused", "unwatch", "watch"]

DATA_FIELDS = frozenset({"norms", "clip_fraction", "clean_mean", "batch_size"})
"""The fields of :class:`StepDiagnostics` computed from the batch (``max_grad_norm`` is C, the mechanism's)."""

_LIBRARIES = frozenset({"torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities",
                        "lightning_dp", "torchmetrics", "tensorboardX", "tensorboard", "tqdm", "rich", "wandb",
                        "mlflow", "neptune", "comet_ml", "numpy", "pandas"})
_THIS = __name__
_INSIDE: list[Callable[[], Optional[str]]] = []  # the current step hook (None outside one), while watched
_PAUSED: list[bool] = [False]
_REFUSED: list[Exception] = []  # a refusal the user's code may have swallowed: raised again before the release
_saved: list[Any] = []  # StepDiagnostics' own __getattribute__ (or None) while watched


def moved_diagnostics(diagnostics: Optional[StepDiagnostics], up: bool) -> Optional[StepDiagnostics]:
    """``diagnostics`` moved far: ``up``, every norm 1000·(|n| + max(C, 1)) (all clipped) and the clean mean
    1000·(m + 1); else every norm and the clean mean scaled to a thousandth of C or less (none clipped). The clip
    fraction follows (1 or 0); C and the batch size are kept. ``None`` stays ``None`` (none computed yet)."""
    if diagnostics is None:
        return None
    c = float(object.__getattribute__(diagnostics, "max_grad_norm"))
    norms = object.__getattribute__(diagnostics, "norms").detach()
    clean = object.__getattribute__(diagnostics, "clean_mean")
    if up:
        norms = 1000.0 * (norms.abs() + max(c, 1.0))
        clean = {p: 1000.0 * (m + 1.0) for p, m in clean.items()}
    else:
        scale = 1e-3 * c / (1.0 + float(norms.abs().max())) if norms.numel() else 1e-3
        norms = norms * scale
        clean = {p: m * 1e-3 for p, m in clean.items()}
    fraction = float((norms > c).float().mean()) if norms.numel() else float("nan")
    return replace(diagnostics, norms=norms, clean_mean=clean, clip_fraction=fraction)


@contextmanager
def moved(holder: Any, up: bool) -> Iterator[None]:
    """Inside, ``holder.diagnostics`` (the private step's, which the strategy's property reads) is
    :func:`moved_diagnostics`; as it was on exit, whatever happens in between."""
    if holder is None or getattr(holder, "diagnostics", None) is None:
        yield
        return
    before = holder.diagnostics
    holder.diagnostics = moved_diagnostics(before, up)
    try:
        yield
    finally:
        holder.diagnostics = before


def _users_caller() -> bool:
    """Whether the first caller outside this module, lightning_dp.diagnostics and the standard library is the user's
    code (not a library's)."""
    frame = first_caller(2, modules=(_THIS, "lightning_dp.diagnostics"), standard=True)
    return frame is not None and package_of(frame) not in _LIBRARIES


def read_error(field: str, hook: str) -> PrivacyConfigurationError:
    """The refusal of the diagnostics read by the user's code inside a step."""
    return PrivacyConfigurationError(
        f"The non-private diagnostics (StepDiagnostics.{field}) were read in {hook}, inside a step: they are "
        "un-noised statistics of the last private batch (per-example gradient norms, the clip fraction, the clean "
        "mean), and read here they steer this step's release or update (a loss scaled by them, a learning rate or C "
        "set from them), outside the guarantee. Nothing more was released. Read them outside a step to log or print "
        "them (on_train_batch_end, where they describe the step just taken); steer training by the step count, by "
        "held-out metrics or by a DP mechanism (AdaptiveClipping) (docs/release_boundary.md).")


def watch(inside: Callable[[], Optional[str]]) -> None:
    """From now on a read of a :class:`StepDiagnostics`' data by the user's code while ``inside()`` names a step hook
    is refused (module docstring); :func:`unwatch` puts the class back."""
    _INSIDE[:] = [inside]
    _REFUSED.clear()
    if _saved:
        return
    own = vars(StepDiagnostics).get("__getattribute__")
    base = own if own is not None else object.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if name in DATA_FIELDS and _INSIDE and not _PAUSED[0]:
            hook = _INSIDE[0]()
            if hook is not None and _users_caller():
                error = read_error(name, hook)
                _REFUSED.append(error)
                raise error
        return base(self, name)

    _saved.append(own)
    StepDiagnostics.__getattribute__ = __getattribute__  # type: ignore[method-assign]


def unwatch() -> None:
    """The diagnostics read as they did (the fit is over)."""
    _INSIDE.clear()
    _REFUSED.clear()
    if not _saved:
        return
    own = _saved.pop()
    if own is None:
        del StepDiagnostics.__getattribute__
    else:
        StepDiagnostics.__getattribute__ = own  # type: ignore[method-assign]


def check() -> None:
    """Before a release: a read refused inside the step whose refusal the user's code caught is refused again."""
    if _REFUSED:
        error = _REFUSED[0]
        _REFUSED.clear()
        raise error


@contextmanager
def paused() -> Iterator[None]:
    """Reads inside are not watched: the library's replays of the user's hooks (the first step's batch-end hooks run
    inside ``training_step``); what they set from the diagnostics is the replays' to judge, on moved ones."""
    before, _PAUSED[0] = _PAUSED[0], True
    try:
        yield
    finally:
        _PAUSED[0] = before
