"""Statistics of the training data written into the user's state during a private fit, whatever path they came by.

Rule 11 of docs/release_boundary.md compares, once before the first release, what the model and the datamodule hold
with the statistics of the training data (:func:`~.data_statistics.data_statistics_held`). The replays judge what the
hooks write later (:mod:`~lightning_dp.validators.judged_writes`, the decision windows, :mod:`~.end_of_fit`) by
running them again on the training data's copies exchanged: a value that reaches the hook by a path no exchange moves
— a file the script saved before the fit (``torch.save(x_train.mean(0), path)``, ``np.save``, ``json.dump``, a
pickle) read back in ``on_after_backward``, a global computed before the fit, a ``functools.lru_cache``'d function of
the data, an environment variable, another object the walks miss — is written alike in every run again and is taken
for a function of the released state (zoo32 j01).

:class:`WrittenStatistics` closes that class by looking at the value, not the path: the statistics rule 11 computed
(:class:`~.training_statistics.TrainingStatistics`: per feature width, once, kept for the fit) are compared with every
value of the user's state that changed since it was last compared, at the points before which such state is
released or steers a release:

* **before every release** (:meth:`~lightning_dp.privacy.private_step.PrivateStep.release`): the module's buffers
  and attributes, the datamodule's and the callbacks' (not Lightning's or lightning_dp's) attributes — a buffer the
  forward reads steers the next step's release, and each later one —, and the parameters a hook wrote since the last
  update (their version counters moved after the optimizer's step: a write at a batch's end, in an epoch hook);
* **as validation starts** (its logged values are released);
* **before every checkpoint and at the fit's end** (``on_train_end``, and after ``on_fit_end``/``teardown``:
  :meth:`~lightning_dp.validators.end_of_fit.EndOfFit.judge`): the same, and the optimizers' state (their
  per-parameter state and the parameter groups' values), saved in the checkpoint;

so a write at step 5 only, in ``on_train_epoch_end`` or in a callback's hook, is refused before anything holding it
leaves: the refusal names the holder and the statistic, and a tensor written in place is put back to the value last
compared (the module handed back holds no statistic). After the fit's last check (after the user's ``teardown``), or
when the fit fails, the watch and its statistics — which hold the training tensors and copies of them (sorted, their
principal directions) — are let go (:meth:`~lightning_dp.validators.step_checks.StepChecks.forget_written_statistics`):
a strategy kept after ``fit`` does not keep them alive until its next fit.

Cost: a value is compared only when it changed since it was last compared: a tensor by identity, version counter and
storage (no read of its values), a NumPy array of up to :data:`COPIED` elements and a list of numbers by their values
(larger arrays by identity and storage only), a float by its value; a layer whose attributes are all the very
immutable objects they were when last compared (numbers, strings, tuples of them: a torch layer's configuration) is
not walked again until one is replaced (identity, not equality) or a full check (:meth:`WrittenStatistics._is_settled`:
the walk at a release of a 48-layer model went from 2.4 to 0.7 ms, of the digits CNN from 0.33 to 0.11 ms). A tensor
whose version moved with its values unchanged (a state put back after a replay) is compared with its last copy only. At
a release a changed value is compared with the exact statistics of each training tensor (means, deviations, variances,
class frequencies: those of its size only), and with every statistic (order statistics, second moments,
class-conditional ones, principal directions: seconds for a [1000, 1000] tensor) on its first change in the fit and at
validation's start, a checkpoint and the fit's end. Measured on a 1M-parameter MLP (1000 features, one CPU core): with
nothing written a check is a walk of the state, 0.08 ms a step; an EMA of its [1000, 1000] weight changing at every step
adds under 3 ms a step (the EMA's own update included), and its full comparisons about 8 s at its first change and at
the fit's end, what rule 11's check pays for that weight before the first release.

A 2-D value is also compared row by row and column by column
(:meth:`~.training_statistics.TrainingStatistics.slices_held`): a training mean written into one row of a memory bank or
an embedding's weight, or one column of a buffer; only the rows and columns written since its last compared copy, and
a value without one (over :data:`COPIED` elements) in all its rows and columns at the full checks only (its first
change, validation's start, a checkpoint, the fit's end: about 5 ms for a [1000, 1000] one). A parameter written
through ``.data`` moves no version counter: those a judged hook's accepted write names are compared at the next check
(:meth:`WrittenStatistics.note_written`).

What it does not see: a slice of a tensor of three or more dimensions, or part of a row; a parameter written through
``.data`` by a hook that is not judged by :mod:`~lightning_dp.validators.judged_writes` (an epoch's end); a statistic
transformed (rounded, scaled, mixed with public constants: as rule 11), a single number off a single-number statistic
by more than float precision (a held-out loss kept on the module comes within 1e-4 of a class fraction by chance:
:func:`~.training_statistics._lone_tolerance`), a value
written and overwritten between two checks (it never reaches a release), a statistic other than an exact one (a
quantile, a whitening matrix) written into a value after its first change (found at the next full check, after the
releases it steered), the optimizers' state between two
checkpoints (read by the update: a statistic written there moves the weights only mixed with ĝ; the replays of
:mod:`~lightning_dp.validators.judged_writes` judge its writes), the in-place write into a NumPy array of more than
:data:`COPIED` elements, state held elsewhere than the module, the datamodule and the callbacks (a global of your
code, a logger), and a callback's own state written before the first release (``on_train_start``; the module's is
compared by rule 11's check there). Names declared public (``public_state``) are skipped, as DP releases a charged
ledger counts are (:mod:`.released_statistics`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_statistics.data_statistics import held_candidates
from lightning_dp.record_statistics.training_statistics import TrainingStatistics
from lightning_dp.records.library_objects import framework_keys

__all__ = ["COPIED", "WrittenStatistics", "written_statistics_error"]

COPIED = 1 << 16
"""Values up to this many elements are copied when compared (put back when a later write is refused; a NumPy array's
in-place write found by its values); larger ones are compared by identity and version (tensors) or storage."""

Owners = Callable[[], Sequence[tuple[str, Any]]]


class WrittenStatistics:
    """What the user's state holds that equals a statistic of the training data, checked where it changes
    (module docstring).

    Args:
        statistics: rule 11's statistics of the training data (kept from its check).
        owners: (label, object) of the state to watch: the module (label ``"model"``), the datamodule, the callbacks
            (labelled by their class's name, as ``public_state`` names them).
        module: the module whose parameters are watched after each update.
        optimizers: the optimizers whose state is compared before a checkpoint and at the fit's end.
        clean: (label, object) of owners rule 11 compared just now: their values are taken as compared.
    """

    def __init__(self, statistics: TrainingStatistics, owners: Owners, module: nn.Module,
                 optimizers: Callable[[], Sequence[Any]] = tuple, clean: Sequence[tuple[str, Any]] = ()) -> None:
        self.statistics, self.owners, self.module, self.optimizers = statistics, owners, module, optimizers
        self._seen: dict[str, tuple[Any, Any]] = {}  # path → (token, copy) as last compared
        self._full: dict[str, Any] = {}  # path → token as last compared with every statistic
        self._once: set[str] = set()  # paths compared since the fit started (later changes: the exact statistics)
        self._updated: Optional[dict[str, tuple[Tensor, int]]] = None  # parameter name → (p, version) after update
        self._written: set[str] = set()  # parameters a judged hook wrote (note_written): compared at the next check
        self.compared = 0  # values compared with the statistics (a test's and a benchmark's count)
        self._settled: dict[int, tuple[nn.Module, tuple[tuple[str, Any], ...]]] = {}  # id → (module, its atoms)
        self._walked: list[nn.Module] = []  # submodules whose attributes the last walk yielded
        for path, value in held_candidates(clean, parameters=False):
            token = _token(value)
            if token is not None:
                self._seen[path] = (token, _copy(value))
                self._full[path] = token

    def note_written(self, names: Sequence[str]) -> None:
        """A judged hook's write was accepted (``names``: the kept state's entries, ``parameter emb.weight``): the
        parameters among them are compared at the next check, whatever their version counters say (a write through
        ``.data`` moves none)."""
        self._written.update(n.removeprefix("contents of ").removeprefix("parameter ") for n in names
                             if n.removeprefix("contents of ").startswith("parameter "))

    def note_update(self) -> None:
        """The optimizer applied a release: the parameters' version counters now (a later move is a hook's write)."""
        self._updated = {name: (p, p._version) for name, p in self.module.named_parameters()}

    def check(self, where: str, optimizers: bool = False, full: bool = False) -> None:
        """Refuse a value changed since it was last compared that equals a statistic of the training data, putting
        back the tensors written in place; ``where``: the point (``"before the release of step 3"``); ``optimizers``:
        the optimizers' state too (before a checkpoint, at the fit's end); ``full``: every statistic (validation's
        start, a checkpoint, the fit's end), else the exact ones of each tensor, all of them only for a value's first
        change (:meth:`~.training_statistics.TrainingStatistics.held_by`: a [1000, 1000] EMA of the weights costs
        seconds in full, microseconds otherwise)."""
        found: list[str] = []
        written: list[tuple[Any, Any]] = []
        for path, value in self._changed(optimizers, full):
            token = _token(value)
            if token is None:
                continue
            last = self._seen.get(path)
            if last is not None and isinstance(value, Tensor) and last[1] is not None and _same(value, last[1]):
                if self._full.get(path) == last[0]:  # version moved, values as compared (a state put back)
                    self._full[path] = token
                self._seen[path] = (token, last[1])
                if not full or self._full.get(path) == token:
                    continue
            self.compared += 1
            whole = full or path not in self._once  # (a value's first change in the fit: compared in full)
            self._once.add(path)
            held = self.statistics.held_by(path, value, whole, approximate=False)
            rows, columns = _written_slices(value, last)
            if not held and (rows is not None or whole):  # one row of a larger one (without a copy: at full checks)
                held = self.statistics.slices_held(path, value, rows, columns)
            if held:
                found.extend(held)
                if last is not None and last[1] is not None:
                    written.append((value, last[1]))
                continue
            self._seen[path] = (token, _copy(value))
            if whole:
                self._full[path] = token
        if found:
            raise written_statistics_error(found, where, _put_back(written))
        self._settle(full)
        if self._updated is not None:
            self._updated = {name: (p, p._version) for name, (p, _) in self._updated.items()}

    def _changed(self, optimizers: bool, full: bool) -> Iterator[tuple[str, Any]]:
        """(path, value) of the values whose token differs from the last compared one (``full``: in full)."""
        self._walked = []
        for path, value in held_candidates(self.owners(), parameters=False, settled=None if full else self._is_settled):
            if self._moved(path, value, full):
                yield path, value
        written, self._written = self._written, set()
        for name, (p, version) in (self._updated or {}).items():
            if p._version != version or name in written:
                yield f"parameter {name}", p
        for i, optimizer in enumerate(self.optimizers() if optimizers else ()):
            for path, value in _optimizer_values(i, optimizer):
                if self._moved(path, value, full):
                    yield path, value

    def _is_settled(self, m: nn.Module) -> bool:
        """Whether ``m``'s attributes are the very immutable values (numbers, strings, tuples of them) they were at
        the end of the last check that compared them: then none of their paths' tokens moved (a torch layer's
        ``kernel_size``, ``in_features``), and walking them again would compare nothing. Anything else (a list, a
        tensor, an object, a value replaced by an equal one) is walked. Not at full checks."""
        held = self._settled.get(id(m))
        if held is not None and held[0] is m and _same_atoms(held[1], _atoms(m)):
            return True
        self._walked.append(m)
        return False

    def _settle(self, full: bool) -> None:
        """After a check that refused nothing: the walked modules holding only immutable values are settled."""
        if full:
            self._settled.clear()  # (full checks walk everything: the next check notes them again)
        for m in self._walked if not full else ():
            atoms = _atoms(m)
            if atoms is not None:
                self._settled[id(m)] = (m, atoms)
        self._walked = []

    def _moved(self, path: str, value: Any, full: bool) -> bool:
        token = _token(value)
        if token is None:  # not a value compared (check() would pass it by)
            return False
        last = (self._full.get(path),) if full else self._seen.get(path)
        return last is None or last[0] is None or token != last[0]


_ATOMS = (int, float, str, bytes, bool, type(None))


def _atoms(m: nn.Module) -> Optional[tuple[tuple[str, Any], ...]]:
    """``m``'s own attributes (torch's and Lightning's book-keeping left out) when every one is of an immutable
    built-in kind — a number, a string, ``None``, a tuple of such (exact types: a subclass may hold state) — or a
    value the walk neither compares nor enters (no token, no ``__dict__``, not a container: an engine's
    ``ReplacedForward``), else ``None``."""
    skip = framework_keys()
    items = tuple((k, v) for k, v in vars(m).items() if k not in skip)
    for _, v in items:
        if type(v) not in _ATOMS and not (type(v) is tuple and all(type(x) in _ATOMS for x in v)) \
                and (isinstance(v, (list, tuple, dict)) or hasattr(v, "__dict__") or _token(v) is not None):
            return None
    return items


def _same_atoms(held: tuple[tuple[str, Any], ...], now: Optional[tuple[tuple[str, Any], ...]]) -> bool:
    """The same keys holding the very same objects (identity: an equal value put in its place is walked again)."""
    return now is not None and len(held) == len(now) and all(
        a[0] == b[0] and a[1] is b[1] for a, b in zip(held, now))


def _token(value: Any) -> Any:
    """What tells a held value changed (module docstring's cost), or ``None``: not a value compared."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided or value.is_complex():
            return None
        try:
            place = value.data_ptr()
        except RuntimeError:  # a tensor without storage (a DTensor, a meta tensor)
            place = None
        return ("tensor", id(value), value._version, place, tuple(value.shape), value.dtype)
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None:
        if value.dtype.kind not in "fiu" or not hasattr(value, "tobytes"):
            return None
        size = getattr(value, "size", 1)
        if size <= COPIED:
            return ("array", id(value), value.shape, value.tobytes())
        return ("array", id(value), value.shape, value.__array_interface__["data"][0])
    if isinstance(value, float):
        return ("float", value)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return ("numbers", type(value), tuple(value))
    return None


def _written_slices(value: Any, last: Optional[tuple[Any, Any]]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The rows and columns of a 2-D tensor written since its last compared copy (every one without a copy of its
    shape: ``(None, None)``): what :meth:`~.training_statistics.TrainingStatistics.slices_held` compares."""
    copy = last[1] if last is not None else None
    if not isinstance(value, Tensor) or value.dim() != 2 or copy is None or copy.shape != value.shape \
            or copy.dtype != value.dtype or copy.device != value.device:
        return None, None
    moved = value.detach() != copy
    return moved.any(1).nonzero().reshape(-1), moved.any(0).nonzero().reshape(-1)


def _copy(value: Any) -> Any:
    """A copy of a tensor of up to :data:`COPIED` elements (put back when a later write is refused), else ``None``."""
    if isinstance(value, Tensor) and value.numel() <= COPIED:
        return value.detach().clone()
    return None


def _same(value: Tensor, copy: Tensor) -> bool:
    try:
        return value.shape == copy.shape and value.dtype == copy.dtype and bool(torch.equal(value.detach(), copy))
    except RuntimeError:
        return False


def _put_back(written: list[tuple[Any, Any]]) -> bool:
    """Put the tensors written in place back to their last compared values; whether every one was."""
    done = True
    with torch.no_grad():
        for value, copy in written:
            if value.shape == copy.shape and value.dtype == copy.dtype and value.device == copy.device:
                value.copy_(copy)
            else:
                done = False
    return done and bool(written)


def _optimizer_values(i: int, optimizer: Any) -> Iterator[tuple[str, Any]]:
    """(path, value) of an optimizer's per-parameter state and its parameter groups' values."""
    state = getattr(optimizer, "state", None) or {}
    for g, group in enumerate(getattr(optimizer, "param_groups", None) or ()):
        for key, value in group.items():
            if key != "params":
                yield f"optimizer {i} param_groups[{g}][{key!r}]", value
        for j, p in enumerate(group.get("params", ())):
            for key, value in (state.get(p) or {}).items() if isinstance(state.get(p), dict) else ():
                yield f"optimizer {i} state[{g}][{j}][{key!r}]", value


def written_statistics_error(found: Sequence[str], where: str, put_back: bool = False) -> PrivacyConfigurationError:
    """The refusal of :meth:`WrittenStatistics.check`'s findings."""
    lines = "\n".join(f"- {f}" for f in found[:6])
    note = ("The tensors written were put back to the values last compared." if put_back else
            "The module, its callbacks or the datamodule still hold what was written: do not save or use them as they "
            "are.")
    return PrivacyConfigurationError(
        f"State written during the private fit equals a statistic of the training data ({where}):\n{lines}\n"
        "It depends on every training record and no noise covers it, whatever path it came by (a file saved before "
        "the fit and read back in a hook, a global, a cached function of the data, an environment variable): the "
        "state is released with the model and its checkpoints, and a buffer the forward reads steers every later "
        f"release. Nothing holding it was released. {note} Fix: compute such values from public data or with a DP "
        "mechanism charged to this fit (lightning_dp.data.PrivateStandardizer), or, for a value not derived from "
        "this training data, declare it: DPStrategy(public_state=[name]).")
