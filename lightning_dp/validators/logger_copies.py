"""Where logged values live besides the trainer's metric dicts: the loggers' own copies, moved with them.

A value a training hook logged (an un-noised statistic of the batch) reaches each of the trainer's loggers, which
keep it: in memory (Lightning's ``CSVLogger`` holds the rows not yet written in ``experiment.metrics``, a list of
dicts; a user's logger a ``history`` of them) and in files (the CSVLogger's ``metrics.csv``). A hook reading it back
from there (a plateau rule by hand from ``self.logger.history`` or from ``metrics.csv``) decides as one reading
``trainer.callback_metrics`` would. The replays that run the user's hooks again with the logged values moved
(:meth:`~.logged_reads.LoggedReads.moved`, the decision windows) move these copies too (:func:`moved`):

* in memory: the containers bound to an attribute of each logger and of its experiment (as created: a logger's
  ``experiment`` property is not called, it may start a run) — dicts, lists and tuples, walked a few levels deep —
  where a logged name (also after the logger's prefix: ``"fit-train_loss"``) keys a number or a tensor (or a list of
  them: ``history["train_loss"]``); a top container is changed in place (a callback holding it sees the moved values
  too), the ones inside it are replaced by moved copies (the logger's own dicts are never written); every dict or
  list bound to their attributes is put back after, its binding and its contents (what a hook run again logged or
  flushed meanwhile is dropped);
* files: a ``.csv`` file named by such an attribute (the CSVLogger's ``metrics_file_path``) whose header names a
  logged name: rewritten with the moved values for the replay and its bytes put back after, each time by an atomic
  replace. Rows still in memory are moved there, not flushed: the file and the memory read alike in every run.

A history holds several values of one name (one per epoch or step), and moving them all alike keeps their order: a rule
comparing the last two (``h[-1] > h[-2] - 0.05``: a plateau) would decide alike on every run. So the values of a name
along a history (a list's items, a file's rows) are moved alternately: the ``move`` given at even positions, ``other``
at odd ones (the replays pass far and near zero, then near and far: :meth:`~.logged_reads.LoggedReads.moved`) — two
neighbours swap their order in one of the two runs, and every value moves both ways.

Not moved: TensorBoard's event files (and any other binary or remote store: wandb, MLflow); reading them back from a
hook is not seen. A logger's copy reached otherwise than through its attributes (a global list it appends to) is not
found either.

Reading the copies is not refused by itself: a callback printing the history, a rule on the held-out loss the same
rows hold, are sound; a read cannot be told from its use, and a copy is reachable by any attribute, file or library
(``pandas.read_csv``), so no watch over reads would be sound. What the read decides is judged, as for the trainer's
dicts: by the windows' runs with the copies moved.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

__all__ = ["moved"]

_DEPTH = 4  # containers inside a logger's attribute walked this deep (a list of dicts of lists)
_SAME = object()


def _number(value: Any) -> bool:
    """Whether ``value`` is a logged value as a logger keeps it: a number (not a flag) or a tensor."""
    return isinstance(value, (float, torch.Tensor)) or (isinstance(value, int) and not isinstance(value, bool))


def _logged(key: Any, names: set[str]) -> bool:
    """Whether ``key`` is one of the logged ``names`` (as the loggers key them)."""
    return isinstance(key, str) and key in names


Moves = tuple[Callable[[Any], Any], Callable[[Any], Any]]
"""How a logged value moves at an even position of a history, and at an odd one (module docstring)."""


def _copy(value: Any, names: set[str], moves: Moves, depth: int) -> Any:
    """A copy of the container ``value`` with the logged values in it moved (``moves`` alternating along a list);
    :data:`_SAME` when it holds none."""
    if depth <= 0:
        return _SAME
    if isinstance(value, dict):
        changed: dict[Any, Any] = {}
        for key, item in list(value.items()):
            if _logged(key, names) and _number(item):
                changed[key] = moves[0](item)
            elif _logged(key, names) and isinstance(item, (list, tuple)) and item and all(map(_number, item)):
                changed[key] = _rebuilt(item, [moves[i % 2](v) for i, v in enumerate(item)])
            elif isinstance(item, (dict, list, tuple)) and (moved := _copy(item, names, moves, depth - 1)) is not _SAME:
                changed[key] = moved
        if not changed:
            return _SAME
        out = _shallow(value)
        out.update(changed)
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items, held = [], 0  # held: the rows so far holding a logged value (a history's position; other rows skipped)
        for item in value:
            items.append(_copy(item, names, moves[held % 2:] + moves[:held % 2], depth - 1)
                         if isinstance(item, (dict, list, tuple)) else _SAME)
            held += isinstance(item, dict) and any(_logged(k, names) and _number(v) for k, v in item.items())
        if all(item is _SAME for item in items):
            return _SAME
        return _rebuilt(value, [old if new is _SAME else new for old, new in zip(value, items)])
    return _SAME


def _shallow(value: dict) -> dict:
    """A shallow copy of the dict ``value``, of its type where it copies itself (a ``defaultdict``)."""
    try:
        return value.copy()
    except Exception:  # noqa: BLE001  (a dict subclass whose copy fails: a plain dict stands in)
        return dict(value)


def _rebuilt(value: Any, items: list[Any]) -> Any:
    """A list of ``value``'s type (a tuple for a tuple) holding ``items``."""
    if isinstance(value, list):
        out = list.__new__(type(value)) if type(value) is not list else []
        out.extend(items)
        return out
    return tuple(items)


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


