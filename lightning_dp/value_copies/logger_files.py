"""The files a user's logger wrote since the fit began, set apart for a run of the user's hooks and put back after.

A logger rebuilt from its state at the fit's start (:mod:`.refed_loggers`) writes its files again as it is re-fed;
they must start as they were at the fit's start, whatever it keeps there (a ``.npy`` array, pickled bytes, text).
:class:`LoggerFiles` keeps the bytes of the files at or under the logger's paths when the fit begins and, for each
run (:meth:`LoggerFiles.set_apart`), sets apart **any** file there (binary too) changed since: its bytes kept, the
file given its bytes at the fit's start (removed if it was not there); after the run every file set apart is put back
(an atomic replace), every file made meanwhile removed, and a file unchanged since the fit's start that the run
changed given its bytes again.

Looked at as :func:`.text_files.written` looks (3 folders deep, hidden folders and ``checkpoints`` skipped, at most
200 files of 4 MiB each and 16 MiB in all, those bounds applying to the files kept at the fit's start and to those set
apart at each run alike): a file past them is left as it is (the re-fed logger then writes after its real contents).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from lightning_dp.value_copies.text_files import BYTES, FILE_BYTES, replace, written

__all__ = ["LoggerFiles"]

Stat = tuple[int, int]  # size, mtime in nanoseconds


def _read(path: str) -> Optional[bytes]:
    """The bytes of the file at ``path`` (``None`` if it cannot be read, or past :data:`.text_files.FILE_BYTES`)."""
    try:
        with open(path, "rb") as file:
            data = file.read(FILE_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= FILE_BYTES else None


def _stats(paths: list[str]) -> dict[str, Stat]:
    out: dict[str, Stat] = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        out[path] = (stat.st_size, stat.st_mtime_ns)
    return out


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class LoggerFiles:
    """The files at or under the paths ``places()`` names, as they were when made (the fit's start) and since
    ``since`` (a time: files changed from then on are the fit's)."""

    def __init__(self, places: Callable[[], list[str]], since: float) -> None:
        self.places = places
        self.since_ns = int(since * 1e9)
        self.at_start: dict[str, bytes] = {}
        self.listed = set(written(places(), None, None))
        total = 0
        for path in sorted(self.listed):
            data = _read(path)
            if data is not None and total + len(data) <= BYTES:
                self.at_start[path] = data
                total += len(data)

    def changed(self) -> bool:
        """Whether a file there was changed since the fit began (or made)."""
        return any(self._changed(path, stat) for path, stat in _stats(written(self.places(), None, None)).items())

    def _changed(self, path: str, stat: Stat) -> bool:
        return stat[1] >= self.since_ns or path not in self.listed

    @contextmanager
    def set_apart(self) -> Iterator[None]:
        """Inside, the files read as at the fit's start; after, as before (module docstring)."""
        places = self.places()
        listed = _stats(written(places, None, None))
        apart: dict[str, bytes] = {}
        total = 0
        try:
            for path, stat in listed.items():
                if not self._changed(path, stat) or (path in self.listed and path not in self.at_start):
                    continue  # as at the fit's start, or its bytes then past the bounds: left as it is
                data = _read(path)
                if data is None or total + len(data) > BYTES:
                    continue  # past the bounds: left as it is
                apart[path] = data
                total += len(data)
                if path in self.at_start:
                    replace(path, self.at_start[path])
                else:
                    _remove(path)
            yield
        finally:
            for path in written(places, None, None):
                if path not in listed:
                    _remove(path)  # made by the re-fed logger or the run
            for path, data in apart.items():
                replace(path, data)
            for path, stat in listed.items():
                if path not in apart and path in self.at_start and _stats([path]).get(path) != stat:
                    replace(path, self.at_start[path])
