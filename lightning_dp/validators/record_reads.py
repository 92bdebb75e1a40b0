"""Records read by the user's step itself: only the sampled batch may enter a step.

The accounting assumes each record enters step t only through the Poisson sample (probability q). A ``training_step``
that reads the training dataset itself — ``self.trainer.train_dataloader.dataset[i]`` for negatives, neighbours or a
replay buffer — brings records the sampler did not draw into the step, outside that probability (and unclipped by
their own examples' bounds where they act on every gradient). :class:`RecordWatch` watches the training dataset (and
the datasets it wraps: ``Subset``, ``ConcatDataset``): its ``__getitem__``/``__getitems__`` are wrapped on their
classes while watched (under Lightning: the fit's training; a plain loop: :func:`refuse_record_reads` around the
user's step), and a read of a watched object while the step runs (under Lightning: while the module runs one of the
hooks of a step before its update — the batch-transfer hooks, ``training_step``, ``on_train_batch_start``,
``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, ``optimizer_step``:
:data:`~.logged_reads.STEP_HOOKS`) is refused at once, and again before the release if a handler swallowed the error.
The loader's own reads (the sample, fetched by Lightning's loop between the hooks), the checks'
(:mod:`lightning_dp.records.fetch`) and reads in other hooks (a training accuracy over the whole set at epoch end, a
report) are not counted.

What it cannot see: reads that bypass the dataset's item access (``dataset.tensors[0][i]``), a new dataset object
built over the same tensors in the step, and other copies of the data (a tensor loaded again from disk). During
validation (under Lightning) a read is not refused but told (:attr:`RecordWatch.elsewhere`): validation must then end
with the state it had (the glue).
"""

from __future__ import annotations

import operator
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.records.call_sites import first_caller

_METHODS = ("__getitem__", "__getitems__")


class RecordWatch:
    """Counts reads of the training records (``dataset`` and the datasets it is made of:
    :func:`~.dataset_tokens.dataset_parts`) through their classes' item access while :meth:`start`-ed and ``counting()``
    says so; lightning_dp's own reads (:mod:`lightning_dp.records.fetch`: the probe's, the checks') are not counted.

    Args:
        dataset: the training dataset (``None``: nothing is watched).
        counting: whether a read now is one of the step's (the Lightning glue: the module runs a hook of the step).
        where: how the refusal names where the reads happened.
    """

    def __init__(self, dataset: Any, counting: Callable[[], bool] = lambda: True,
                 where: str = "training_step", elsewhere: Optional[Callable[[], None]] = None) -> None:
        self.watched = dataset_parts(dataset)[0] if dataset is not None else []
        self.counting = counting
        self.where = where
        self.elsewhere = elsewhere
        """Told of a read that is not counted (outside the step's hooks: validation reading training records)."""
        self.rows: dict[int, set[int]] = {}
        """The indices training reads of a watched dataset, by id (one not listed: all of it); a read elsewhere of
        other indices only reads held-out records and is not told (:func:`~.monitored.training_rows`)."""
        self.reads: list[str] = []
        self.quiet = False
        """Reads are not counted (:meth:`paused`)."""
        self._saved: list[tuple[type, str, Any]] = []

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside are not counted: the first step's replays of the batch hooks run inside ``training_step``,
        where a batch-end hook's read (allowed when it really runs) would count."""
        quiet, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = quiet

    def start(self) -> None:
        """Wrap the item access of the watched datasets' classes (on the classes: ``obj[i]`` looks them up there)."""
        if self._saved or not self.watched:
            return
        ids, thread = {id(d) for d in self.watched}, threading.get_ident()
        for cls in {type(d) for d in self.watched}:
            for name in _METHODS:
                original = getattr(cls, name, None)  # its own or inherited: set on the class itself while watched
                if original is None:
                    continue

                def counting(obj: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                    if id(obj) in ids and not self.quiet and self.counting() and threading.get_ident() == thread \
                            and not _ours():
                        self.reads.append(f"{type(obj).__name__}.{_name}({args[0] if args else ''!r})")
                        raise self.error(self.reads)  # at once; and again at check() if a handler swallows it
                    if self.elsewhere is not None and id(obj) in ids and not self._held_out(obj, args):
                        self.elsewhere()
                    return _original(obj, *args, **kwargs)

                self._saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, counting)

    def _held_out(self, obj: Any, args: tuple) -> bool:
        """Whether reading ``obj[args[0]]`` (an index, or a list of them) reads none of the records training reads
        of ``obj`` (:attr:`rows`); a key of another kind (a slice, a tuple) counts as a training read."""
        rows = self.rows.get(id(obj))
        if rows is None or not args:
            return False
        try:
            keys, size = args[0] if isinstance(args[0], list) else [args[0]], len(obj)
            return not any((i + size if i < 0 else i) in rows for i in map(operator.index, keys))
        except TypeError:
            return False

    def stop(self) -> None:
        """Put the classes back as they were."""
        for cls, name, own in reversed(self._saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        self._saved = []

    def check(self) -> None:
        """Refuse if records were read since the last check."""
        reads, self.reads = self.reads, []
        if reads:
            raise self.error(reads)

    def error(self, reads: list[str]) -> PrivacyConfigurationError:
        """The refusal of ``reads``."""
        return PrivacyConfigurationError(
            f"{self.where} read records of the training dataset itself ({', '.join(reads[:3])}"
            f"{' and more' if len(reads) > 3 else ''}): only the Poisson-sampled batch may enter a step, each "
            "record with probability q, which the accounting assumes. Records read besides it (negatives, "
            "neighbours, a replay buffer) enter every step unaccounted for. Nothing was released. Use the batch "
            "the step is handed; take extra examples from public data.")


def _ours() -> bool:
    """Whether lightning_dp's own reading of examples (:mod:`lightning_dp.records.fetch`) is on the stack."""
    fetch = first_caller(2, also=lambda frame: frame.f_globals.get("__name__") != "lightning_dp.records.fetch")
    return fetch is not None


@contextmanager
def refuse_record_reads(dataset: Any) -> Iterator[None]:
    """Run the user's step; refuse, when it returns, if it read records of ``dataset`` or of the datasets it is made
    of (:func:`~.dataset_tokens.dataset_parts`) itself. ``None``: nothing is watched."""
    watch = RecordWatch(dataset)
    watch.start()
    try:
        yield
    finally:
        watch.stop()
    watch.check()
