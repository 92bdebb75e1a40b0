"""The ``torch.Generator`` objects the user's model and callbacks hold, treated as the global generators are.

A module may draw from its own generator (``self.gen = torch.Generator().manual_seed(0)``; augmentation noise
``x + 0.1 * torch.randn(x.shape, generator=self.gen)``, a custom dropout, a batch-end hook showing a few random
examples ``torch.randperm(n, generator=self.gen)``). Everything lightning_dp does to the global generators it does
to these too:

* the checks' passes (the first step's probe, the batch check, the replays) fork them and start every pass from the
  same state (:func:`forked`, :func:`reseed`), so two passes over the same examples draw the same numbers, and the
  step's real run draws what it would have drawn without the checks;
* every private step starts them from a seed that is a function of (the run's base seed, the step's index, the
  generator's attribute path) (:meth:`~lightning_dp.records.fresh_randomness.FreshRandomness.step`): a number of
  draws that depends on the data (``torch.randperm(n_wrong, generator=self.gen)``) cannot shift another step's draws.
  A user generator's stream is therefore not the one its own seed alone would give: as the global generators' it is
  reproducible from ``pl.seed_everything``/torch's state when the private loader is built (and the generator's own
  state when the fit starts), not from the user's ``manual_seed``.

Where they are looked for (:func:`held`): the attributes of the model and of every submodule (torch's and
Lightning's own attributes skipped), of the user's callbacks (not Lightning's or lightning_dp's), and, below them,
lists, tuples, dicts, sets and plain objects of the user's classes, to :data:`MAX_DEPTH` levels. Library objects
(an optimizer, lightning_dp's noise source and its secure generators, the trainer) are never walked into: their
generators are not the user's. Not found: a generator held only in a closure or a module-level global, or by the
dataset (a dataset's reads are seeded per record through the global generators only).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

MAX_DEPTH = 4
"""Nesting depth followed below an attribute (containers, plain objects)."""

_ATOMS = frozenset({type(None), bool, int, float, str, bytes, torch.Tensor, nn.Parameter})
"""Exact types that hold no generator (checked first: most attributes are one of them)."""

Roots = Callable[[], Sequence[Any]]
"""The objects the generators are looked for under: the model and the callbacks (asked each time: both may change)."""

_active: Optional["weakref.ref[Any]"] = None


def watch(owner: Any, roots: Roots) -> None:
    """From now on, the generators under ``roots()`` are the user's (the last private step attached wins).
    ``owner`` (the private step's :class:`~lightning_dp.records.fresh_randomness.FreshRandomness`) keeps ``roots``
    and is held weakly here: once it is gone, no generator is touched."""
    global _active
    owner.generator_roots = roots
    _active = weakref.ref(owner)


def stop() -> None:
    """No generator is the user's any more (tests)."""
    global _active
    _active = None


def held() -> list[tuple[str, torch.Generator]]:
    """(attribute path, generator) of every user-held ``torch.Generator`` (module docstring), each once (its first
    path), in a fixed order: the model's submodules, then the callbacks, each in attribute order (inside
    :func:`looked_for_once`: the answer its block began with)."""
    if _once is not None:
        if _once[0] is None:
            _once[0] = _held()
        return _once[0]
    return _held()


_once: Optional[list[Any]] = None  # [held()'s answer or None] while a looked_for_once block runs


@contextmanager
def looked_for_once() -> Iterator[None]:
    """Inside, :func:`held` walks the model and the callbacks once and answers the same list after. For the record
    checks' loops of reads before the fit (``record_checks/``: hundreds of records read one by one, each in
    ``fetch.seeded``, with only the dataset's own code running between them): a generator a dataset's read attaches
    to the model meanwhile is not forked nor reseeded by the block's later reads (it is by the steps')."""
    global _once
    outer, _once = _once, _once if _once is not None else [None]
    try:
        yield
    finally:
        _once = outer


def _held() -> list[tuple[str, torch.Generator]]:
    owner = _active() if _active is not None else None
    roots = getattr(owner, "generator_roots", None)
    if roots is None:
        return []
    try:
        objects = list(roots())
    except Exception:  # noqa: BLE001  (a root not ready yet: an unattached step)
        return []
    return find(objects)


def find(roots: Sequence[Any]) -> list[tuple[str, torch.Generator]]:
    """The walk of :func:`held` from ``roots`` (modules and callbacks)."""
    from lightning_dp.records.library_objects import framework_keys, is_library as _is_library, library_callback

    skip = framework_keys() | {"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"}
    found: dict[int, tuple[str, torch.Generator]] = {}
    seen: set[int] = set()
    globals_ = _global_generators()

    def module(m: nn.Module, path: str, depth: int) -> None:
        for name, sub in m.named_modules(remove_duplicate=True):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            items = [(k, v) for k, v in vars(sub).items() if type(v) not in _ATOMS and k not in skip]
            if items:  # a layer of torch's holds numbers and tuples of them only: no path built for it
                where = ".".join(p for p in (path, name) if p)
                for k, v in items:
                    visit(v, f"{where}.{k}" if where else k, depth)

    def visit(value: Any, path: str, depth: int) -> None:
        if type(value) in _ATOMS:  # the commonest values first: never a generator
            return
        if isinstance(value, torch.Generator):
            if id(value) not in globals_:
                found.setdefault(id(value), (path, value))
            return
        if depth > MAX_DEPTH or isinstance(value, (str, bytes, int, float, bool, torch.Tensor)):
            return
        if isinstance(value, nn.Module):
            module(value, path, depth + 1)  # a module outside the registry (in a list, on a helper object)
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for k, v in list(value.items()):
                if type(v) not in _ATOMS:
                    visit(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
            for i, v in enumerate(list(value)):
                if type(v) not in _ATOMS:
                    visit(v, f"{path}[{i}]", depth + 1)
        elif not _is_library(value) and hasattr(value, "__dict__") and not isinstance(value, type):
            for k, v in list(vars(value).items()):
                if type(v) not in _ATOMS:
                    visit(v, f"{path}.{k}", depth + 1)

    for root in roots:
        if isinstance(root, nn.Module):
            module(root, "", 0)
        elif root is not None and not library_callback(root) and not _is_library(root) and hasattr(root, "__dict__"):
            for k, v in list(vars(root).items()):
                visit(v, f"{type(root).__name__}.{k}", 0)
    return list(found.values())


def _global_generators() -> set[int]:
    """The identities of torch's default generators (CPU and, once CUDA is initialised, every device's): global, not
    the user's (the checks and the steps handle them on their own)."""
    ids = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ids |= {id(g) for g in torch.cuda.default_generators}
    return ids


def states(found: Optional[list[tuple[str, torch.Generator]]] = None) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Every user-held generator (``found``: :func:`held`'s answer already taken) with its state now
    (:func:`restore` puts them back)."""
    return [(g, g.get_state()) for _, g in (held() if found is None else found)]


def restore(saved: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    """Put the generators of :func:`states` back in the states it saw."""
    for g, state in saved:
        g.set_state(state)


@contextmanager
def forked() -> Iterator[list[tuple[str, torch.Generator]]]:
    """Run the block, then put every user-held generator back in the state it had (as ``torch.random.fork_rng``
    does for torch's global ones). Yields :func:`held`'s answer as the block starts (for :func:`reseed`: one walk)."""
    found = held()
    saved = states(found)
    try:
        yield found
    finally:
        restore(saved)


def reseed(seed: int, found: Optional[list[tuple[str, torch.Generator]]] = None) -> None:
    """Seed every user-held generator (``found``: :func:`held`'s answer already taken, else looked for now) with a
    function of (``seed``, its attribute path): two passes seeded alike draw alike; two generators of one module draw
    differently."""
    from lightning_dp.records.fresh_randomness import derived_seed

    for path, g in (held() if found is None else found):
        g.manual_seed(derived_seed(seed, "user generator", path))
