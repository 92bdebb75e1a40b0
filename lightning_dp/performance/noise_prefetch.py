"""Noise off the critical path: the next step's unit noise is drawn while the current step runs.

The noise z_t ~ N(0, I_d) of step t depends on no data, so nothing forces it to be drawn at the release: a
:class:`NoisePrefetcher` draws it during step t − 1's forward and backward instead. On this repository's CPU,
``normal_`` costs ≈ 4 ns per coordinate, about a third of a private MLP step (issue 38); prefetched, the release
only adds the numbers already drawn.

**What is prefetched.** A noise mechanism (:class:`~lightning_dp.privacy.noise.GaussianNoise`,
:class:`~lightning_dp.privacy.csprng.SecureGaussianNoise`, the source of
:class:`~lightning_dp.privacy.banded_noise.BandedToeplitzNoise`) describes each noise call of a release by a
*call key*: a hashable description of the draws it makes (their devices, dtypes, sizes, standard deviation) from
which the draws follow, in distribution, exactly as the call would make them itself. A release is a sequence of
calls (the privatizer's :meth:`~lightning_dp.privacy.noise.NoiseMechanism.step`); when it ends, the same sequence
of keys is handed to :meth:`NoisePrefetcher.submit`, which draws them for the next release, in the same order and
from the same generators as the calls would (so a seeded test stream is the same sequence with or without
prefetching). The next release's calls :meth:`~NoisePrefetcher.take` them one by one.

**The guarantee kept.** Each prefetched draw is handed out at most once (taken from the prefetcher's slot, which
then forgets it), and only to a call with an equal key: the same shapes, dtypes, devices and standard deviation. A
draw that is not taken is dropped, never kept for later: a call whose key differs (a changed parameter set, shape,
dtype or device, another σ) drops the rest of the job and draws afresh; :meth:`~NoisePrefetcher.discard` drops
everything (a refused or unaffordable step, a step that raised, an engine switch, a restored checkpoint: the
private step calls it); a release that took fewer calls than were drawn drops the rest at the next submit. Nothing
is kept on tensors or in checkpoints (noise RNGs are never saved: replayed noise would leak gradients).

**Lifecycle of the worker.** CPU draws run in one daemon thread per prefetcher, started lazily by the first
:meth:`~NoisePrefetcher.submit` (torch releases the GIL inside ``normal_``, and ``os.urandom`` does too for the
secure draws, so the draw runs beside the training thread's work). It runs one job at a time and waits otherwise.
:meth:`~NoisePrefetcher.close` (the private step's ``detach``, at a strategy's teardown) joins it; a later submit
starts a new one. An atexit handler closes every live prefetcher before the interpreter finalises (a thread
re-entering Python during finalisation aborts the process). A forked child never inherits a job: the prefetcher
starts empty in a new process. An exception in the worker is kept and raised by the next
:meth:`~NoisePrefetcher.take` (its draws are dropped). CUDA draws need no thread: they are launched on a side
stream at submit (the launch returns at once), and the taking stream waits on an event recorded after them;
each draw is marked as used by the taking stream (``record_stream``) so the allocator never hands its memory out
while that stream still reads it.

**When.** A worker thread only helps when a CPU is free to run it: when torch's intra-op threads already take
every CPU this process may run on, the worker would only take turns with them (measured: no gain at 2 threads on
this repository's 2-core machine, and a worse spread); and handing a small draw to a thread costs more than
drawing it (the digits CNN's 10k coordinates: 0.1 ms of ``normal_``, slower ahead). So ``prefetch="auto"`` (the
mechanisms' default) draws ahead on CPU only while ``torch.get_num_threads()`` is below the CPUs the process may
use (:func:`spare_cpu`, asked at every release) and the release draws at least :data:`MIN_AHEAD` numbers, and
always on CUDA (a side stream costs no CPU); ``True`` always, ``False`` never.
Either way the draws are the same calls in the same order: the choice changes when a draw is made, never what.

**Cost.** The prefetched draws of a step are held until the next release: d numbers in the gradients' dtype
(the mechanism draws one model-sized noise tensor ahead instead of into a small scratch buffer).

One training thread drives a prefetcher (the release is not thread-safe either).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_dp.bound_torch import TB
from lightning_dp.sealed_noise import seal

CallKey = Hashable
"""What one noise call draws (devices, dtypes, sizes, standard deviation): equal keys, equal draws in distribution."""

DrawFn = Callable[[CallKey], list[Tensor]]
"""Makes the draws of one call key (in the order the call itself makes them)."""

_LIVE: "weakref.WeakSet[NoisePrefetcher]" = weakref.WeakSet()

MIN_AHEAD = 1 << 16
"""Numbers a release must draw for ``prefetch="auto"`` to draw them ahead on CPU (≈ 0.2 ms of ``normal_`` here)."""

Prefetch = Union[bool, str]
"""``"auto"`` (draw ahead where it pays: :func:`spare_cpu` on CPU, always on CUDA), ``True`` or ``False``."""


def spare_cpu() -> bool:
    """Whether a CPU is left for the worker: torch's intra-op threads fewer than the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return torch.get_num_threads() < cpus


