"""The unseeded random draws a hook makes, recorded as it runs and replayed as it runs again.

docs/release_boundary.md, rule 3 ("Your hooks run more than once"): a write is accepted when the runs again on other
data reproduce it, and refused when a run on other data sets it apart. The global generators start every run again
from one state (``records.fetch.seeded``; a judged hook's runs again from its own starting state), and so do the
generators the model and the callbacks hold (:mod:`~lightning_dp.records.user_generators`). A draw from the operating
system's entropy does not: a generator made in the hook without a seed (``np.random.default_rng()``,
``np.random.Generator(np.random.PCG64())``, ``np.random.RandomState()``, ``random.Random()``, ``torch.Generator()``
then ``.seed()``), ``random.SystemRandom``, :mod:`secrets`, ``os.urandom``, ``uuid.uuid4()``, or a global generator
reseeded from entropy (``random.seed()``, ``np.random.seed()``, ``torch.seed()``) draws otherwise in every run, and
excusing what a run on the same data sets apart too lets the data through beside the draw (zoo32 e01/e02: a training
mean ``+ 0.01 · np.random.default_rng().normal(size=d)`` kept at an epoch's end passed; so did ``+ 1e-9 · …``).
:class:`DrawReads` records what these sources gave the real run (:meth:`~DrawReads.recording`; or the first of the runs
again, :meth:`~DrawReads.next_run`) and hands each run again the same values in the same order
(:meth:`~DrawReads.replayed`), as :class:`~lightning_dp.replays.clock.ClockReads` does for the clocks: a write of a draw
alone is written alike and accepted (jitter kept in state, an exploration noise), one mixing the data into it still
differs on other data and is refused, at any scale of the draw. Used wherever the clocks are replayed.

Replayed, where the entropy enters (each source a name in :attr:`DrawReads.values`): ``os.urandom`` (the module's
attribute, and ``random``'s own ``_urandom``, through which :class:`random.SystemRandom`, :mod:`secrets` and NumPy's
``SeedSequence`` without entropy — every unseeded NumPy generator — read it), ``os.getrandom``, the seeding from
entropy of ``random.Random.seed(None)`` (a fresh ``random.Random()``) and of ``random.seed()``, ``torch.seed()``,
``torch.cuda.seed()``/``seed_all()``, and ``torch.Generator.seed()`` (``torch.Generator`` is, inside the block, a
subclass whose ``seed()`` is replayed: an object it makes for the user's code pickles and copies as a plain
``torch.Generator``; for any other caller it makes a plain one). Names bound elsewhere — ``from os import urandom``,
``from torch import Generator`` in the user's modules, a source held as an attribute of the hook's owner or of
``owners`` — are swapped for the block too. So are the generators those objects (and a module's submodules) hold,
made before the block, whose reseeding from entropy is C code (``self.gen.seed()`` of a plain ``torch.Generator``
made in ``__init__``, ``self.rs.seed()`` of a NumPy ``RandomState``): for the block a stand-in in the same state whose
``seed()`` is replayed takes the attribute's place, and after it the generator goes back there with the state the
stand-in reached (:func:`_held_generators`; ``random.Random``'s ``seed`` is replaced on the class already). The CUDA
devices' default generators start each run again from the state the first run started from (``seeded`` leaves them),
and are put back after it.

Scope, as the clocks': only reads on the thread that runs the hook, and only reads the user's code asked for — the
nearest caller outside the standard library and installed libraries is the user's (:func:`users_read`). The library's
own randomness — the mechanism's noise (``lightning_dp/privacy``, ``lightning_dp/secure_random.py``, its secure
generators), a sampler's seed — is read from lightning_dp's code and always reads the real source, on any thread; so
does every read on another thread (a noise prefetcher, a loader's workers) and every read outside a block. Past the
recorded values, or asked with other arguments (another byte count), a run again reads the real source: a number of
draws that depends on the data writes otherwise (refused).

Not seen: entropy read by C code other than through these functions (a C extension's own ``/dev/urandom`` or
``getrandom`` call), ``open("/dev/urandom").read()``, a subclass of ``random.Random`` overriding ``seed``, a generator
made before the block and reseeded from entropy inside it where the block does not look for it (held deeper than an
attribute of the hook's owner, the model's modules or the callbacks: in a list, a helper object, a global; a NumPy
``Generator``'s bit generator replaced by the hook's own reads of entropy in C); CUDA kernels whose sums are not
deterministic are no draws. What these write the runs on the data still set apart, and it is judged as any such write
(:func:`~lightning_dp.fingerprints.fingerprint_entries.moved_by_data`: excused unless the other data moved it far
beyond the difference). Inside a block ``torch.Generator`` is the subclass: ``type(g) is torch.Generator`` for a plain
generator made before answers no there.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import types
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from lightning_dp.replays.bindings import ModuleIndex, rebound
from lightning_dp.replays.clock import file_kind

__all__ = ["DrawReads", "pass_through", "users_read"]

_ACTIVE = threading.local()  # .stack: the read functions of the blocks open on this thread, innermost last
_LOCK = threading.Lock()
_OPEN = [0]  # how many blocks are open, on every thread (the first installs the replacements, the last removes them)
_PASS_THROUGH: set[types.CodeType] = set()  # lightning_dp's functions that only hand a user's call on
_HERE = os.path.abspath(__file__)

Read = Callable[[str, tuple, Callable[[], Any]], Any]
"""(source, its arguments, the real read) → the value this run reads."""


def pass_through(function: Callable[..., Any]) -> None:
    """Mark a function of lightning_dp's that only hands the user's call on (a wrapper recording seeds): a read made
    under it is still the user's (:func:`users_read`)."""
    code = getattr(function, "__code__", None)
    if code is not None:
        _PASS_THROUGH.add(code)


def users_read(depth: int = 2) -> bool:
    """Whether a read of entropy, made ``depth`` frames up, was asked for by the user's code: walking out, the first
    frame that is neither the standard library's, an installed library's, this module's nor a :func:`pass_through`
    wrapper is the user's (a frame of lightning_dp's: its own randomness, never replayed; the import machinery's: a
    module imported for the first time reads entropy for itself, once, and a run again does not import it again)."""
    frame: Optional[types.FrameType] = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib"):  # a module imported for the first time: its own read
            return False
        if code not in _PASS_THROUGH and os.path.abspath(code.co_filename) != _HERE:
            kind = file_kind(code.co_filename)
            if kind == "user":
                return True
            if kind == "ours":
                return False
        frame = frame.f_back
    return False


def _read(source: str, args: tuple, real: Callable[[], Any]) -> Any:
    """The value of one read: the innermost block's on this thread for the user's code, else the real source's."""
    stack = getattr(_ACTIVE, "stack", None)
    if stack and users_read():
        return stack[-1](source, args, real)
    return real()


# the sources as found at import; each replacement reads through _REAL (a source a test mocked is kept: _found())
_REAL: dict[str, Any] = {
    "os.urandom": os.urandom,
    "os.getrandom": getattr(os, "getrandom", None),
    "random.seed": random.seed,
    "torch.seed": torch.seed,
    "torch.cuda.seed": torch.cuda.seed,
    "torch.cuda.seed_all": torch.cuda.seed_all,
    "torch.Generator": torch._C.Generator,
}
_RANDOM_SEED = random.Random.seed  # the method every fresh random.Random() seeds itself with


def _urandom(size: int) -> bytes:
    return _read("os.urandom", (size,), lambda: _REAL["os.urandom"](size))


def _getrandom(size: int, flags: int = 0) -> bytes:
    return _read("os.getrandom", (size, flags), lambda: _REAL["os.getrandom"](size, flags))


def _seed(source: str) -> Optional[int]:
    """A 63-bit seed from entropy read for the user's code (``None``: not the user's, seed as the real source)."""
    stack = getattr(_ACTIVE, "stack", None)
    if not stack or not users_read():
        return None
    return int.from_bytes(stack[-1](source, (), lambda: _REAL["os.urandom"](8)), "little") >> 1


def _random_seed(self: random.Random, a: Any = None, version: int = 2) -> None:
    if a is None and not isinstance(self, random.SystemRandom):
        stack = getattr(_ACTIVE, "stack", None)
        if stack and users_read():
            a = int.from_bytes(stack[-1]("random.Random.seed", (), lambda: _REAL["os.urandom"](32)), "big")
    return _RANDOM_SEED(self, a, version)


def _global_seed(a: Any = None, version: int = 2) -> None:
    return _random_seed(random._inst, a, version)  # type: ignore[attr-defined]  (random's own instance)


def _torch_seed() -> int:
    seed = _seed("torch.seed")
    if seed is None:
        return _REAL["torch.seed"]()
    torch.manual_seed(seed)  # (the CPU generator and every device's, as torch.seed())
    return seed


def _cuda_seed() -> None:
    seed = _seed("torch.cuda.seed")
    if seed is None:
        return _REAL["torch.cuda.seed"]()
    torch.cuda.manual_seed(seed)


def _cuda_seed_all() -> None:
    seed = _seed("torch.cuda.seed_all")
    if seed is None:
        return _REAL["torch.cuda.seed_all"]()
    torch.cuda.manual_seed_all(seed)


class _AnyGenerator(type(torch._C.Generator)):  # type: ignore[misc]
    """The replayed ``torch.Generator`` class's type: a plain ``torch.Generator`` is an instance of it."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _REAL["torch.Generator"])

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _REAL["torch.Generator"])


class _Generator(torch._C.Generator, metaclass=_AnyGenerator):  # type: ignore[misc]
    """``torch.Generator`` inside a block: made for the user's code, its ``seed()`` is replayed; made for any other
    code, a plain ``torch.Generator``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if getattr(_ACTIVE, "stack", None) and users_read():
            return super().__new__(cls, *args, **kwargs)
        return _REAL["torch.Generator"](*args, **kwargs)

    def seed(self) -> int:
        seed = _seed("torch.Generator.seed")
        if seed is None:
            return super().seed()
        self.manual_seed(seed)
        return seed


_Generator.__name__ = _Generator.__qualname__ = "Generator"


class _RandomState(np.random.RandomState):
    """What stands in, inside a block, for a NumPy ``RandomState`` the user's objects hold (made before the hook): its
    ``seed()`` without a seed — read from entropy by NumPy's C code — is replayed."""

    def seed(self, seed: Any = None) -> None:
        if seed is None:
            drawn = _seed("numpy.random.RandomState.seed")
            if drawn is not None:
                return super().seed(drawn % 2 ** 32)
        return super().seed(seed)


def _stand_in(value: Any) -> Any:
    """A generator the user's objects hold whose reseeding from entropy is C code (a plain ``torch.Generator``'s
    ``seed()``, a ``RandomState``'s ``seed()``), as one whose reseeding is replayed, in the same state; else
    ``None``."""
    if type(value) is _REAL["torch.Generator"]:
        stand = _REAL["torch.Generator"].__new__(_Generator, value.device)
        stand.set_state(value.get_state())
        return stand
    if type(value) is np.random.RandomState and type(getattr(value, "_bit_generator", None)) is np.random.MT19937:
        stand = _RandomState(0)
        stand.set_state(value.get_state())
        return stand
    return None


@contextmanager
def _held_generators(holders: Sequence[Any]) -> Iterator[None]:
    """Inside: the generators the ``holders`` (the hook's owner, the model's modules, the callbacks: their attributes)
    hold, made before the block, replaced by :func:`_stand_in`s; after it, each generator back in its place with the
    state its stand-in reached (unless the name was bound to something else meanwhile)."""
    owners = (owner for holder in holders
              for owner in (holder.modules() if isinstance(holder, torch.nn.Module) else [holder]))
    namespaces = ((names, None) for owner in owners if isinstance(names := getattr(owner, "__dict__", None), dict))
    with rebound(namespaces, lambda value, _: _stand_in(value),
                 on_put_back=lambda value, stand: value.set_state(stand.get_state())):  # (the state it reached)
        yield


_REPLACING: dict[str, Any] = {
    "os.urandom": _urandom, "os.getrandom": _getrandom, "random.seed": _global_seed, "torch.seed": _torch_seed,
    "torch.cuda.seed": _cuda_seed, "torch.cuda.seed_all": _cuda_seed_all, "torch.Generator": _Generator}
_MODULES: dict[str, tuple[tuple[str, str], ...]] = {  # module → (attribute, source) swapped there
    "os": (("urandom", "os.urandom"), ("getrandom", "os.getrandom")),
    "random": (("_urandom", "os.urandom"), ("seed", "random.seed")),
    "torch": (("seed", "torch.seed"), ("Generator", "torch.Generator")),
    "torch.random": (("seed", "torch.seed"), ("Generator", "torch.Generator")),
    "torch.cuda": (("seed", "torch.cuda.seed"), ("seed_all", "torch.cuda.seed_all")),
    "torch.cuda.random": (("seed", "torch.cuda.seed"), ("seed_all", "torch.cuda.seed_all")),
}


def _replacing(value: Any) -> Any:
    """What replaces ``value`` bound in a namespace of the user's (``None``: no source of entropy)."""
    if isinstance(value, (type, types.BuiltinFunctionType, types.FunctionType, types.MethodType)):
        for source, real in _REAL.items():
            if real is not None and (value is real or (isinstance(value, types.MethodType) and value == real)):
                return _REPLACING[source]
    return None


def _bindings() -> list[dict[str, Any]]:
    """The dicts of the user's modules binding a source by name (``from os import urandom``): :class:`ModuleIndex`."""
    return _SOURCE_MODULES.entries()


def _source_module(name: str, names: dict[str, Any], filename: str) -> Optional[dict[str, Any]]:
    if filename and file_kind(filename) == "user" and name not in _MODULES \
            and any(_replacing(v) is not None for v in list(names.values())):
        return names
    return None


_SOURCE_MODULES = ModuleIndex(_source_module)


def _cuda_generators() -> list[torch.Generator]:
    """The CUDA devices' default generators, once CUDA is initialised (none otherwise)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(torch.cuda.default_generators)


class DrawReads:
    """The values the sources of entropy gave one real run of a hook, per source, in order, with their arguments
    (module docstring). ``hook``, ``owner`` and ``owners``: where a source may be bound by name (the hook's module,
    the objects' attributes)."""

    def __init__(self, hook: Optional[Callable[..., Any]] = None, owner: Any = None,
                 owners: Sequence[Any] = ()) -> None:
        self.values: dict[str, list[tuple[tuple, Any]]] = {}  # source → (args, value)
        self._names = [getattr(hook, "__globals__", None) or {}]
        self._holders = [held for held in (owner, *owners) if held is not None]  # their generators: _held_generators
        for held in (owner, *owners):
            try:
                self._names.append(vars(held) if held is not None else {})
            except TypeError:
                pass
        self.cuda: Optional[list[torch.Tensor]] = None  # the CUDA generators' states as the recorded run started
        self.recorded = False

    def next_run(self) -> AbstractContextManager[None]:
        """The block of the next run: the first run records (:meth:`recording`), every later one replays
        (:meth:`replayed`)."""
        if self.recorded:
            return self.replayed()
        return self.recording()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, the user's reads on this thread read the real sources, and the values are kept."""
        self.recorded, self.values = True, {}
        self.cuda = [g.get_state() for g in _cuda_generators()] or None

        def read(source: str, args: tuple, real: Callable[[], Any]) -> Any:
            value = real()
            self.values.setdefault(source, []).append((args, value))
            return value
        with self._patched(read):
            yield

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside, the user's reads on this thread read the recorded values again, in order; past them, or asked
        with other arguments, the real source. The CUDA generators start where the recorded run's started."""
        served: dict[str, int] = {}

        def read(source: str, args: tuple, real: Callable[[], Any]) -> Any:
            kept, at = self.values.get(source, []), served.get(source, 0)
            served[source] = at + 1
            return kept[at][1] if at < len(kept) and kept[at][0] == args else real()
        generators = _cuda_generators()
        saved = [g.get_state() for g in generators]
        for i, g in enumerate(generators):
            if self.cuda is not None and i < len(self.cuda):
                g.set_state(self.cuda[i])
            else:  # (CUDA not initialised as the recorded run started: its generators fresh from their seeds)
                g.manual_seed(g.initial_seed())
        try:
            with self._patched(read):
                yield
        finally:
            for g, state in zip(generators, saved):
                g.set_state(state)

    @contextmanager
    def _patched(self, read: Read) -> Iterator[None]:
        """The sources replaced for this thread's reads from the user's code, put back however the block ends; a block
        inside another serves its own values until it ends."""
        with _LOCK:
            if not _OPEN[0]:
                _install()
            _OPEN[0] += 1
        stack = _ACTIVE.__dict__.setdefault("stack", [])
        stack.append(read)
        try:
            with rebound(((names, None) for names in [*self._names, *_bindings()]),
                         lambda value, _: _replacing(value)), _held_generators(self._holders):
                yield
        finally:
            stack.pop()
            with _LOCK:
                _OPEN[0] -= 1
                if not _OPEN[0]:
                    _uninstall()


_INSTALLED: list[tuple[Any, str, Any]] = []  # (object, attribute, the value found there)


def _install() -> None:
    """The replacements set on the modules of :data:`_MODULES` and on ``random.Random`` (the first block opens)."""
    for module_name, attributes in _MODULES.items():
        module = sys.modules.get(module_name)
        for attribute, source in attributes if module is not None else ():
            if _REAL[source] is not None and hasattr(module, attribute):
                _INSTALLED.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, _REPLACING[source])
    _INSTALLED.append((random.Random, "seed", random.Random.__dict__["seed"]))
    random.Random.seed = _random_seed  # type: ignore[method-assign]


def _uninstall() -> None:
    """Every replacement taken back (the last block closes): what was found there is put back."""
    while _INSTALLED:
        holder, attribute, value = _INSTALLED.pop()
        setattr(holder, attribute, value)
