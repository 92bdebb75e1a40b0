"""A user's own logger rebuilt for each run of the user's hooks with the logged values moved: its state at the fit's
start, fed again the calls it received since, with those values moved.

Searching a logger's memory and files for copies of the logged values (:mod:`.in_memory`, :mod:`.text_files`) finds
what it keeps as Lightning handed it, by name or by value; a logger of the user's own may keep any one-to-one
re-encoding of them instead (``round(v, 2)``, ``int(v * 1000)``, ``f"L{v:.6f}"``, ``pickle.dumps(v)``, a ``.npy``
file, ``(0.37 * v, 0.63 * v)``), which no search finds. So a logger whose class is not Lightning's own
(:func:`users`: its module not under ``lightning`` or ``pytorch_lightning``) is not searched but rebuilt
(:class:`Refeeds`):

* at the fit's start, its attributes are copied (``copy.deepcopy`` of its ``__dict__``, its created experiment with
  them, or of the logger itself where its class defines ``__deepcopy__``; the trainer, the module, the strategy, the
  callbacks, the loggers and the optimizers it may hold are shared, not copied), the files at or under its paths
  kept (:class:`.logger_files.LoggerFiles`), and every call of its ``log_metrics`` and ``save`` (the two Lightning
  makes each time it logs) recorded from then on, in order, by a callable of the library's set on that logger alone
  (an attribute of the instance shadowing its class's method, removed at the fit's end; the class and its other
  instances are never changed) — at most :data:`CALLS` of them (past that it cannot be rebuilt, as below);
* for each run (:meth:`Refeeds.moved`), it is given a fresh copy of its attributes at the fit's start, its files
  written since are set apart (any file, binary too), and its own ``log_metrics`` and ``save`` are called again with
  the recorded calls in order, the values of the moved names in them moved (alternately along each name's history,
  as the searched copies move: ``move`` at even positions, ``other`` at odd ones), the others (held-out values, the
  epoch) as they were. Whatever it keeps, and however, is then what the moved values make it. The attributes' top
  containers (a list, dict, deque or set) and its experiment's attributes are moved into the objects it held (an
  alias a callback keeps reads them too). After the run its attributes, their contents and its files are as they
  were; what the run logged to it is dropped.
* what its recorded calls wrote anywhere else (a sqlite database or a text file outside its folders, in a hidden
  folder, four folders deep) is seen as they run and set apart for each run as it was before their first write, its
  real contents put back after (:mod:`.logger_effects`); one whose calls did what cannot be set apart (a socket, a
  process) is not fed again: a decision a run would judge is refused, naming it and what it did
  (:meth:`RefedLogger.refusal`) — fed again, it would send the moved values.

Where its attributes cannot be copied at the fit's start (a lock, an open file, a sqlite connection: what it keeps
in a store it holds open is written by C code, unseen, and searching finds nothing re-encoded; zoo30 l06, x01, x02) or
where it received more than :data:`CALLS` calls, it cannot be rebuilt: a warning names it once, it trains, and a
decision a run would judge (any window whose hooks decided or kept something after values were logged) is refused
(:func:`unrebuilt`, naming it, what ``copy.deepcopy`` said or the calls' count, and the fixes) — fail closed, as for
a socket. Where fed again it raises, a warning names it once and it is searched
(:mod:`lightning_dp.validators.logger_copies`) from then on. On ranks other than the global zero its files are not set
apart (two ranks would race over one folder): one that wrote files since the fit's start (or whose calls wrote any
path) is searched there. What its
other methods did since the fit's start (``log_hyperparams``, ``after_save_checkpoint``, the user's own calls) is not
done again. The cost: one copy of its attributes at the fit's start and one per run, and the recorded calls fed
again per run — the runs are made only when a decision window judges (docs/release_boundary.md, rule 6).
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import os
import warnings
from contextlib import ExitStack, contextmanager, nullcontext, redirect_stderr, redirect_stdout
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from lightning_dp.records.library_code import library_rooted
from lightning_dp.containers import held_items, put_back
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.value_copies.logger_effects import Effects
from lightning_dp.value_copies.logger_files import LoggerFiles

__all__ = ["CALLS", "LIGHTNING", "RECORDED", "RefedLogger", "Refeeds", "Unrebuilt", "unrebuilt", "users"]

LIGHTNING = ("lightning", "pytorch_lightning")
"""The packages whose loggers are searched, not rebuilt (what they keep is known: :mod:`.in_memory`)."""
CALLS = 100_000
"""The calls recorded of one logger at most (Lightning's default: one ``log_metrics`` and one ``save`` every 50
steps and at each epoch's end: 2.5 million steps; logging every step, 50,000). Measured: about 360 bytes a call
recorded (a dict of three floats), and a run fed again 50,000 calls in 0.45 s (a logger keeping ``int(v * 1000)``):
36 MB and about 1 s a run at the cap. Past it a decision judged is refused (:meth:`Refeeds.moved`)."""
RECORDED = ("log_metrics", "save")
"""The methods whose calls are recorded and made again."""

Moves = tuple[Callable[[Any], Any], Callable[[Any], Any]]
Call = tuple[str, tuple, dict]
_MUTABLE = (list, dict, collections.deque, set)


def users(logger: Any) -> bool:
    """Whether ``logger``'s class is the user's (or another library's): not under :data:`LIGHTNING`."""
    return not library_rooted(type(logger), LIGHTNING)


class Unrebuilt(Exception):
    """A user's logger that cannot be rebuilt: why (no data in it)."""


def unrebuilt(name: str, why: str, fixes: str = "") -> PrivacyConfigurationError:
    """The refusal of a decision judged while the user's logger ``name`` cannot be rebuilt (``why``; ``fixes``: the
    fixes of that cause, else those of a state that does not copy)."""
    fixes = fixes or ("open the file or connection it holds open inside each log_metrics call instead (then what it "
                      "writes there is set apart for each run), or give the logger a __deepcopy__ whose copy holds a "
                      "new one of what does not copy (a lock, a client), or use one of Lightning's loggers "
                      "(CSVLogger, TensorBoardLogger)")
    return PrivacyConfigurationError(
        f"The logger {name} cannot be rebuilt for the runs that judge a decision ({why}): those runs feed a user's "
        "logger its calls again with the values logged from the training data moved, and what this one keeps of them "
        "(in its attributes, or in a file or database it holds open) would still be the real values there, so no "
        "decision made after them (a learning rate, a stop, a checkpoint choice) can be judged: it may be made from "
        f"them. Fix: {fixes} (docs/release_boundary.md, rule 6).")


class RefedLogger:
    """One user's logger: its attributes at the fit's start, its files, and the calls it received since.

    Its attributes are copied by ``copy.deepcopy``, or, where its class defines ``__deepcopy__`` (one giving its copy
    a new lock or client), the logger is (its copy's attributes then). Raises :class:`Unrebuilt` where they do not copy.
    """

    def __init__(self, logger: Any, shared: Iterable[Any], files: LoggerFiles) -> None:
        self.logger = logger
        self.shared = [logger, *shared]
        self.own_copy = callable(getattr(type(logger), "__deepcopy__", None))
        try:
            self.snapshot = self._copy(logger if self.own_copy else dict(vars(logger)))
        except Exception as error:  # noqa: BLE001  (a lock, an open file, a connection: what deepcopy said is named)
            said = " ".join(str(error).split())[:200]
            raise Unrebuilt(f"copy.deepcopy of {'the logger' if self.own_copy else 'its attributes'} raised "
                            f"{type(error).__name__}{': ' + said if said else ''}") from error
        self.files = files
        self.effects = Effects()  # the paths its calls write outside its copied state, what cannot be set apart
        self.calls: list[Call] = []
        self.failed = False
        self.unrebuilt: Optional[str] = None  # past the calls recorded: why it cannot be rebuilt (refused when judged)
        self._inside = 0  # a recorded method calling another (``save`` from ``log_metrics``), a run: not recorded
        self._running = False  # the run's hooks run (the logger rebuilt)
        self.functions = {name: inspect.getattr_static(type(logger), name, None) for name in RECORDED}
        if any(not inspect.isfunction(f) for f in self.functions.values()) or any(n in vars(logger) for n in RECORDED):
            raise Unrebuilt("its log_metrics or save is not a plain method, so its calls cannot be recorded")
        self.recorders = {name: _Recorder(logger, name, self).record for name in RECORDED}
        vars(logger).update(self.recorders)  # on this logger only: its class, and its other instances, are left alone

    def _copy(self, value: Any) -> Any:
        """``value`` deep-copied, the shared objects not (nor the logger, unless ``value`` is it or its copy)."""
        memo = {id(o): o for o in self.shared if o is not value}
        return copy.deepcopy(value, memo)

    def _state(self) -> dict:
        """A fresh copy of its attributes at the fit's start."""
        return dict(vars(self._copy(self.snapshot))) if self.own_copy else self._copy(self.snapshot)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The logger's own ``name`` method called, the call recorded (not one made inside another, nor in a run)."""
        outer = not self._inside
        if outer:
            self._note(name, args, kwargs)
        self._inside += 1
        try:
            if self._running:  # a call the run's hooks make: what it writes elsewhere is put back after the run
                watch: Any = self.effects.replaying(name, block=False)
            else:
                watch = self.effects.recording(name) if outer and not self.failed else nullcontext()
            with watch:
                return self.functions[name](self.logger, *args, **kwargs)
        finally:
            self._inside -= 1

    def _note(self, name: str, args: tuple, kwargs: dict) -> None:
        if self.failed:
            return
        if len(self.calls) >= CALLS:  # its state cannot be rebuilt: a decision judged is refused (Refeeds.moved)
            self.failed, self.calls = True, []
            self.unrebuilt = f"received more than {CALLS:,} calls of log_metrics and save, the most recorded"
            warnings.warn(f"lightning_dp: the logger {type(self.logger).__name__} {self.unrebuilt}: a decision the fit "
                          "judges after values logged from the training data is refused from now on "
                          "(docs/release_boundary.md, rule 6).", stacklevel=4)
            return
        if name == "log_metrics":  # Lightning passes one dict to every logger: kept as it was now
            if isinstance(kwargs.get("metrics"), Mapping):
                kwargs = {**kwargs, "metrics": dict(kwargs["metrics"])}
            elif args and isinstance(args[0], Mapping):
                args = (dict(args[0]), *args[1:])
        self.calls.append((name, args, dict(kwargs)))

    def fail(self, why: str) -> None:
        """From now on the logger is searched, not rebuilt: said once."""
        if not self.failed:
            self.failed, self.calls = True, []
            warnings.warn(f"lightning_dp: the logger {type(self.logger).__name__} {why}: from now on its copies of the "
                          "values logged from the training data are searched by name and by value only, and what it "
                          "keeps of them re-encoded (rounded, scaled, as text, pickled, in a binary file) does not "
                          "move in the runs that judge decisions from them (docs/release_boundary.md, rule 6).",
                          stacklevel=3)

    @contextmanager
    def rebuilt(self, names: set[str], moves: Moves, files: bool) -> Iterator[None]:
        """Inside, the logger holds what its state at the fit's start makes of the recorded calls, the values of
        ``names`` moved (and, given ``files``, its files are set apart); after, it is as it was."""
        holder = vars(self.logger)
        real = dict(holder)
        filled: list[tuple[Any, Any]] = []
        self._inside += 1
        try:
            with self.files.set_apart() if files else nullcontext(), self.effects.set_apart(files):
                try:
                    state = self._state()
                    holder.clear()
                    holder.update(state)
                    holder.update({n: r for n, r in self.recorders.items() if real.get(n) is r})  # hooks' calls
                    counts: dict[str, int] = {}
                    with open(os.devnull, "w") as silent, redirect_stdout(silent), redirect_stderr(silent):
                        for name, args, kwargs in self.calls:
                            if name == "log_metrics":
                                args, kwargs = _moved_call(args, kwargs, names, moves, counts)
                            with self.effects.replaying(name):
                                self.functions[name](self.logger, *args, **kwargs)
                    if self.effects.undoable is not None:
                        raise PermissionError(self.effects.undoable)  # done, blocked and caught by its own code
                    _into_held(holder, real, filled)
                    self._running = True
                    yield
                finally:
                    self._running = False
                    for container, items in reversed(filled):
                        _fill(container, items)
                    holder.clear()
                    holder.update(real)
        except PermissionError:
            if self.effects.undoable is not None:
                raise self.refusal() from None
            raise
        finally:
            self._inside -= 1

    def refusal(self) -> PrivacyConfigurationError:
        """The refusal of a decision judged from the logged values while this logger did what cannot be set apart."""
        return PrivacyConfigurationError(
            f"The logger {type(self.logger).__name__} {self.effects.undoable} during the fit: the runs that judge a "
            "decision made after values logged from the training data were read feed the logger its calls again with "
            "those values moved, and what it did cannot be set apart and undone there (it would be done again with "
            "the moved values), so the decision cannot be judged. Fix: keep what log_metrics and save send in the "
            "logger's attributes or files and send it from its finalize() (run once, after the fit), or decide from "
            "values not logged from the training data (docs/release_boundary.md, rule 6).")

    def stop(self) -> None:
        """No more calls are recorded: the logger's methods are its class's again."""
        holder = vars(self.logger)
        for name, recorder in self.recorders.items():
            if holder.get(name) is recorder:
                del holder[name]


class Refeeds:
    """The user's loggers of one fit, rebuilt in each run (module docstring); ``places(logger)``: the paths it names,
    ``since``: the fit's start (a time), ``shared``: the objects not copied."""

    def __init__(self, loggers: Iterable[Any], places: Callable[[Any], list[str]], since: float,
                 shared: Iterable[Any] = ()) -> None:
        self.refed: list[RefedLogger] = []
        self.unrebuilt: list[tuple[str, str]] = []  # (the logger's class name, why): a decision judged is refused
        shared = list(shared)
        for logger in loggers:
            if not users(logger) or not hasattr(logger, "__dict__"):
                continue
            try:
                files = LoggerFiles(functools.partial(places, logger), since)
                self.refed.append(RefedLogger(logger, shared, files))
            except Exception as error:  # noqa: BLE001  (a lock, an open file: it trains; a decision judged is refused)
                why = str(error) if isinstance(error, Unrebuilt) else f"its set-up raised {type(error).__name__}"
                self.unrebuilt.append((type(logger).__name__, why))
                warnings.warn(f"lightning_dp: the logger {type(logger).__name__} cannot be rebuilt ({why}): it "
                              "trains, but a decision the fit judges after values logged from the training data (a "
                              "learning rate, a stop, a checkpoint choice) will be refused (open its files when it "
                              "writes, or give it a __deepcopy__; docs/release_boundary.md, rule 6).",
                              stacklevel=2)

    @contextmanager
    def moved(self, names: Iterable[str], moves: Moves, files: bool = True) -> Iterator[set[int]]:
        """Inside, each logger rebuilt with the values of ``names`` moved; yields the ids of those rebuilt (the others
        are searched). ``files``: on the global rank zero (else a logger that wrote files is not rebuilt)."""
        names = set(names)
        rebuilt: set[int] = set()
        if names and self.unrebuilt:  # fail closed: searched, what it keeps re-encoded or in a store held open escapes
            raise unrebuilt(*self.unrebuilt[0])
        for refed in self.refed if names else ():
            if refed.unrebuilt is not None:
                raise unrebuilt(type(refed.logger).__name__, refed.unrebuilt,
                                "log fewer calls (Trainer(log_every_n_steps=...)), or use one of Lightning's loggers "
                                "(CSVLogger, TensorBoardLogger), or make the decision from values not logged from "
                                "the training data")
        with ExitStack() as stack:
            for refed in self.refed if names else ():
                if refed.failed or (not files and (refed.files.changed() or refed.effects.wrote())):
                    continue
                if refed.effects.undoable is not None:
                    raise refed.refusal()
                try:
                    stack.enter_context(refed.rebuilt(names, moves, files))
                except PrivacyConfigurationError:
                    raise
                except Exception as error:  # noqa: BLE001  (the user's code fed again: searched instead)
                    refed.fail(f"raised {type(error).__name__} when fed its calls again with the values moved")
                    continue
                rebuilt.add(id(refed.logger))
            yield rebuilt

    def stop(self) -> None:
        """The fit is over: the loggers' methods are their own again (their states and calls are kept: a run after
        the last update is rebuilt too)."""
        for refed in self.refed:
            refed.stop()


def _moved_call(args: tuple, kwargs: dict, names: set[str], moves: Moves, counts: dict[str, int]) -> tuple[tuple, dict]:
    """A ``log_metrics`` call with the values of ``names`` moved, the ``n``-th of a name by ``moves[n % 2]``."""
    def moved(metrics: Any) -> Any:
        if not isinstance(metrics, Mapping):
            return metrics
        out = dict(metrics)
        for key in [k for k in out if k in names]:
            position = counts.get(key, 0)
            out[key] = moves[position % 2](out[key])
            counts[key] = position + 1
        return out

    if "metrics" in kwargs:
        return args, {**kwargs, "metrics": moved(kwargs["metrics"])}
    return ((moved(args[0]), *args[1:]) if args else args), kwargs


def _into_held(holder: dict, real: dict, filled: list[tuple[Any, Any]]) -> None:
    """The rebuilt attributes' top containers, and its experiment's attributes, moved into the objects the logger
    held (aliases read them); what those held noted in ``filled``."""
    for key, value in list(holder.items()):
        old = real.get(key)
        if old is None or old is value or type(old) is not type(value):
            continue
        if isinstance(old, _MUTABLE):
            filled.append((old, dict(old) if isinstance(old, dict) else list(old)))
            _fill(old, value)
            holder[key] = old
        elif key in ("_experiment", "experiment") and hasattr(old, "__dict__"):
            filled.append((vars(old), dict(vars(old))))
            _fill(vars(old), vars(value))
            holder[key] = old


def _fill(container: Any, items: Any) -> None:
    """``container`` (a list, deque, set or dict) holds ``items`` (a container of the same kind) in place."""
    put_back(container, held_items(items))


class _Recorder:
    """The logger's method ``name`` while a fit records it: :meth:`record`, bound, is held in the logger's own
    attributes (an instance attribute shadows its class's method) and calls through :meth:`RefedLogger.call` — a
    method of the library's, on a slotted object of the library's, so the walks over the user's state pass it by. A
    copy of the logger (``copy.deepcopy``, pickling) holds one that calls its class's method, unrecorded."""

    __slots__ = ("logger", "name", "refed")

    def __init__(self, logger: Any, name: str, refed: Optional[RefedLogger] = None) -> None:
        self.logger, self.name, self.refed = logger, name, refed

    def record(self, *args: Any, **kwargs: Any) -> Any:
        """The call made, recorded (by a copy of the logger: made only)."""
        if self.refed is None:
            return inspect.getattr_static(type(self.logger), self.name)(self.logger, *args, **kwargs)
        return self.refed.call(self.name, args, kwargs)

    def __deepcopy__(self, memo: dict) -> _Recorder:
        return _Recorder(copy.deepcopy(self.logger, memo), self.name)

    def __reduce__(self) -> tuple[type, tuple[Any, str]]:
        return _Recorder, (self.logger, self.name)