@contextmanager
def moved(loggers: Iterable[Any], names: Iterable[str], move: Callable[[Any], Any],
          files: bool = True, other: Optional[Callable[[Any], Any]] = None) -> Iterator[None]:
    """Inside, the values logged under ``names`` in the loggers' own copies (in memory and, given ``files``, in CSV
    files: on the global rank zero only, which Lightning's loggers write from; two ranks rewriting one file could
    leave it moved) read ``move(value)`` — ``other(value)`` at the odd positions of a history (default: ``move``);
    as they were after (module docstring)."""
    moves: Moves = (move, other or move)
    logged = set(names)
    objects = _holders(loggers) if logged else []
    prefixes = {p for p in (getattr(o, "_prefix", None) for o in objects) if isinstance(p, str) and p}
    keys = logged | {f"{prefix}-{name}" for prefix in prefixes for name in logged}  # as a prefixed logger keys them
    bindings = [(obj, {k: v for k, v in vars(obj).items() if isinstance(v, (dict, list))}) for obj in objects]
    contents = [(c, list(c) if isinstance(c, list) else dict(c)) for _, kept in bindings for c in kept.values()]
    written: list[tuple[str, bytes]] = []
    try:
        done: set[int] = set()
        for obj in objects:
            for value in list(vars(obj).values()):
                if isinstance(value, (dict, list)) and id(value) not in done:
                    done.add(id(value))
                    _move_in_place(value, keys, moves)
                elif files and isinstance(path := os.fspath(value) if isinstance(value, os.PathLike) else value, str) \
                        and path.endswith(".csv"):
                    _move_file(path, keys, moves, written)
        yield
    finally:
        for path, original in reversed(written):
            _replace(path, original)
        for container, saved in reversed(contents):
            if _alike(container, saved):
                continue
            if isinstance(container, list):
                container[:] = saved
            else:
                container.clear()
                container.update(saved)
        for obj, kept in bindings:
            for key, value in kept.items():
                if vars(obj).get(key, _SAME) is not value:
                    setattr(obj, key, value)


def _alike(container: Any, saved: Any) -> bool:
    """Whether ``container`` holds what was ``saved`` of it (the same objects)."""
    if isinstance(container, list):
        return len(container) == len(saved) and all(a is b for a, b in zip(container, saved))
    return dict.keys(container) == saved.keys() and all(dict.__getitem__(container, k) is v for k, v in saved.items())


def _move_in_place(container: Any, names: set[str], moves: Moves) -> None:
    """The logged values in the top ``container`` (a dict or a list bound to an attribute) moved, in place."""
    copied = _copy(container, names, moves, _DEPTH)
    if copied is _SAME:
        return
    if isinstance(container, list):
        container[:] = copied
    else:
        container.update(copied)


def _move_file(path: str, names: set[str], moves: Moves, files: list) -> None:
    """The CSV file at ``path`` rewritten with the logged columns' numbers moved, alternately down each column (its
    bytes kept in ``files``)."""
    if any(path == p for p, _ in files) or not os.path.isfile(path):
        return
    try:
        with open(path, "rb") as file:
            original = file.read()
        rows = list(csv.reader(io.StringIO(original.decode("utf-8"), newline="")))
    except (OSError, UnicodeDecodeError, csv.Error):
        return
    columns = [i for i, key in enumerate(rows[0] if rows else ()) if _logged(key, names)]
    if not columns:
        return
    seen = dict.fromkeys(columns, 0)  # the values of each column so far (their position along its history)
    for row in rows[1:]:
        for i in columns:
            if i < len(row) and row[i].strip():
                try:
                    row[i] = repr(float(moves[seen[i] % 2](float(row[i]))))
                    seen[i] += 1
                except ValueError:
                    pass
    out = io.StringIO(newline="")
    csv.writer(out, lineterminator="\r\n" if b"\r\n" in original else "\n").writerows(rows)
    files.append((path, original))
    _replace(path, out.getvalue().encode("utf-8"))


def _replace(path: str, content: bytes) -> None:
    """``path`` holds ``content``: written beside it, then put in its place in one step."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".moved-", suffix=".csv")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
