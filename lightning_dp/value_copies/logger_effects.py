"""What a user's logger did outside its copied state while it logged: the files it wrote anywhere, set apart for each
run that feeds it again, and what cannot be set apart (a socket, a process).

A logger rebuilt for a run (:mod:`.refed_loggers`) is fed again the calls it received, with the logged values moved;
its attributes are a copy and its files under its own paths are set apart (:mod:`.logger_files`), but its calls may
write elsewhere too: a sqlite database outside its folder that keeps the first row per step, a text file with one line
per step, a file in a hidden folder or four folders deep. Fed again into the real store, the moved values are ignored
(the run reads the real ones: a decision from them is not seen) or left there (the user's records corrupted).

So while a recorded call runs (:meth:`Effects.recording`, on its thread only), a Python audit hook
(:func:`sys.addaudithook`, installed once, when the first :class:`Effects` is made: nothing is watched in a fit
without a user's logger) sees what the call does: a file opened for writing (``open``, ``os.open``), renamed,
removed, truncated or linked, a sqlite database connected (with its ``-wal``, ``-journal`` and ``-shm`` siblings).
Each path, at the first such event, is copied as it is before it (the fit's start for this logger; absent, if so). For
each run (:meth:`Effects.set_apart`) every such path's real contents are copied aside and the path given its contents
before the first write; while the logger is fed again (:meth:`Effects.replaying`) a path it writes that the real
calls did not is copied aside too; after the run, on an exception or a refusal alike, every path set aside is given
its real contents again (an atomic replace, its time stamps kept), every path absent before removed, every folder the
run made removed when empty.

What cannot be set apart — a socket connected or sent on, an HTTP or URL request, a process started or forked, a
shell command, a folder tree removed, a path named relative to a folder descriptor, files past :data:`BYTES` in all —
is noted (:attr:`Effects.undoable`, the first one): fed again, the logger would do it again with the moved values,
so it is not fed again (:mod:`.refed_loggers` refuses the decision to be judged); in a run it is blocked (a
``PermissionError`` raised in its place) and noted. Not seen: writes that raise no audit event (made by C code:
``torch.save`` to a path, HDF5, a sqlite connection or a file opened before the call and kept, a thread the logger
starts writing after the call returned), and what its other methods (``log_hyperparams``, ``finalize``) write.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import weakref
from _thread import get_ident
from contextlib import contextmanager
from typing import Any, Iterator, Optional

__all__ = ["BYTES", "Effects"]

BYTES = 256 << 20
"""The bytes of the paths one logger wrote that are copied at most (at their first write, and at each run)."""

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_UNDOABLE = {"socket.connect": "connected a socket", "socket.sendto": "sent on a socket",
             "socket.sendmsg": "sent on a socket", "http.client.connect": "opened an HTTP connection",
             "urllib.Request": "made a URL request", "ftplib.connect": "opened an FTP connection",
             "smtplib.connect": "opened an SMTP connection", "subprocess.Popen": "started a process",
             "os.system": "ran a shell command", "os.exec": "ran a program", "os.posix_spawn": "started a process",
             "os.spawn": "started a process", "os.fork": "forked the process", "os.forkpty": "forked the process",
             "shutil.rmtree": "removed a folder tree", "webbrowser.open": "opened a browser"}
_SIBLINGS = ("", "-wal", "-journal", "-shm")  # a sqlite database's files

_WATCHING: dict[int, tuple[Effects, str, Optional[bool]]] = {}  # thread -> its effects, method, in a run (None:
# a call the run's hooks make: its writes set apart, nothing blocked)
_ROOT: list[str] = []  # the folder of the copies (made once)
_INSTALLED: list[bool] = []


class Effects:
    """One logger's writes outside its copied state (module docstring)."""

    def __init__(self, limit: int = BYTES) -> None:
        _install()
        self.limit = limit
        self.first: dict[str, Optional[str]] = {}  # path -> its copy before the first write (None: absent)
        self.undoable: Optional[str] = None  # what it did that cannot be set apart, and in which method
        self.copied = 0  # the bytes of the copies before the first writes
        self._run_bytes = 0  # of the copies of one run's real contents
        self._saved: Optional[dict[str, Optional[str]]] = None  # in a run: path -> its real contents' copy
        self._made: list[str] = []  # folders a run made
        self._folder: Optional[str] = None
        self._count = 0

    def wrote(self) -> bool:
        """Whether a recorded call wrote a path (besides what it did that cannot be set apart)."""
        return bool(self.first)

    @contextmanager
    def recording(self, method: str) -> Iterator[None]:
        """Inside (a real call of ``method``, on this thread), each path first written is copied as it was."""
        with _watched(self, method, False):
            yield

    @contextmanager
    def set_apart(self, start: bool = True) -> Iterator[None]:
        """Inside, the paths the real calls wrote hold their contents before the first write (``start``: else as they
        are); after, and those :meth:`replaying` wrote, their real contents (module docstring)."""
        outer, self._saved, self._made, self._run_bytes = (self._saved, self._made), {}, [], 0
        try:
            for path in self.first if start else ():
                self._save(path)
                _put(path, self.first[path])
            yield
        finally:
            saved, made = self._saved, self._made
            self._saved, self._made = outer
            error = _put_back(saved, made)
            if error is not None:
                raise error

    @contextmanager
    def replaying(self, method: str = "log_metrics", block: bool = True) -> Iterator[None]:
        """Inside (the logger fed again, inside :meth:`set_apart`), a path written is copied aside first, and what
        cannot be set apart is blocked (``PermissionError``) and noted (``block`` false: a call the run's hooks make,
        left to them)."""
        with _watched(self, method, True if block else None):
            yield

    def _event(self, event: str, args: tuple, method: str, run: Optional[bool]) -> None:
        """An audited event of a watched call."""
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writes = isinstance(mode, str) and any(c in mode for c in "wax+")
            if writes or (isinstance(flags, int) and flags & _WRITES):
                self._wrote([path], (), method, run)
        elif event == "os.rename" or event == "os.link":
            self._wrote(list(args[:2]), args[2:4], method, run)
        elif event == "os.symlink":
            self._wrote([args[1]], args[2:3], method, run)
        elif event == "os.remove" or event == "os.truncate":
            self._wrote([args[0]], args[1:2] if event == "os.remove" else (), method, run)
        elif event == "sqlite3.connect":
            database = args[0] if args else None
            if isinstance(database, (str, bytes, os.PathLike)):
                name = os.fsdecode(database)
                if name.startswith("file:"):
                    name = name[5:].split("?")[0].removeprefix("//")
                if name and name != ":memory:":
                    self._wrote([name + suffix for suffix in _SIBLINGS], (), method, run)
        elif event == "os.mkdir" and run and self._saved is not None and args:
            path = _absolute(args[0])
            if path is not None and not os.path.exists(path):
                self._made.append(path)
        elif event in _UNDOABLE and run is not None:
            self._cannot(_UNDOABLE[event], method, run)

    def _wrote(self, paths: list[Any], folders: tuple, method: str, run: Optional[bool]) -> None:
        if any(f is not None for f in folders) and run is not None:
            self._cannot("named a file relative to a folder descriptor", method, run)
            return
        for path in (_absolute(p) for p in paths):
            if path is None or (os.path.lexists(path) and not os.path.isfile(path)):
                continue  # a descriptor, a device, a folder
            if run or run is None:
                if self._saved is not None and path not in self._saved:
                    self._save(path, method, run is not None)
            elif path not in self.first and self.undoable is None:
                if not os.path.lexists(path):
                    self.first[path] = None
                elif self.copied + os.path.getsize(path) > self.limit:
                    self._cannot(f"wrote files of over {self.limit >> 20} MiB in all", method, False)
                else:
                    self.copied += os.path.getsize(path)
                    self.first[path] = self._copy(path)

    def _save(self, path: str, method: str = "a run", block: bool = True) -> None:
        """``path``'s real contents copied aside for this run (past :data:`BYTES`: blocked, noted)."""
        assert self._saved is not None
        if os.path.lexists(path):
            size = os.path.getsize(path)
            if self._run_bytes + size > self.limit and block:
                self._cannot(f"wrote files of over {self.limit >> 20} MiB in all", method, True)
            self._run_bytes += size
        self._saved[path] = self._copy(path)

    def _copy(self, path: str) -> Optional[str]:
        """A copy of ``path`` (``None``: absent)."""
        if not os.path.lexists(path):
            return None
        if self._folder is None:
            if not _ROOT:
                _ROOT.append(tempfile.mkdtemp(prefix="lightning_dp-logger-effects-"))
                atexit.register(shutil.rmtree, _ROOT[0], True)  # (the process's copies go with it)
            self._folder = tempfile.mkdtemp(dir=_ROOT[0])
            weakref.finalize(self, _quietly, shutil.rmtree, self._folder, True)
        self._count += 1
        copy = os.path.join(self._folder, str(self._count))
        shutil.copy2(path, copy)
        return copy

    def _cannot(self, what: str, method: str, run: bool) -> None:
        if self.undoable is None:
            self.undoable = f"{what} in {method}"
        if run:
            raise PermissionError(f"lightning_dp: a logger {what} while fed again with the logged values moved: "
                                  "not done (docs/release_boundary.md, rule 6)")


