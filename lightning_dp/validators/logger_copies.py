"""Where logged values live besides the trainer's metric dicts: the loggers' own copies, moved with them.

A value a training hook logged (an un-noised statistic of the batch) reaches each of the trainer's loggers, which
keep it: in memory (Lightning's ``CSVLogger`` holds the rows not yet written in ``experiment.metrics``, a list of
dicts; a user's logger a ``history`` of them, a deque, ``(step, name, value)`` rows) and in files (the CSVLogger's
``metrics.csv``, a ``metrics.jsonl``). A hook reading it back from there (a plateau rule by hand from
``self.logger.history`` or from a file) decides as one reading ``trainer.callback_metrics`` would. The replays that
run the user's hooks again with the logged values moved (:meth:`~.logged_reads.LoggedReads.moved`, the decision
windows) move these copies too (:func:`moved`), found by name and by value (:mod:`lightning_dp.value_copies`: a
number equal to a value logged this fit under a moved name, as a float64, a float32 or rounded, when it shows four
significant digits and is not whole; under a logged name, beside it in a row or after it on a line, any number):

* in memory: what each logger and its experiment (as created: a logger's ``experiment`` property is not called, it
  may start a run) hold in their attributes, walked a few levels deep and within a bound
  (:mod:`lightning_dp.value_copies.in_memory`: dicts, lists, tuples, namedtuples, deques, sets, plain objects and
  dataclasses, NumPy arrays, tensors, strings); a top container is changed in place (a callback
  holding it sees the moved values too), the ones inside it are replaced by moved copies (the logger's own dicts
  are never written); every container walked and every attribute changed is put back after (what a hook run again
  logged or flushed meanwhile is dropped);
* files (on the global rank zero only): the text files (csv, tsv, jsonl, json, txt, yaml, log) changed since the
  fit began at or under the paths the loggers name (``log_dir``, ``save_dir``, ``root_dir``, an attribute holding
  a path: the CSVLogger's ``metrics_file_path``), within a bound (:mod:`lightning_dp.value_copies.text_files`):
  rewritten with the moved values for the replay and their bytes put back after, each time by an atomic replace.
  Rows still in memory are moved there, not flushed: the file and the memory read alike in every run.

A logger of the user's own (its class not under ``lightning`` or ``pytorch_lightning``) may keep the values in any
one-to-one re-encoding (``round(v, 2)``, ``int(v * 1000)``, ``f"L{v:.6f}"``, pickled bytes, a ``.npy`` file), which no
search finds: it is not searched but rebuilt (:mod:`lightning_dp.value_copies.refed_loggers`, made at the fit's start
by :func:`refeeds`): for each run, its attributes as they were at the fit's start, its files written since set apart
(any file), fed again the ``log_metrics`` and ``save`` calls it received with the moved values; put back after. One
whose attributes do not copy (a lock, an open file) or past the calls recorded is named in a warning, and a decision
judged is refused; one raising when fed again is named in a warning and searched as below.

A history holds several values of one name (one per epoch or step), and moving them all alike keeps their order: a rule
comparing the last two (``h[-1] > h[-2] - 0.05``: a plateau) would decide alike on every run. So the values of a name
along a history (a container's items, a file's rows or lines) are moved alternately: the ``move`` given at even
positions, ``other`` at odd ones (the replays pass far and near zero, then near and far:
:meth:`~.logged_reads.LoggedReads.moved`) — two neighbours swap their order in one of the two runs, and every value
moves both ways.

Not moved (in Lightning's loggers and the user's searched ones): binary files (TensorBoard's event files) and remote
stores (wandb, MLflow); a copy a logger keeps outside its own and its experiment's attributes (a global list), past the
walk's bounds, or as a whole number or a short one (0.5) found by its value only; a file written outside the loggers'
folders. Reading them back from a hook is not seen.

Reading the copies is not refused by itself: a callback printing the history, a rule on the held-out loss the same
rows hold, are sound; a read cannot be told from its use, and a copy is reachable by any attribute, file or library
(``pandas.read_csv``), so no watch over reads would be sound. What the read decides is judged, as for the trainer's
dicts: by the windows' runs with the copies moved.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from lightning_dp.value_copies.in_memory import Walk
from lightning_dp.value_copies.logged_values import LoggedValues
from lightning_dp.value_copies.refed_loggers import Refeeds
from lightning_dp.value_copies.text_files import replace, rewrite_file, written

__all__ = ["moved", "refeeds"]

_PLACES = ("log_dir", "save_dir", "root_dir")  # the folders a logger names (properties: read, never set)


def _holders(loggers: Iterable[Any]) -> list[Any]:
    """Each logger and its experiment as created (``_experiment`` or an ``experiment`` attribute, never the
    property)."""
    found: list[Any] = []
    for logger in loggers:
        if not hasattr(logger, "__dict__"):
            continue
        found.append(logger)
        attributes = vars(logger)
        for name in ("_experiment", "experiment"):
            experiment = attributes.get(name)
            if experiment is not None and hasattr(experiment, "__dict__") and all(experiment is not f for f in found):
                found.append(experiment)
    return found


def _places(holders: list[Any]) -> list[str]:
    """The paths the holders name: their folders' properties and every attribute holding a path; a folder above a
    logger's ``log_dir`` (its ``save_dir``: other versions' runs, the working directory) is not one."""
    places: list[Any] = []
    logs: set[str] = set()
    for holder in holders:
        named = {name: _property(holder, name) for name in _PLACES}
        if isinstance(named["log_dir"], (str, os.PathLike)) and named["log_dir"]:
            logs.add(os.path.abspath(os.fspath(named["log_dir"])))
        places += [*named.values(), *vars(holder).values()]
    named_paths = [os.fspath(p) for p in places if isinstance(p, (str, os.PathLike))]
    paths = [os.path.abspath(p) for p in named_paths if isinstance(p, str) and p and "\n" not in p]
    return [p for p in dict.fromkeys(paths) if not any(log.startswith(p.rstrip(os.sep) + os.sep) for log in logs)]


def _property(holder: Any, name: str) -> Any:
    """``holder.name``, ``None`` where reading it fails (a property that needs a run)."""
    try:
        return getattr(holder, name, None)
    except Exception:  # noqa: BLE001
        return None


def refeeds(trainer: Any, since: float) -> Refeeds:
    """The trainer's loggers of the user's own, rebuilt in each run rather than searched
    (:mod:`lightning_dp.value_copies.refed_loggers`), as they are at the fit's start (``since``: its time)."""
    shared = [trainer, getattr(trainer, "lightning_module", None), getattr(trainer, "strategy", None),
              getattr(trainer, "datamodule", None), *(getattr(trainer, "callbacks", None) or ()),
              *(getattr(trainer, "loggers", None) or ()), *(getattr(trainer, "optimizers", None) or ())]
    return Refeeds(getattr(trainer, "loggers", None) or (), lambda logger: _places(_holders([logger])), since,
                   [o for o in shared if o is not None])


