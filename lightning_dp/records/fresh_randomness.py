"""Randomness starts each step, and each record's fetch, afresh.

The global random generators (torch's CPU default generator, the CUDA generators once CUDA is initialised, NumPy's
global ``RandomState`` and Python's ``random``) are one stream shared by everything a fit runs. Code that draws a
number of values that depends on the data moves that stream by a count taken from the private batch: a batch-end hook
that shows a few misclassified examples (``torch.randperm(n_wrong)``), an augmentation in ``__getitem__`` that retries
until a crop fits the record (RandomResizedCrop). Every later draw shifts with it: the dropout masks and augmentation
of all later steps and of the records fetched after it. A later release would then depend on an earlier batch's data
beyond the noise, and a seed the user set (``pl.seed_everything(42)``) makes the shift visible.

:class:`FreshRandomness` cuts the stream at points that do not depend on the data:

* **every private step** starts from generators seeded with a function of (the run's base seed, the step's index):
  :meth:`FreshRandomness.step`, at the step's start (Lightning: :func:`step_callback`, in ``on_train_batch_start``
  right after the decision windows' callback closed the last step's window and before every other callback, the
  module's hook and the first-step checks and their replays, which fork the generators and so start
  from the same state as the step's real run; a plain loop: ``PrivateStep.begin()``, once per step index);
* **every record the Poisson loader fetches** is read with the generators seeded with a function of (the base seed,
  the fetch's ordinal, the record's position in the batch), and the generators are seeded afresh once the batch's
  last record was read (:class:`FreshIndices`: the batch of indices the loader's fetcher iterates, in the main process
  or a worker). A dataset with its own ``__getitems__`` that does not iterate the indices is seeded once per batch.

The base seed is taken once, when the private loader is built (before any record is read), from the state of torch's
global generator (a digest of it: nothing is drawn), so ``pl.seed_everything(s)`` keeps runs reproducible and an
unseeded run still varies with torch's state. What is drawn *within* a step (or within one record's read) may still
depend on that step's batch (or that record); it cannot reach another step or another record.

The ``torch.Generator`` objects the model and the user's callbacks hold (``self.gen = torch.Generator()``) are
reseeded at every step's start too, each from (the step's seed, its attribute path), and the checks fork them as they
fork the global ones (:mod:`~lightning_dp.records.user_generators`): a data-dependent number of draws from the
module's own generator reaches no other step either. A record's fetch reseeds only the global generators.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from lightning_dp.records import user_generators


def derived_seed(*key: Any) -> int:
    """A 63-bit seed that is a fixed function of ``key`` (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def reseed_globals(seed: int) -> None:
    """Seed torch's CPU generator, the CUDA generators (if CUDA is initialised), NumPy's global generator and Python's
    ``random`` with ``seed`` (lightning_dp's own seeding: not a seed the user set from the data)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    random.seed(seed)


class FreshRandomness:
    """The run's base seed and the reseeding of the global generators at each step and each record's fetch."""

    def __init__(self) -> None:
        self.base: Optional[int] = None
        self.fetches = 0  # batches handed to a fetcher so far (an ordinal: data-independent)
        self._last_step: Optional[int] = None

    def start(self) -> None:
        """Take the base seed from torch's global generator's state (once per private step object; nothing drawn)."""
        if self.base is None:
            self.base = derived_seed("base", hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())

    def watch(self, roots: Callable[[], Any]) -> None:
        """The generators held under ``roots()`` (the model, the callbacks) are the user's: the checks fork them and
        every step reseeds them with the global ones (:mod:`~lightning_dp.records.user_generators`)."""
        user_generators.watch(self, roots)

    def step(self, index: int) -> None:
        """Step ``index`` begins: seed the generators from (base, index), once per index (physical batches of one
        step, and the Lightning callback followed by ``begin()``, reseed once); the generators the model and the
        callbacks hold too, each from (base, index, its attribute path)."""
        if self.base is None or index == self._last_step:
            return
        self._last_step = index
        seed = derived_seed(self.base, "step", index)
        reseed_globals(seed)
        user_generators.reseed(seed)

    def started(self, index: int) -> Optional[Callable[[], None]]:
        """What puts the generators back as step ``index`` began (the checks' passes start from it and replay the
        batch-start hooks: they draw what the step draws); ``None`` unless ``index`` is the step begun last."""
        if self.base is None or index != self._last_step:
            return None
        seed = derived_seed(self.base, "step", index)

        def restart() -> None:
            reseed_globals(seed)
            user_generators.reseed(seed)

        return restart

    def batch(self, indices: Any, per_record: bool = True) -> Any:
        """The batch of indices a fetcher is handed, wrapped to reseed around each record's read
        (:class:`FreshIndices`); the generators are seeded once for the batch right away. ``per_record=False``: the
        dataset's reads draw nothing (:func:`reads_draw`), the batch's one seeding is enough."""
        if self.base is None or not isinstance(indices, list):
            return indices
        seed = derived_seed(self.base, "fetch", self.fetches)
        self.fetches += 1
        reseed_globals(seed)
        return FreshIndices(indices, seed) if per_record else indices


def reads_draw(dataset: Any) -> bool:
    """Whether reading ``dataset``'s records may draw random numbers: all but a ``TensorDataset`` (exactly that class:
    pure indexing) and a ``Subset`` of one."""
    while type(dataset) is Subset:
        dataset = dataset.dataset
    return type(dataset) is not TensorDataset


class FreshIndices(list):
    """A batch of indices whose iteration (the fetcher's ``[dataset[i] for i in indices]``, ``Subset.__getitems__``)
    seeds the global generators before each record from (the fetch's seed, the record's position), and once more after
    the last one. Picklable (sent to DataLoader workers with its seed)."""

    def __init__(self, indices: list, seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __iter__(self) -> Iterator[Any]:
        LATEST[0] = self
        seed = self.seed
        for position, index in enumerate(list.__iter__(self)):
            reseed_globals(derived_seed(seed, position))
            yield index
        reseed_globals(derived_seed(seed, "end"))

    def __reduce__(self) -> Any:
        return (FreshIndices, (list(list.__iter__(self)), self.seed))


LATEST: list[Optional[FreshIndices]] = [None]
"""The batch of indices this process's fetcher iterated last (a fetch's write is judged by reading them again with
the same seeds: :mod:`~lightning_dp.records.fetch_reruns`; cleared when a fetch state is noted)."""


def step_callback(fresh: FreshRandomness, index: Callable[[], int]) -> Any:
    """Lightning: a callback for which each step's randomness starts afresh (:meth:`FreshRandomness.step` with
    ``index()``, the step's release index), in ``on_train_batch_start``: put second in the trainer's callbacks (after
    the decision windows', which closes the last step's window), it runs before the user's callbacks, the module's
    hook and the step's checks."""
    import pytorch_lightning as pl  # here: the plain loop does not import Lightning

    class FreshStep(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            fresh.step(index())

    return FreshStep()
