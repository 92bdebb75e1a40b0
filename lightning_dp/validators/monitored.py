"""What the training loop monitors, read from Lightning's objects for the release boundary's feedback rule
(:mod:`lightning_dp.privacy.boundary.feedback`): the schedulers and callbacks that steer training by a logged
value, the names the training hooks logged (``trainer.fit_loop.epoch_loop._results``: every key logged by
``training_step`` and the training hooks, with its ``_step``/``_epoch`` forms), and whether validation reads the
training records."""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils.data import SubsetRandomSampler

from lightning_dp.records.recorded_batches import RecordedBatches
from lightning_dp.records.subset_chain import selected_rows as _records
from lightning_dp.records.subset_chain import subset_levels as _levels
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.validators.loaders import _unwrap
from lightning_dp.records.held_records import holds_records, row_digests
from lightning_dp.validators.validation_reads import read_in_evaluation

NOT_FROM_DATA: set[str] = set()
"""Names that lightning_dp's own callbacks log in training hooks and whose values are functions of the ledger, not of
the data (ε): each callback adds its own when it is imported."""

Consumer = tuple[str, str]
"""(who reads the value — a scheduler or callback, by class —, the monitored name)."""

Finding = tuple[str, str, str]
"""(who, the monitored name, why the value is the training data's)."""


def consumers(trainer: Any) -> list[Consumer]:
    """Everything in ``trainer`` that reads a logged value to steer training: plateau schedulers' ``monitor`` and the
    ``monitor`` of every callback (``EarlyStopping``, ``ModelCheckpoint``, a user's)."""
    out: list[Consumer] = []
    for config in getattr(trainer, "lr_scheduler_configs", None) or ():
        if getattr(config, "reduce_on_plateau", False) and isinstance(getattr(config, "monitor", None), str):
            out.append((f"the learning-rate scheduler {type(config.scheduler).__name__}", config.monitor))
    for callback in getattr(trainer, "callbacks", None) or ():
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str) and monitor:
            out.append((f"the callback {type(callback).__name__}", monitor))
        out.extend((f"the callback {type(callback).__name__}'s filename template", name)
                   for name in filename_names(callback))
    return out


_TEMPLATE_NAME = re.compile(r"\{([^{}:]+)(?::[^{}]*)?\}")


def filename_names(callback: Any) -> list[str]:
    """The logged names a checkpoint callback writes into its files' names (``ModelCheckpoint(filename=
    "{epoch}-{train_loss:.4f}")``: the value is in the file name and in the callback's state saved in every checkpoint,
    ``best_model_path``), less ``epoch`` and ``step`` (counts, not data)."""
    template = getattr(callback, "filename", None)
    if not isinstance(template, str) or not callable(getattr(callback, "format_checkpoint_name", None)):
        return []
    return [n.strip() for n in _TEMPLATE_NAME.findall(template) if n.strip() not in ("epoch", "step")]


def training_logged(trainer: Any) -> set[str]:
    """The names the training loop logged so far this epoch (as ``callback_metrics`` keys them)."""
    return _logged(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None))


def private_logged(trainer: Any) -> set[str]:
    """The logged names whose values are the training data's: the training loop's, and the validation loop's too
    when a validation loader reads the training records (:func:`validates_on_training_data`)."""
    names = training_logged(trainer)
    if validates_on_training_data(trainer):
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        names |= _logged(getattr(epoch_loop, "val_loop", None))
    return names


def _logged(loop: Any) -> set[str]:
    results = getattr(loop, "_results", None)
    names: set[str] = set()
    for metric in (results.values() if results is not None else ()):
        meta = getattr(metric, "meta", None)
        if meta is None:
            continue
        names.add(meta.name)
        if meta.forked:
            names.update((meta.forked_name(True), meta.forked_name(False)))
    return names


def fed_back(trainer: Any, exempt: Callable[[str], bool]) -> list[Finding]:
    """The consumers of ``trainer`` that monitor a value computed from the training data (not ``exempt``): one the
    training loop logged (unless its value is a counter of the loop: :func:`counter_valued`), or any value at all
    when the validation loaders read the training records (validating on the training set makes every validation
    metric a statistic of the private data)."""
    logged, on_training_data = training_logged(trainer), validates_on_training_data(trainer)
    found = []
    for who, name in consumers(trainer):
        if exempt(name):
            continue
        if name in logged and not counter_valued(trainer, name):
            found.append((who, name, "logged by a training hook"))
        elif on_training_data:
            found.append((who, name, "computed by validation on the training records"))
    return found