def _install() -> None:
    """The audit hook, once per process (it cannot be removed: inactive, it returns at once)."""
    if not _INSTALLED:
        sys.addaudithook(_audit)
        _INSTALLED.append(True)


def _audit(event: str, args: tuple) -> None:
    """The audit hook: an event of a watched call, told to its logger's :class:`Effects`."""
    if not _WATCHING:
        return
    thread = get_ident()
    entry = _WATCHING.get(thread)
    if entry is None:
        return
    del _WATCHING[thread]  # its own file operations are not watched
    try:
        effects, method, run = entry
        try:
            effects._event(event, args, method, run)
        except PermissionError:
            raise
        except Exception:  # noqa: BLE001  (a path that could not be copied: it cannot be set apart)
            if run is not None:
                effects._cannot("wrote a file that could not be copied", method, run)
    finally:
        _WATCHING[thread] = entry


@contextmanager
def _watched(effects: Effects, method: str, run: bool) -> Iterator[None]:
    thread = get_ident()
    outer = _WATCHING.get(thread)
    _WATCHING[thread] = (effects, method, run)
    try:
        yield
    finally:
        if outer is None:
            _WATCHING.pop(thread, None)
        else:
            _WATCHING[thread] = outer


def _quietly(function: Any, *args: Any) -> None:
    """``function(*args)`` unwatched (a finalizer may run inside a watched call)."""
    thread = get_ident()
    entry = _WATCHING.pop(thread, None)
    try:
        function(*args)
    finally:
        if entry is not None:
            _WATCHING[thread] = entry


def _absolute(path: Any) -> Optional[str]:
    """``path`` made absolute (``None``: a descriptor, or a copy of this module's own)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    name = os.path.abspath(os.fsdecode(path))
    return None if _ROOT and name.startswith(_ROOT[0] + os.sep) else name


def _put(path: str, copy: Optional[str]) -> None:
    """``path`` holds ``copy``'s contents and time stamps (an atomic replace), or is removed (``None``)."""
    if copy is None:
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".lightning_dp-")
    os.close(handle)
    try:
        shutil.copy2(copy, temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _put_back(saved: dict[str, Optional[str]], made: list[str]) -> Optional[BaseException]:
    """Every path ``saved`` given its real contents again, the folders ``made`` removed when empty; the first error
    (every path is tried)."""
    error: Optional[BaseException] = None
    for path, copy in saved.items():
        try:
            _put(path, copy)
        except OSError as failed:
            error = error or failed
        if copy is not None:
            try:
                os.remove(copy)
            except OSError:
                pass
    for folder in reversed(made):
        try:
            os.rmdir(folder)
        except OSError:
            pass
    return error
