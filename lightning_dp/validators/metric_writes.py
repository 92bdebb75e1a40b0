"""The trainer's metric dicts hold what ``self.log`` put there: an entry the user's code writes directly is refused.

``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` are filled by Lightning's logger connector
from the values ``self.log`` recorded, whose names the release boundary judges (rule 10: :mod:`.monitored`, a
training-logged name monitored by ``EarlyStopping``, ``ModelCheckpoint`` or a plateau scheduler is refused). Written
directly — ``trainer.callback_metrics["val_loss"] = loss``, ``.update``, ``.setdefault``, ``|=``, a deletion — an entry
carries whatever it holds to every reader of the dict (``EarlyStopping``, ``ModelCheckpoint``'s monitor and file
names, a callback that sets the learning rate from it) under a name never logged, so judged by nothing. During a
private fit the three dicts are :class:`WrittenMetrics` (:func:`install`, after
:meth:`~.logged_reads.LoggedReads.install`): a write whose first caller outside the standard library is not a
library's (Lightning's connector, its ``LearningRateMonitor``, lightning_dp) is refused at once, wherever it runs
(a step, a callback's ``on_train_batch_end``, validation); and every entry must be an object a library put there
(kept per name, the latest :data:`_KEPT`), checked whenever the dict is read — an entry slipped past the dict's methods
(``dict.__setitem__``) is refused before anything reads it. Reading the dicts is :mod:`.logged_reads`' business."""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Optional

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.call_sites import first_caller, package_of
from lightning_dp.validators.logged_reads import _LIBRARIES, LoggedMetrics, LoggedReads

_ATTRIBUTES = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")
_KEPT = 64  # the latest objects a library put under one name (LoggedReads.moved restores the one before)
_THIS = __name__
_LOGGED_READS = LoggedMetrics.__module__


class WrittenMetrics(LoggedMetrics):
    """One of the trainer's metric dicts whose writes must be a library's (and whose reads :class:`LoggedMetrics`
    shows to :class:`~.logged_reads.LoggedReads`)."""

    attribute: str
    put: dict[Any, collections.deque]

    def _write(self, keys: Iterable[Any], values: Optional[Iterable[Any]] = None) -> None:
        """Before a write of ``keys`` (to ``values``; none: a deletion): refuse it if the user's code makes it, else
        keep the objects written as the library's."""
        if self.reads is None:  # a copy Lightning made of it: not watched
            return
        keys = list(keys)
        if self.reads.active and _users_write():
            raise direct_write_error(self, keys)
        for key, value in zip(keys, values if values is not None else ()):
            kept = self.put.setdefault(key, collections.deque(maxlen=_KEPT))
            if not kept or kept[-1] is not value:
                kept.append(value)

    @property  # type: ignore[override]
    def _check(self) -> Callable[[Iterable[Any]], None]:
        """Before a read (:class:`LoggedMetrics` calls ``self._check(keys)``): every entry must be an object a
        library put there. A property, not a method: the read's own check runs from :class:`LoggedMetrics`' frame,
        with no frame of this module above it (it tells the user's code by its first caller outside
        :mod:`.logged_reads`)."""
        reads = self.reads
        if reads is not None and reads.active and not reads._moving:  # moved values are LoggedReads' own
            strays = [k for k, v in dict.items(self) if not any(v is kept for kept in reversed(self.put.get(k, ())))]
            if strays:
                raise direct_write_error(self, strays, past_methods=True)
        return reads.check if reads is not None else _unread

    def __setitem__(self, key: Any, value: Any) -> None:
        self._write([key], [value])
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        items = dict(*args, **kwargs)
        self._write(items.keys(), items.values())
        dict.update(self, items)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._write([key], [default])
        return dict.setdefault(self, key, default)

    def __ior__(self, other: Any) -> "WrittenMetrics":
        self.update(other)
        return self

    def __delitem__(self, key: Any) -> None:
        self._write([key])
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self._write([key])
        return super().pop(key, *default)

    def popitem(self) -> tuple[Any, Any]:
        self._write(list(dict.keys(self))[-1:])
        return super().popitem()

    def clear(self) -> None:
        self._write(list(dict.keys(self)))
        super().clear()


def _unread(keys: Iterable[Any]) -> None:
    """A copy's read (no :class:`~.logged_reads.LoggedReads`): not watched."""


def install(reads: LoggedReads) -> None:
    """Watch the writes to the trainer's three metric dicts too (after ``reads.install()``, which wraps the dicts
    Lightning replaced): their entries as they are now are the library's."""
    connector = getattr(reads.trainer, "_logger_connector", None)
    for attribute in _ATTRIBUTES:
        current = getattr(connector, attribute, None)
        if type(current) is LoggedMetrics and current.reads is reads:
            current.__class__ = WrittenMetrics  # the same object: whoever holds it holds the watched dict
            current.attribute = attribute.lstrip("_")
            current.put = {k: collections.deque([v], maxlen=_KEPT) for k, v in dict.items(current)}


def _users_write() -> bool:
    """Whether the write's first caller outside this module, :mod:`.logged_reads` and the standard library is the
    user's code (not a library's: Lightning's logger connector, its callbacks, lightning_dp)."""
    frame = first_caller(2, modules=(_THIS, _LOGGED_READS), standard=True)
    return frame is not None and package_of(frame) not in _LIBRARIES


def direct_write_error(metrics: WrittenMetrics, keys: list[Any],
                       past_methods: bool = False) -> PrivacyConfigurationError:
    """The refusal of an entry of a trainer metric dict that ``self.log`` did not put there (names, never values)."""
    reads = metrics.reads
    hook = getattr(getattr(getattr(reads, "trainer", None), "lightning_module", None), "_current_fx_name", None)
    where = f" (in {hook})" if hook else ""
    names = ", ".join(repr(str(k)) for k in keys) or "an entry"
    how = ("holds an object no library put there (written past the dict's methods)" if past_methods
           else f"was written directly by the user's code{where}")
    return PrivacyConfigurationError(
        f"trainer.{metrics.attribute}[{names}] {how}. Lightning fills its metric dicts from self.log, whose values "
        "the release boundary judges; an entry written there directly reaches EarlyStopping, ModelCheckpoint (its "
        "monitor and file names) and every callback that reads the dict, judged by nothing: a statistic of the "
        "private batch written there would steer training or name a file outside the guarantee. Nothing more was "
        "released. Log the value instead: self.log(name, value) (a training-logged value may not be monitored; a "
        "validation metric, ε and the step count may: docs/release_boundary.md, rule 10); read the dicts, never "
        "write them.")