def check_prefetch(prefetch: Any) -> Prefetch:
    """``prefetch`` if it is ``"auto"``, ``True`` or ``False``, else ``ValueError``."""
    if not (prefetch is True or prefetch is False or prefetch == "auto"):
        raise ValueError(f"prefetch must be 'auto', True or False, got {prefetch!r}")
    return prefetch


@dataclass
class _Job:
    """The draws of one release's calls, made ahead: ``draws[i]`` for ``keys[i]`` once ``done`` is set."""

    keys: list[CallKey]
    draw: DrawFn
    draws: list[Optional[list[Tensor]]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    taken: int = 0
    event: Any = None  # CUDA event recorded on the side stream after the draws (stream mode)


class NoisePrefetcher:
    """Draws the keys of one release ahead of the next (module docstring: what, when, and what is never reused)."""

    def __init__(self) -> None:
        self._setup()

    def _setup(self) -> None:
        self._pid = os.getpid()
        self._job: Optional[_Job] = None
        self._worker: Optional[_Worker] = None
        self._streams: dict[torch.device, Any] = {}
        _LIVE.add(self)

    # copies (deepcopy, pickling for a spawned process) start empty: a draw never exists in two places
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup()

    @property
    def pending(self) -> int:
        """Calls drawn ahead and not taken yet (0: nothing is held)."""
        self._check_process()
        job = self._job
        return 0 if job is None else len(job.keys) - job.taken

    # ------------------------------------------------------------------ the training thread's side
    def submit(self, keys: Sequence[CallKey], draw: DrawFn, stream_device: Optional[torch.device] = None) -> None:
        """Draw ``keys`` (each by ``draw``) for the next release: in the worker thread, or launched on a side CUDA
        stream of ``stream_device``. Anything still held from before is dropped first."""
        self.discard()
        if not keys:
            return
        job = _Job(list(keys), draw)
        if stream_device is not None and stream_device.type == "cuda":
            self._launch_on_side_stream(job, stream_device)
        else:
            if self._worker is None or not self._worker.alive:
                self._worker = _Worker()
            self._worker.put(job)
        self._job = job

    def take(self, key: CallKey) -> Optional[list[Tensor]]:
        """The draws made ahead for ``key`` if the next call drawn ahead has this very key (then forgotten here:
        handed out once); otherwise ``None`` and everything held is dropped (the caller draws afresh)."""
        self._check_process()
        job = self._job
        if job is None:
            return None
        job.done.wait()
        if job.error is not None:
            self._job = None
            raise RuntimeError("drawing the next step's noise ahead failed in the prefetch worker") from job.error
        if job.keys[job.taken] != key:
            self._job = None
            return None
        draws = job.draws[job.taken]
        job.draws[job.taken] = None
        job.taken += 1
        if job.taken == len(job.keys):
            self._job = None
        assert draws is not None
        if job.event is not None:
            self._follow_side_stream(job, draws)
        return draws

    def discard(self) -> None:
        """Drop every draw held (waits for a job in flight first: its generators are then free again)."""
        self._check_process()
        job, self._job = self._job, None
        if job is not None:
            job.done.wait()
            job.draws.clear()

    def close(self) -> None:
        """Drop everything and join the worker thread (a later :meth:`submit` starts a new one)."""
        self.discard()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    # ------------------------------------------------------------------ CUDA: a side stream, no thread
    def _launch_on_side_stream(self, job: _Job, device: torch.device) -> None:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            _run(job)
            job.event = torch.cuda.Event()
            job.event.record(stream)

    @staticmethod
    def _follow_side_stream(job: _Job, draws: list[Tensor]) -> None:
        """The taking stream waits for the side stream's draws, and the allocator learns it reads them."""
        for device in {t.device for t in draws if t.device.type == "cuda"}:
            current = torch.cuda.current_stream(device)
            current.wait_event(job.event)
            for t in draws:
                if t.device == device:
                    TB.record_stream(t, current)  # (torch's own method: bound_torch.py)

    def _check_process(self) -> None:
        """A forked child starts empty (the parent's thread and job are not its own)."""
        if self._pid != os.getpid():
            self._setup()


class DrawsAhead:
    """What a noise mechanism adds to draw ahead (a mixin of :class:`~lightning_dp.privacy.noise.NoiseMechanism`
    subclasses): :meth:`step` brackets one release's calls, :meth:`_ahead` hands each call its draws made ahead.

    A subclass calls :meth:`_init_ahead` in its ``__init__`` and implements :meth:`_draw_key` (the draws of one call
    key, made exactly as the call would make them itself)."""

    _prefetcher: Optional[NoisePrefetcher] = None
    _calls: Optional[list[CallKey]] = None

    def _init_ahead(self, prefetch: Prefetch) -> None:
        self.prefetch = check_prefetch(prefetch)
        """Whether the next release's noise is drawn during the current step
        (:mod:`~lightning_dp.performance.noise_prefetch`):
        ``"auto"``, ``True`` or ``False``."""
        self._prefetcher = NoisePrefetcher() if prefetch is not False else None
        self._calls = None

    def _draw_key(self, key: CallKey) -> list[Tensor]:
        raise NotImplementedError

    def _stream_device(self, keys: Sequence[CallKey]) -> Optional[torch.device]:
        """The CUDA device whose side stream draws ``keys`` (``None``: the worker thread draws them)."""
        return None

    def _numel(self, keys: Sequence[CallKey]) -> int:
        """How many numbers ``keys`` draw."""
        raise NotImplementedError

    def _pays(self, keys: Sequence[CallKey]) -> bool:
        """Whether ``prefetch="auto"`` draws ``keys`` ahead on the CPU: a CPU is free and the draw is large enough."""
        return spare_cpu() and self._numel(keys) >= MIN_AHEAD

    @contextmanager
    def step(self) -> Iterator[None]:
        """One release's noise calls: inside, each call takes its draws made during the previous step (when its key
        matches); on a normal exit the same calls are drawn ahead for the next release; an exception inside drops
        every draw held. Nested steps belong to the outermost."""
        prefetcher = self._prefetcher
        if prefetcher is None or self._calls is not None:
            yield
            return
        self._calls = []
        try:
            yield
        except BaseException:
            self._calls = None
            prefetcher.discard()
            raise
        calls, self._calls = self._calls, None
        stream = self._stream_device(calls)
        if self.prefetch == "auto" and stream is None and not self._pays(calls):
            return  # no CPU free for a worker, or too little to draw: the next release draws at its calls
        prefetcher.submit(calls, self._draw_key, stream)

    def _ahead(self, key: CallKey) -> Optional[list[Tensor]]:
        """Inside :meth:`step`: the draws made ahead for ``key``, or ``None`` (draw now); the key is recorded for the
        next release. Outside: ``None``, after dropping anything held (a draw at the call must not race the worker
        for the generators, and a draw made ahead is for a release only)."""
        prefetcher = self._prefetcher
        if prefetcher is None:
            return None
        if self._calls is None:
            prefetcher.discard()
            return None
        self._calls.append(key)
        return prefetcher.take(key)

    def discard_prefetched(self) -> None:
        """Drop every draw made ahead (a step that will not be released)."""
        if self._prefetcher is not None:
            self._prefetcher.discard()

    def close(self) -> None:
        """Drop every draw made ahead and join the worker thread."""
        if self._prefetcher is not None:
            self._prefetcher.close()


class _Worker:
    """One daemon thread running jobs one at a time, in the order given; :meth:`stop` joins it."""

    def __init__(self) -> None:
        self._queue: list[Optional[_Job]] = []
        self._wake = threading.Condition()
        self.thread = threading.Thread(target=self._work, name="lightning_dp-noise-prefetch", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def put(self, job: Optional[_Job]) -> None:
        with self._wake:
            self._queue.append(job)
            self._wake.notify()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.put(None)
            self.thread.join()

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                job = self._queue.pop(0)
            if job is None:
                return
            _run(job)


def _run(job: _Job) -> None:
    """Make ``job``'s draws; an exception is kept for the next take."""
    try:
        with torch.no_grad():
            job.draws = [job.draw(key) for key in job.keys]
    except BaseException as err:  # noqa: BLE001  (surfaced at the next take)
        job.error = err
    finally:
        job.done.set()


@atexit.register
def _close_all() -> None:
    """Join every worker before the interpreter finalises (a daemon thread that re-enters Python during
    finalisation is unwound through torch's C++ frames and aborts the process)."""
    for prefetcher in list(_LIVE):
        prefetcher.close()


seal(__name__, tunable=("spare_cpu", "MIN_AHEAD"))
