"""Freed CPU memory kept for the next step: a private step on CPU without a page fault per step (issue 38).

A private step allocates and frees the same large temporaries every step (the per-example gradients of a
convolution, its oneDNN scratch buffers, the norms' work space). glibc's ``malloc`` serves blocks above its *mmap
threshold* with fresh ``mmap`` pages and returns them at ``free``, and gives back the top of its heap once more
than its *trim threshold* is free there; both thresholds adapt, but to the allocation history of the whole process.
Under some histories every step then re-faults megabytes of zeroed pages: measured on this repository's 2-vCPU
machine (docs/performance.md), the digits CNN's private step alone in its process took 1,279 page faults and
1.4 ms of system time per step, 6.3 ms in all; with the thresholds below, 0–2 faults and 3.9 ms (the
non-private step, 2.3 ms, faulted neither way). The same process with Opacus' ghost clipping in it had faulted
less, by chance of the history.

:func:`retain_freed_memory` fixes both thresholds (``mallopt``: :data:`MMAP_THRESHOLD` and
:data:`TRIM_THRESHOLD`), so that blocks up to 32 MiB come from the heap and up to 128 MiB of freed heap stays
with the process for the next step instead of going back to the kernel. The cost is memory the process keeps
after its peak (at most the trim threshold above what it uses), as with jemalloc or tcmalloc, which PyTorch's
CPU performance guide recommends for the same reason. It changes how the process allocates, never what is
computed; nothing about privacy depends on it.

A private step applies it once per process when it attaches to a model with parameters on the CPU
(``ExecutionConfig.retain_cpu_memory``, default on; ``DPStrategy(retain_cpu_memory=False)`` or
``PrivateStep(retain_cpu_memory=False)`` leave the allocator alone). Only glibc is tuned: under another C library,
or with jemalloc/tcmalloc preloaded, nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks below this many bytes come from the heap (glibc's own ceiling for its adaptive threshold)."""
TRIM_THRESHOLD = 128 << 20
"""Freed memory at the top of the heap kept for reuse up to this many bytes."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_lock = threading.Lock()
_applied: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc with ``mallopt``, else ``None``."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        libc.mallopt  # noqa: B018  (present, or AttributeError)
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc if version() else None


def preloaded_allocator() -> str | None:
    """The allocator preloaded into the process (``LD_PRELOAD``) that replaces glibc's ``malloc``, if any."""
    preload = os.environ.get("LD_PRELOAD", "")
    return next((name for name in _PRELOADED_ALLOCATORS if name in preload), None)


def retain_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD` (module
    docstring), once per process. Returns whether they are set (``False`` under another C library, with a
    preloaded allocator, or where ``mallopt`` refused)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    other = preloaded_allocator()
    libc = None if other else _glibc()
    if libc is None:
        log.debug("CPU allocator left as it is (%s)", f"{other} preloaded" if other else "not glibc")
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                   TRIM_THRESHOLD))
    if ok:
        log.info("glibc malloc keeps freed memory for the next step (mmap threshold %d MiB, trim threshold %d MiB; "
                 "retain_cpu_memory=False leaves it alone)", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok
