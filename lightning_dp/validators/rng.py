"""The checks' passes leave every random number generator as they found it.

The probe and the batch check run the user's ``training_step`` several times on examples. A step that draws random
numbers (dropout masks, augmentation, a NumPy or ``random`` call in the user's code) would otherwise advance the
generators, and the real step after the check would draw other numbers than a run without the check: a check that
changes training is a check nobody can turn on. :func:`forked_rngs` saves torch's CPU and accelerator generators,
NumPy's global generator and Python's ``random``, and the generators the model and the user's callbacks hold
(:mod:`~lightning_dp.records.user_generators`: a module's ``self.gen = torch.Generator()``), and restores them all.

:func:`seeds_recorded` watches the other direction: the user's code seeding those generators from the data (rule 3
of docs/release_boundary.md), compared across the first step's replays of the loop's hooks.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator

import torch

from lightning_dp.records import user_generators
from lightning_dp.records.call_sites import STANDARD, first_caller, package_of
from lightning_dp.replays.draws import pass_through
from lightning_dp.replays.starting_state import Generators, put_back_after

if TYPE_CHECKING:
    from lightning_dp.errors import PrivacyConfigurationError


@contextmanager
def forked_rngs() -> Iterator[None]:
    """Run the block, then put torch's (CPU and every CUDA device), NumPy's and Python's generators back
    (:class:`~lightning_dp.replays.starting_state.Generators`), and the ``torch.Generator`` objects the model and the
    callbacks hold (:mod:`~lightning_dp.records.user_generators`)."""
    with put_back_after(lambda: Generators(cuda="available")), user_generators.forked():
        yield


_SEEDERS = (("torch", "manual_seed"), ("torch.random", "manual_seed"), ("torch", "set_rng_state"),
            ("torch.random", "set_rng_state"), ("numpy.random", "seed"), ("numpy.random", "set_state"),
            ("random", "seed"), ("random", "setstate"))
"""The global generators' seeding functions (module, name) :func:`seeds_recorded` watches."""


@contextmanager
def seeds_recorded() -> Iterator[list[tuple[str, Hashable]]]:
    """Within the block, record each seed or state the user's code sets on torch's, NumPy's or Python's global
    generator (``torch.manual_seed(int(x.sum()))``, ``random.seed(loss)``): a list of (function, value) the block
    fills. Seeding by lightning_dp's own code (the checks' passes) and by a library on its own account is not
    recorded; a library function the user's code called (``pl.seed_everything(n)``) is. Two replays of the loop's
    hooks on different examples that record different lists seed the generators from the data: later random draws
    (dropout masks, augmentation) would carry the batch into other steps. The functions are put back on exit."""
    import importlib

    calls: list[tuple[str, Hashable]] = []
    saved: list[tuple[Any, str, Any]] = []
    for module_name, name in _SEEDERS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        saved.append((module, name, original))
        setattr(module, name, _recording(f"{module_name}.{name}", original, calls))
    try:
        yield calls
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _recording(label: str, original: Callable[..., Any], calls: list[tuple[str, Hashable]]) -> Callable[..., Any]:
    def seeding(*args: Any, **kwargs: Any) -> Any:
        if _seeded_by_user():
            calls.append((label.rpartition(".")[2], _token((args, kwargs))))
        return original(*args, **kwargs)
    pass_through(seeding)  # (np.random.seed() read under it is the user's draw: replays/draws.py)
    return seeding


def _seeded_by_user() -> bool:
    """Whether the nearest caller outside the standard library is the user's code, or a library's seeding function
    (``seed_everything``) the user's code called. A library seeding on its own account (torch.compile saving and
    restoring the generator's state) and lightning_dp's own passes are not the user's."""
    from lightning_dp.records.library_objects import LIBRARY_PREFIXES

    def seeding_helper(frame: FrameType) -> bool:  # a library's seeding function: its caller's seeding
        top = package_of(frame)
        return top in LIBRARY_PREFIXES and top != "lightning_dp" and frame.f_code.co_name in _SEEDING_FUNCTIONS

    frame = first_caller(2, packages=STANDARD - frozenset(LIBRARY_PREFIXES), also=seeding_helper)
    return frame is not None and package_of(frame) not in LIBRARY_PREFIXES


_SEEDING_FUNCTIONS = frozenset({"seed_everything", "_collect_rng_states", "_set_rng_states", "reset_seed"})
"""Libraries' functions whose seeding is their caller's (Lightning's ``seed_everything`` and its helpers)."""


def _token(value: Any) -> Hashable:
    """A comparable digest of a seed or a generator state (a tensor's bytes, a NumPy state's arrays)."""
    if isinstance(value, torch.Tensor):
        return hashlib.sha256(value.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    if isinstance(value, (list, tuple)):
        return tuple(_token(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _token(v)) for k, v in value.items()))
    if type(value).__module__ == "numpy":
        return hashlib.sha256(repr(value.tolist() if hasattr(value, "tolist") else value).encode()).hexdigest()
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def decided_from_data_error(decisions: list[list[tuple[str, Hashable]]], where: str) -> "PrivacyConfigurationError":
    """The refusal of two replays that seeded a global generator, or ended the epoch, differently (the decisions'
    names only)."""
    from lightning_dp.errors import PrivacyConfigurationError

    def ended(calls: list[tuple[str, Hashable]]) -> list[Hashable]:
        return [value for name, value in calls if name.startswith("on_train_batch_start")]

    what = ("the epoch was ended (on_train_batch_start returned -1) for one and not the other"
            if ended(decisions[0]) != ended(decisions[1]) else
            "a global random generator (torch's, NumPy's or Python's) was seeded with different values")
    return PrivacyConfigurationError(
        f"A decision was taken from the data {where}: replayed on different data, {what}. Ending an epoch from the "
        "batch changes which records the next steps sample; a seed from the data carries it into every later draw "
        "(dropout masks, augmentation). Either steers training by un-noised data, outside the guarantee. Nothing "
        "was released. Decide from the step count or a constant (pl.seed_everything(0), torch.manual_seed(batch_idx),"
        " max_steps), never from the batch, its loss or a statistic of the training data.")