@contextmanager
def moved(loggers: Iterable[Any], names: Iterable[str], move: Callable[[Any], Any], files: bool = True,
          other: Optional[Callable[[Any], Any]] = None, values: Optional[Mapping[str, Iterable[Any]]] = None,
          since: Optional[float] = None, rebuilt: Optional[Refeeds] = None) -> Iterator[None]:
    """Inside, the copies the loggers hold of the values logged under ``names`` (``values``: those logged this fit,
    by name, to find their copies by value) in memory and, given ``files``, in the text files changed since ``since``
    (on the global rank zero only, which Lightning's loggers write from; two ranks rewriting one file could leave it
    moved) read ``move(value)`` — ``other(value)`` at the odd positions of a history (default: ``move``); as they
    were after (module docstring). The user's own loggers ``rebuilt`` holds are rebuilt instead
    (:meth:`~lightning_dp.value_copies.refed_loggers.Refeeds.moved`), the others searched."""
    logged = set(names)
    with rebuilt.moved(logged, (move, other or move), files) if rebuilt is not None else nullcontext(set()) as done:
        with _searched([lg for lg in loggers if id(lg) not in done], logged, move, files, other, values, since):
            yield


@contextmanager
def _searched(loggers: Iterable[Any], logged: set[str], move: Callable[[Any], Any], files: bool,
              other: Optional[Callable[[Any], Any]], values: Optional[Mapping[str, Iterable[Any]]],
              since: Optional[float]) -> Iterator[None]:
    """:func:`moved` for the loggers searched (by name and by value)."""
    objects = _holders(loggers) if logged else []
    prefixes = {p for p in (getattr(o, "_prefix", None) for o in objects) if isinstance(p, str) and p}
    keys = {f"{prefix}-{name}" for prefix in prefixes for name in logged}  # as a prefixed logger keys them
    copies = LoggedValues(logged, {n: v for n, v in (values or {}).items() if n in logged}, (move, other or move), keys)
    walk = Walk(copies)
    rewritten: list[tuple[str, bytes]] = []
    try:
        for holder in objects:
            walk.in_place(holder)
        for path in written(_places(objects), since) if files and objects else ():
            if (found := rewrite_file(path, copies)) is not None:
                rewritten.append((path, found[0]))
                replace(path, found[1])
        yield
    finally:
        for path, original in reversed(rewritten):
            replace(path, original)
        walk.put_back()