def _counters(trainer: Any) -> dict[str, float]:
    """The loop's public counters now, by name: the optimizer step, the epoch and the batch's index in it."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    found = {"global_step": getattr(trainer, "global_step", None), "epoch": getattr(trainer, "current_epoch", None),
             "batch_idx": getattr(loop, "batch_idx", None)}
    return {name: float(c) for name, c in found.items() if isinstance(c, int)}


_VERIFIED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
"""A training-logged metric -> the value (tensor) it held when :func:`counter_valued` found it equal to a counter."""

_SAME: "weakref.WeakKeyDictionary[Any, dict[str, set[str]]]" = weakref.WeakKeyDictionary()
"""A trainer -> logged name -> the counters its value equalled at every check so far (one of them at each check is not
enough: ``global_step if loss < t else batch_idx`` chooses among public values by the data)."""


def counter_valued(trainer: Any, name: str) -> bool:
    """Whether every value the training loop holds under ``name`` is a public counter, not a statistic of the batch:
    logged by ``training_step`` on the step only (``self.log("global_step", self.global_step)``, the Lightning docs'
    "keep the latest k checkpoints"), and equal to the optimizer step, the epoch or the batch index now, or the very
    value found equal to one at an earlier check (the check when validation starts, after the step counted on).
    Checked before every release, after that step's ``training_step`` logged and before any callback reads it: a
    value that is not a counter there (``global_step + (loss > 1)``) is private, and so is one equal to a counter at
    every check but not to the same one at all of them (``global_step if loss < t else batch_idx``: the counters it
    equalled are intersected over the fit, :data:`_SAME`). A value reduced over the epoch or logged by another hook
    is private whatever it holds."""
    results = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_results", None)
    held = [m for m in (results.values() if results is not None else ())
            if getattr(getattr(m, "meta", None), "name", None) == name]
    if not held:
        return False
    counters = _counters(trainer)
    for metric in held:
        meta, value = metric.meta, getattr(metric, "_forward_cache", None)
        if (getattr(meta, "fx", None) != "training_step" or not getattr(meta, "on_step", False)
                or getattr(meta, "on_epoch", True) or not isinstance(value, torch.Tensor) or value.numel() != 1):
            return False
        if _VERIFIED.get(metric) is value:
            continue
        equal = {c for c, v in counters.items() if float(value) == v}
        try:
            same = _SAME.setdefault(trainer, {})
        except TypeError:  # a trainer without weak references: one check at a time
            same = {}
        equal = same[name] = equal if name not in same else same[name] & equal
        if not equal:
            return False
        _VERIFIED[metric] = value
    return True


def _memory(dataset: Any) -> list[tuple[int, int]]:
    """The memory intervals [start, end) of the tensors a dataset holds (:func:`~.dataset_tokens.dataset_parts`)."""
    found = []
    for _, t in dataset_parts(dataset)[1]:
        if t.numel():
            extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
            found.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))
    return found


def _positions(loader: Any) -> Optional[list[int]]:
    """The positions of ``loader.dataset`` its sampler reads when it fixes them: the Poisson loader's population (the
    training ``SubsetRandomSampler``'s indices: :class:`~lightning_dp.records.recorded_batches.RecordedBatches`), a
    ``SubsetRandomSampler``'s indices (under a ``BatchSampler`` or Lightning's distributed wrapper too); ``None``: all
    (any other sampler)."""
    batches = getattr(loader, "batch_sampler", None)
    if isinstance(batches, RecordedBatches):
        return batches.population
    sampler = _unwrap(getattr(batches, "sampler", None) or getattr(loader, "sampler", None))
    return [int(i) for i in sampler.indices] if isinstance(sampler, SubsetRandomSampler) else None


def training_rows(trainer: Any) -> dict[int, set[int]]:
    """The indices training reads of the training dataset and of each dataset under its ``Subset`` wrappers, by
    dataset id (the population of the training loader's sampler, mapped down them: the notion of
    :func:`validates_on_training_data`); a dataset not listed is read whole. A validation read of a listed dataset
    at other indices reads held-out records (:class:`~.record_reads.RecordWatch`)."""
    loader = getattr(trainer, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return {}
    return {id(d): set(rows) for d, rows in _levels(dataset, _positions(loader)) if rows is not None}


def validates_on_training_data(trainer: Any) -> bool:
    """Whether a validation loader reads training records: the training loader's dataset (under its ``Subset``
    wrappers, indices in common: the training population's and those a validation ``SubsetRandomSampler`` reads
    count, so disjoint ``SubsetRandomSampler`` splits of one dataset are held out), tensors in the same memory (a second
    dataset over the same tensors; disjoint slices of one tensor, a ``random_split`` into disjoint subsets, are held
    out), or a copy of them (rows of the training tensors in a validation tensor of other memory); or a hook of
    validation read them during this fit (:func:`~.validation_reads.read_in_evaluation`)."""
    if read_in_evaluation(trainer) is not None:
        return True
    train_loader = getattr(trainer, "train_dataloader", None)
    train = getattr(train_loader, "dataset", None)
    loaders = getattr(trainer, "val_dataloaders", None)
    if train is None or loaders is None:
        return False
    base, rows = _records(train, _positions(train_loader))
    memory = _memory(base)
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        val = getattr(loader, "dataset", None)
        if val is None:
            continue
        val_base, val_rows = _records(val, _positions(loader))
        same = val_base is base or any(a < d and c < b for a, b in memory for c, d in _memory(val_base))
        if same and (rows is None or val_rows is None or rows & val_rows):
            return True
        if not same and _copies_records(val_base, base):
            return True
    return False


def _copies_records(val: Any, train: Any) -> bool:
    """Whether a validation dataset in other memory holds the training records: a tensor of it whose rows are rows
    of a training tensor (a validation set built from a copy of the training data:
    :func:`~lightning_dp.records.held_records.holds_records`). Asked at every release: the answer for a pair
    of datasets is kept while both live."""
    key = (id(val), id(train))
    known = _COPIES.get(key)
    if known is not None and known[0]() is val and known[1]() is train:
        return known[2]
    train_tensors = [t for _, t in dataset_parts(train)[1] if t.dim() >= 2]
    found = any(holds_records(v, t, row_digests(t)) for _, v in dataset_parts(val)[1] for t in train_tensors)
    try:
        if len(_COPIES) >= 8:
            _COPIES.pop(next(iter(_COPIES)))
        _COPIES[key] = (weakref.ref(val), weakref.ref(train), found)
    except TypeError:  # an object without weak references: asked again next time
        pass
    return found


_COPIES: dict[tuple[int, int], tuple[Any, Any, bool]] = {}
