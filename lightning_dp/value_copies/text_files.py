"""The copies of logged values in text: a string a logger keeps, the text files it wrote during the fit.

A number in a text is a logged value's copy when the logged name stands just before it on its line (``"train_loss":
0.64``, ``train_loss=0.64``, ``3,train_loss,0.64``), when it sits in a CSV column a logged name heads or in a CSV row
naming one, or by its value (:class:`.logged_values.LoggedValues`); the copies of one name move alternately in the
order they are written (a history, :mod:`lightning_dp.validators.logger_copies`).

The files looked at (:func:`written`): the files and folders the loggers name (their ``log_dir``, ``save_dir``,
``root_dir``, any path an attribute holds), the text files in them (:data:`SUFFIXES`) changed since the fit began,
:data:`LEVELS` folders deep (hidden ones and environments skipped), at most :data:`FILES` files of
:data:`FILE_BYTES` each, :data:`BYTES` in all. Binary files (TensorBoard's event files) are not read (those a user's
logger wrote are set apart whatever their kind: :mod:`.logger_files`).
"""

from __future__ import annotations

import csv
import io
import os
import re
import tempfile
from typing import Any, Callable, Iterable, Optional

from lightning_dp.value_copies.logged_values import LoggedValues

__all__ = ["SUFFIXES", "replace", "rewrite_file", "rewrite_text", "written"]

SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".txt", ".yaml", ".yml", ".log")
"""The text files a logger writes its values to."""
LEVELS, FOLDERS, FILES = 3, 50, 200
"""How deep under a logger's folder files are looked for, in how many folders at most, and how many files at most."""
FILE_BYTES, BYTES = 4 << 20, 16 << 20
"""A larger file is not read; nor past this many bytes in all."""
_SKIPPED = {"__pycache__", "node_modules", "site-packages", "venv", "checkpoints"}
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
_BEFORE = 120  # characters before a number looked at for its name


def rewrite_text(text: str, logged: LoggedValues, offset: Callable[[str], int] = lambda name: 0) -> tuple[str, set]:
    """``text`` with the copies of logged values in it moved (the ``n``-th of a name at position ``offset(name) + n``
    along its history), and the names moved."""
    counts: dict[str, int] = {}
    parts: list[str] = []
    last = 0
    for found in _NUMBER.finditer(text):
        token, start = found.group(), found.start()
        line = text.rfind("\n", 0, start) + 1
        name = logged.before(text[max(line, start - _BEFORE):start])
        if name is None and ("." in token or "e" in token.lower()):
            name = logged.of(float(token), token.lstrip("+"))
        if name is None:
            continue
        parts += [text[last:start], repr(float(logged.move(float(token), offset(name) + counts.get(name, 0))))]
        counts[name] = counts.get(name, 0) + 1
        last = found.end()
    return "".join(parts) + text[last:], set(counts)


def _rewrite_table(text: str, logged: LoggedValues, delimiter: str) -> str:
    """The CSV ``text`` with the cells under a logged name's column, or in a row naming one, moved."""
    rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter))
    columns = {i: logged.named(key) for i, key in enumerate(rows[0] if rows else ())}
    counts: dict[str, int] = {}
    for row in rows[1:]:
        hint = next((cell for cell in row if logged.named(cell)), None)
        for i, cell in enumerate(row):
            name, token = columns.get(i), cell.strip()
            try:
                x = float(token)
            except ValueError:
                continue
            name = name or (hint if "." in token else None) or logged.of(x, token)
            if name is not None:
                row[i] = repr(float(logged.move(x, counts.get(name, 0))))
                counts[name] = counts.get(name, 0) + 1
    out = io.StringIO(newline="")
    csv.writer(out, delimiter=delimiter, lineterminator="\r\n" if "\r\n" in text else "\n").writerows(rows)
    return out.getvalue() if counts else text


def rewrite_file(path: str, logged: LoggedValues) -> Optional[tuple[bytes, bytes]]:
    """The bytes of the text file at ``path`` and its bytes with the logged values' copies moved, if any."""
    try:
        with open(path, "rb") as file:
            original = file.read(FILE_BYTES + 1)
        text = original.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if len(original) > FILE_BYTES:
        return None
    try:
        if path.endswith((".csv", ".tsv")):
            new = _rewrite_table(text, logged, "\t" if path.endswith(".tsv") else ",")
        else:
            new = rewrite_text(text, logged)[0]
    except (csv.Error, ValueError, OverflowError):
        return None
    return (original, new.encode("utf-8")) if new != text else None


def written(places: Iterable[Any], since: Optional[float] = None,
            suffixes: Optional[tuple[str, ...]] = SUFFIXES) -> list[str]:
    """The text files (``suffixes``; any file: ``None``, :mod:`.logger_files`) at or under ``places`` (paths: files
    or folders) changed since ``since`` (any time: ``None``), within the bounds of the module docstring."""
    found: list[str] = []
    folders: list[tuple[str, int]] = []
    total = 0

    def take(path: str, size: int, mtime: float) -> None:
        nonlocal total
        if ((suffixes is None or path.endswith(suffixes)) and size <= FILE_BYTES and total + size <= BYTES
                and len(found) < FILES and (since is None or mtime >= since) and path not in found):
            found.append(path)
            total += size

    for place in places:
        path = os.fspath(place) if isinstance(place, os.PathLike) else place
        if not isinstance(path, str) or not path or "\n" in path:
            continue
        try:
            stat = os.stat(path)
        except (OSError, ValueError):
            continue
        if os.path.isdir(path):
            folders.append((path, 0))
        else:
            take(path, stat.st_size, stat.st_mtime)
    seen: set[str] = set()
    while folders and len(seen) < FOLDERS:
        folder, level = folders.pop(0)
        if os.path.realpath(folder) in seen:
            continue
        seen.add(os.path.realpath(folder))
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    if level + 1 < LEVELS and entry.name not in _SKIPPED:
                        folders.append((entry.path, level + 1))
                elif entry.is_file():
                    stat = entry.stat()
                    take(entry.path, stat.st_size, stat.st_mtime)
            except OSError:
                continue
    return found


def replace(path: str, content: bytes) -> None:
    """``path`` holds ``content``: written beside it, then put in its place in one step."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".moved-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        if os.path.exists(path):
            os.chmod(temporary, os.stat(path).st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
