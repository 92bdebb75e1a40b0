"""Weights derived from a private fit: on the cone its path spans (accounting/module_ledgers.py's third test).

A fit's releases live on in weights computed from its states, not only in its last ones: an EMA or
``torch.optim.swa_utils.AveragedModel`` of the weights kept by a callback, a snapshot saved mid-fit by the user's
code, a point between start and end, a shrink-and-perturb warm start (``0.5·w + noise``), a task vector
``w_pre + λ·(w_ft − w_pre)``. Each is (nearly) a combination ``a·start + Σ cᵢ·(sᵢ − start)`` of the fit's starting
weights and of its states sᵢ along the way: :class:`PathSketches` keeps a few sketches of those states while the fit
runs (at every ``interval``-th release, the interval doubled whenever more than :data:`KEPT_STATES` are held, so any
fit keeps at most that many, spread over it), and :func:`follows` decides, for the weights a module holds *when it is
attached* (before the new fit moves them), whether they lie on or near that cone with a clear component along the
fit's own move.

What is not taken: a fresh module seeded as the fit was (it *is* the start: no component along the move), a fresh
module seeded otherwise or weights moved their own way (far from a cone of a few directions in the sketch's
positions: the residual is most of the weights), weights moved the other way or much farther than the fit went.
What it cannot tell: weights trained publicly from the fit's start so that they land on that cone (their move the
fit's own directions, within :data:`RESIDUAL` of them) are taken for the fit's (an over-count, safe for privacy).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

KEPT_STATES = 8
"""The most intermediate states a fit keeps per parameter (the interval between them doubles beyond)."""
RESIDUAL = 0.25
"""Weights derived from a fit lie within this fraction of the move they hold from its cone (relative distance)."""
ALONG = 0.05
"""The least component along the fit's own move (start → end), as a fraction of that move, weights must hold."""
FARTHEST = 3.0
"""Weights holding more than this many times the fit's largest move (a task vector scaled beyond) are not taken."""


class PathSketches:
    """Sketches of a fit's trainable parameters along the way: a listener of its ledger
    (:meth:`~lightning_dp.accounting.ledger.PrivacyLedger.listen`) that samples them at every ``interval``-th
    release, keeping at most :data:`KEPT_STATES` (spread evenly over the fit)."""

    def __init__(self, params: list[Tensor], sample: Callable[[list[Tensor]], list[Tensor]]) -> None:
        self.params = params
        self.sample = sample
        self.count = 0
        self.interval = 1
        self.states: list[tuple[int, dict[int, Tensor]]] = []

    def __call__(self, steps: int) -> None:
        before, self.count = self.count, self.count + steps
        if not self.params or self.count // self.interval == before // self.interval:
            return
        self.states.append((self.count, dict(zip(map(id, self.params), self.sample(self.params)))))
        while len(self.states) > KEPT_STATES:
            self.interval *= 2
            kept = [s for s in self.states if s[0] // self.interval != (s[0] - 1) // self.interval]
            self.states = kept if len(kept) < len(self.states) else self.states[1::2]

    def of(self, p: Tensor) -> tuple[Tensor, ...]:
        """The sketches of ``p`` held so far, oldest first."""
        return tuple(state[id(p)] for _, state in self.states if id(p) in state)


def follows(here: Tensor, start: Tensor, *paths: tuple[Tensor, ...]) -> bool:
    """Whether weights ``here`` (a sketch) lie on the cone of fits that started at ``start`` and went through the
    states of each of ``paths`` (its last the end; all at the same positions; two paths: a soup of two fits from one
    start): fitted as ``a·start + Σ cᵢ·(sᵢ − start)`` (least squares, over at most a quarter as many moves as
    positions: each path's end and the states nearest ``here``), the part ``uₖ`` each path's moves explain
    holds at least :data:`ALONG` of that fit's own move along it and at most :data:`FARTHEST` times its largest
    move, and what is left is within :data:`RESIDUAL` of ``Σ uₖ``. ``here`` equal to ``start`` (a fresh module
    seeded alike) holds no move; weights of their own leave most of themselves outside the cone."""
    fitted = fit_path(here, start, paths)
    return fitted is not None and fitted[0] <= RESIDUAL * fitted[1]


_THREADS = threading.Lock()
_HELD = {"entered": 0, "threads": 1}


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one while inside (restored when the last caller leaves): for matching a module
    against many fits (module_ledgers.derived). Each :func:`fit_path` inverts a design of a few columns and at most 64
    rows, which one thread does in a tenth of a millisecond, while several threads on a loaded machine wait for each
    other at every parallel region of the SVD: tens of milliseconds per pseudo-inverse, and 18 s for a fit's start
    matched against a store of 256 fits (benchmarks/store_lookup.py, docs/results/performance_log.md). What is found
    is the same (the values may differ in their last bits, as they do between machines of other thread counts)."""
    with _THREADS:
        if not _HELD["entered"]:
            _HELD["threads"] = torch.get_num_threads()
            if _HELD["threads"] > 1:
                torch.set_num_threads(1)
        _HELD["entered"] += 1
    try:
        yield
    finally:
        with _THREADS:
            _HELD["entered"] -= 1
            if not _HELD["entered"] and _HELD["threads"] > 1:
                torch.set_num_threads(_HELD["threads"])


def fit_path(here: Tensor, start: Tensor, paths: tuple[tuple[Tensor, ...], ...]) -> Optional[tuple[float, float]]:
    """(what the cone leaves of ``here``, the size of the moves it holds), or ``None`` when it holds too little or
    too much of some fit's move (:func:`follows`, which bounds the first by :data:`RESIDUAL` of the second)."""
    n = here.numel()
    if not paths or n < 4 or any(not path for path in paths) or torch.equal(here, start):
        return None
    if not bool(torch.isfinite(here).all()):
        return None
    most = max(1, n // (4 * len(paths)))
    columns, spans = [start[:, None]], []
    for states in paths:
        if len(states) > most:  # the end, and the states nearest the weights (a snapshot's, an EMA's latest)
            nearest = torch.stack([(s - here).norm() for s in states[:-1]]).argsort()[:most - 1].sort().values
            states = (*(states[i] for i in nearest.tolist()), states[-1])
        columns.append(torch.stack([s - start for s in states], 1))
        spans.append(len(states))
    design = torch.cat(columns, 1)
    coef = torch.linalg.pinv(design) @ here
    held_all = torch.zeros_like(here)
    first = 1
    for moves, width in zip(columns[1:], spans):
        held = moves @ coef[first:first + width]
        first += width
        total = moves[:, -1]
        scale = float(total.norm())
        if scale == 0.0 or float(held @ total) < ALONG * scale * scale:
            return None
        if float(held.norm()) > FARTHEST * float(moves.norm(dim=0).max()):
            return None
        held_all += held
    return float((here - design @ coef).norm()), float(held_all.norm())
