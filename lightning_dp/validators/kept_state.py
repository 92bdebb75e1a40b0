"""The release boundary's view of kept state: a cheap fingerprint of everything a step could write.

What leaves a private step is the noised mean ĝ_t (and the ledger). Anything else computed from the
batch and *kept* — a buffer, a Python attribute, a callback's state — is saved in checkpoints and fed to
later steps without noise, so the guarantee would not cover it. The mechanism therefore fingerprints the
state it can see and refuses a change that the optimizer's step on the released gradient does not explain
(:class:`~lightning_dp.privacy.boundary.ReleaseBoundary` says when). What is fingerprinted:

* every parameter of the module (identity, storage and version counter: the optimizer's in-place update
  shows; its L2 norm, by one fused reduction, so a write through ``p.data`` shows too; a full pass compares
  contents);
* every buffer, of every dtype (integer and bool counters included): a content checksum, recomputed only
  when the tensor's storage or version counter moved (a full pass recomputes all);
* every submodule's mode (``training``) as the next training step will run it (:func:`training_modes`: the modes
  Lightning captured while its evaluation loop runs), an entry ``"mode net.2"`` for each module in eval mode;
* the Python attributes set on a parameter or buffer tensor itself (``self.fc.weight.cache = x.detach()``), read
  as module attributes are (the engine's own, such as Opacus' ``grad_sample``, skipped), and those of every other
  tensor reached as state (a plain tensor attribute, a tensor in a container: :func:`kept_attributes`);
* the attributes of every module whose class is not torch's own — tensors, NumPy arrays, numbers,
  strings, containers of them, and plain Python objects (a ``RunningMeanStd`` helper) to a bounded depth;
  a torchmetrics ``Metric`` contributes only its persistent states (non-persistent ones feed ``self.log``,
  whose values are reported, not released: see the README's caveats);
* the same attributes of every callback that is handed the batch (it overrides ``on_train_batch_start``,
  ``on_train_batch_end`` or ``on_before_backward``), or that read a value logged from the data (:meth:`watch`), and
  is not one of Lightning's or lightning_dp's own, and what its ``state_dict()`` returns (what a checkpoint keeps of
  it); and of the user's LightningDataModule (the first step's epoch-hook replays take every user callback's:
  ``take(every_callback=True)``);
* the data held by the user's classes themselves (:func:`class_attributes`: ``history = []`` in a class body);
* attributes added to the loop's own objects (the trainer, its strategy, the optimizers, the training loader, its
  loops, accelerator, precision plugin, profiler and loggers) after the first fingerprint: ``trainer.memory = batch``,
  and private names holding a tensor or an array (``library_objects``; set by the Lightning glue);
* what the user's hooks on the model's modules keep (forward and backward hooks: closure cells, default arguments,
  a partial's arguments, a bound method's object, the function's own attributes: ``hook.stats = x``), hooks
  defined by libraries (the engine's) left out; the same for the user's functions reached as state;
* the training dataset's tensors and those of every dataset reached above (:func:`dataset_token`: identity and
  version counter, so a record written in place shows), and its records kept as NumPy arrays or lists;
* the module-level globals of the user's code (:func:`user_modules`: the modules defining the LightningModule and
  the callbacks above), read as attributes are, under the Lightning strategies (a plain loop's own globals change
  every iteration).

What it cannot see: globals of other modules and of plain loops, what a file on disk holds (a stream kept on the
module is compared by its position, an in-memory ``BytesIO``/``StringIO`` or ``bytearray`` by its contents),
closures, objects of library classes mutated in place (their identity is compared, not their contents),
containers beyond :data:`MAX_ITEMS` items (their length and a sample are compared), and writes through an integer
buffer's ``.data`` between full passes (the version counter of ``.data`` is not the tensor's; the norms of
parameters and floating buffers are compared every time). Entries matching a declared public name
(``public_state``) are skipped.
"""

from __future__ import annotations

import array
import dataclasses
import datetime
import enum
import fnmatch
import functools
import hashlib
import io
import sys
import types
import weakref
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.clipping.flat import FlatClipping
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.library_objects import (  # noqa: F401  (re-exported: the validators import them here)
    LIBRARY_PREFIXES, TRUSTED_CALLBACK_PREFIXES, framework_keys, library_callback)
from lightning_dp.records.library_objects import is_library as _is_library

Fingerprint = dict[str, Hashable]
"""Entry name (``"buffer stats.count"``, ``"attribute queue"``, ``"callback Memory.bank"``) → token."""

MAX_ITEMS = 16384
"""Container items tokenised one by one; a longer container is compared by its length and a strided sample."""

MAX_DEPTH = 4
"""Nesting depth followed into containers and plain objects."""

DATA_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward")
"""The callback hooks that are handed the private batch, its outputs or its loss. The others see only what is public
or guarded: ``on_after_backward`` and ``on_before_optimizer_step`` run after the release (``p.grad`` = ĝ_t), epoch
hooks see the module (whose state is fingerprinted) and the logged metrics (reported, not released: README caveats),
validation hooks see held-out data."""


def attribute_keys(module: nn.Module) -> set[str]:
    """Every attribute name held by ``module`` or a submodule (before and after an engine attaches: the difference
    is the engine's own, never fingerprinted nor restored)."""
    return {key for m in module.modules() for key in vars(m)}


def is_public(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` (``queue``, ``encoder.stats.mean``, ``MyCallback.bank``) is covered by a declared public
    name: an exact match, a prefix followed by ``.`` or ``[``, or a shell-style wildcard (``metrics.*``)."""
    for pattern in patterns:
        if path == pattern or path.startswith(pattern + ".") or path.startswith(pattern + "["):
            return True
        if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(path, pattern):
            return True
    return False


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` is a LightningDataModule (of either Lightning package)."""
    return any(b.__name__ == "LightningDataModule" for b in type(obj).__mro__)


def trusted_callback(callback: Any) -> bool:
    """A callback whose state cannot hold private data: one of Lightning's or lightning_dp's own, or one that
    overrides none of the hooks handed the batch (:data:`DATA_HOOKS`). The trainer's LightningDataModule is never
    trusted unless a library defines it: the step reaches it (``self.trainer.datamodule.memory.append(x)``)."""
    cls = type(callback)
    if cls.__module__.startswith(TRUSTED_CALLBACK_PREFIXES):
        return True
    if is_datamodule(callback):
        return cls.__module__.split(".")[0] in LIBRARY_PREFIXES  # the step reaches it: self.trainer.datamodule
    bases = [b for b in cls.__mro__[1:] if b.__module__.startswith(TRUSTED_CALLBACK_PREFIXES)]
    base = bases[0] if bases else object
    return all(getattr(cls, hook, None) is getattr(base, hook, None) for hook in DATA_HOOKS)


class _Checksums:
    """Content checksums of tensors, cached by (identity, storage, version counter): unchanged tensors cost a
    dictionary lookup; changed ones one float64 reduction each, gathered with one host copy per device."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, tuple[Any, ...], bytes]] = {}  # id → (weak reference, key, checksum)

    @staticmethod
    def key(t: Tensor) -> tuple[Any, ...]:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.layout != torch.strided:  # sparse: no storage of its own to key on, so never taken as unchanged
            return (id(t), object(), t._version, tuple(t.shape), t.dtype)
        return (id(t), local.data_ptr() if local.numel() else 0, t._version, tuple(t.shape), t.dtype)

    def tokens(self, tensors: Sequence[Tensor], full: bool) -> list[Hashable]:
        keys = [self.key(t) for t in tensors]
        todo = [i for i, (t, k) in enumerate(zip(tensors, keys)) if full or not self._fresh(t, k)]
        for i, value in zip(todo, content_sums([tensors[i] for i in todo])):
            self._cache[id(tensors[i])] = (weakref.ref(tensors[i]), keys[i], value)
        return [(k[3], str(k[4]), self._cache[id(t)][2]) for t, k in zip(tensors, keys)]

    def _fresh(self, t: Tensor, key: tuple[Any, ...]) -> bool:
        """A cached checksum of this very tensor (not a new one at a reused address) at this version."""
        cached = self._cache.get(id(t))
        return cached is not None and cached[0]() is t and cached[1] == key

    def forget(self) -> None:
        self._cache.clear()


def content_sums(tensors: Sequence[Tensor]) -> list[bytes]:
    """(Σx, Σx², Σ w_j x_j) in float64 per tensor, w_j = 1 + (j mod 251): a write of any value shows, and a
    permutation of values mostly does too."""
    out: list[Optional[bytes]] = [None] * len(tensors)
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            local = t.to_local() if hasattr(t, "to_local") else t
            x = _flat_contents(local.detach())
            if x.numel() == 0:
                stats = torch.zeros(3, dtype=torch.float64, device=x.device)
            else:
                weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64).remainder_(251).add_(1)
                stats = torch.stack([x.sum(), x.square().sum(), (x * weights).sum()])
            by_device.setdefault(stats.device, []).append((i, stats))
        for items in by_device.values():
            host = torch.stack([s for _, s in items]).cpu().numpy()
            for (i, _), row in zip(items, host):
                out[i] = row.tobytes()
    return [b for b in out if b is not None]


def _flat_contents(x: Tensor) -> Tensor:
    """``x``'s numbers as one float64 vector: a strided tensor's elements (complex as pairs), a sparse tensor's indices
    then values (a sparse adjacency kept by a graph model: no dense copy)."""
    if x.layout != torch.strided:
        coo = x if x.layout == torch.sparse_coo else x.to_sparse_coo()
        return torch.cat([coo._indices().reshape(-1).to(torch.float64), _flat_contents(coo._values())])
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.reshape(-1).to(torch.float64)


class StateFingerprint:
    """Takes fingerprints of one module's state and of some callbacks' (see the module docstring).

    Args:
        module: the model.
        public: declared public names (:func:`is_public`); their entries are never fingerprinted.
        skip_keys: attribute names the mechanism itself keeps on modules (its engine's).
        parameters: where the parameters are read (default: ``module.named_parameters``).
    """

    def __init__(self, module: nn.Module, public: Sequence[str] = (), skip_keys: Iterable[str] = (),
                 parameters: Optional[Callable[[], Iterable[tuple[str, Tensor]]]] = None) -> None:
        self.module = module
        self.public = tuple(public)
        self.skip_keys = frozenset(skip_keys) | framework_keys()
        self.parameters = parameters
        """(name, tensor) of the parameters the module keeps between steps, when not its registered ones (under
        FSDP2 the sharded ones: :meth:`~lightning_dp.sharding.fsdp_layout.FSDPLayout.sharded_parameters`)."""
        self.datasets: Callable[[], Iterable[Any]] = lambda: ()
        """The training data (:func:`dataset_token`: written in place, a record would no longer be itself)."""
        self.library_objects: Callable[[], Iterable[tuple[str, Any]]] = lambda: ()
        """(label, object) of the loop's own objects a step could stash data on (the trainer, its strategy, the
        optimizers, the training loader; set by the Lightning glue): their public attributes added after the first
        fingerprint are kept state."""
        self._known_keys: dict[int, set[str]] = {}
        self._readers: set[int] = set()  # callbacks that read a value logged from the data (:meth:`watch`)
        self._state_keys: dict[int, tuple[nn.Module, tuple[Any, ...], list[str]]] = {}  # :meth:`_attributes`' names
        self.modules: Callable[[], Iterable[types.ModuleType]] = lambda: ()
        """The Python modules whose globals are fingerprinted too (:func:`user_modules`; set by the Lightning glue)."""
        self._sums = _Checksums()
        self.every_callback = False  # take()'s default: every callback's state, not only the batch-handed ones'
        self._gradients: dict[str, tuple[int, int]] = {}
        self.graded: list[str] = []  # where the last fingerprint found tensors holding a gradient they did not hold
        # (or not this one, or not so) at the one before: a backward's since (:class:`_Walker`)
        self._layout: Optional[list[tuple[str, nn.Module, Optional[list[str]]]]] = None
        self._counts: list[int] = []
        self._registered: set[int] = set()
        self._param_slots: list[tuple[str, dict, str]] = []
        self._all_param_slots: list[tuple[str, dict, str]] = []
        self._buffer_slots: list[tuple[str, dict, str]] = []
        self._public_memo: dict[str, bool] = {}

    def refresh(self) -> None:
        """Walk the module tree again at the next fingerprint (a re-attached engine, a changed parameter set)."""
        self._layout = None

    def _structure(self) -> list[tuple[str, nn.Module, Optional[list[str]]]]:
        """(name prefix, module, attribute mode) of every module, walked once (again when a module gains or loses a
        parameter or buffer): the mode is ``None`` for torch's own layers (configuration only), the persistent state
        names of a torchmetrics ``Metric``, else ``[]`` (all). Also the parameter and buffer slots, public ones left
        out, as (entry name, the module's dict, key): a tensor replaced in its slot is read anew."""
        if self._layout is not None and self._counts == [len(m._parameters) + len(m._buffers)
                                                         for _, m, _ in self._layout]:
            return self._layout
        self._layout = [(f"{name}." if name else "", m, _attribute_mode(m)) for name, m in self.module.named_modules()]
        self._counts = [len(m._parameters) + len(m._buffers) for _, m, _ in self._layout]
        self._registered = {id(m) for _, m, _ in self._layout}
        self._all_param_slots = [(prefix + key, m._parameters, key) for prefix, m, _ in self._layout
                                 for key in m._parameters]
        self._param_slots = [(f"parameter {name}", slots, key) for name, slots, key in self._all_param_slots
                             if not self._is_public(name)]
        self._buffer_slots = [(f"buffer {prefix}{key}", m._buffers, key) for prefix, m, _ in self._layout
                              for key in m._buffers if not self._is_public(prefix + key)]
        return self._layout

    def trainable(self) -> list[tuple[str, Tensor]]:
        """(name, parameter) of every trainable parameter, each once (as ``named_parameters``, without walking the
        module tree again: from the slots of :meth:`_structure`)."""
        if self.parameters is not None:
            return [(name, p) for name, p in self.parameters() if p.requires_grad]
        self._structure()
        out, seen = [], set()
        for name, slots, key in self._all_param_slots:
            p = slots.get(key)
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def _is_public(self, path: str) -> bool:
        known = self._public_memo.get(path)
        if known is None:
            known = self._public_memo[path] = is_public(path, self.public)
        return known

    # ------------------------------------------------------------------ taking
    def take(self, callbacks: Sequence[Any] = (), full: bool = False, every_callback: bool = False) -> Fingerprint:
        """The fingerprint now. ``full``: recompute every content checksum (parameters included).
        ``every_callback``: the state of every callback that is not a library's, handed the batch or not (the
        epoch hooks' replays: :mod:`~lightning_dp.validators.hook_replays`)."""
        entries: Fingerprint = {}
        tensors: list[tuple[str, Tensor]] = []
        layout = self._structure()
        if self.parameters is not None:
            params = [(f"parameter {name}", p) for name, p in self.parameters() if not self._is_public(name)]
        else:
            params = [(name, slots[key]) for name, slots, key in self._param_slots if slots.get(key) is not None]
        plain: list[tuple[str, Tensor]] = []
        if full:
            tensors.extend(params)
        else:
            for name, p in params:
                if type(p) is nn.Parameter and p.layout == torch.strided:
                    plain.append((name, p))
                    entries[name] = (p.data_ptr(), p._version, p.shape)
                else:
                    entries[name] = self._sums.key(p)[1:]
        buffers = [(name, slots[key]) for name, slots, key in self._buffer_slots if slots.get(key) is not None]
        tensors.extend(buffers)
        if not full:  # norms show a write through .data, which moves no version counter
            plain.extend((name, b) for name, b in buffers if type(b) is Tensor and b.dtype.is_floating_point
                         and b.layout == torch.strided and b.numel())
            entries.update(_norm_tokens(plain))
        seen = {id(p) for _, p in params} | {id(b) for _, b in buffers}
        walker = _Walker(seen, self._registered, self._sums, full, self.skip_keys)
        for name, t in (*params, *buffers):
            if t.__dict__:  # Python attributes set on the tensor itself (`self.fc.weight.cache = x`)
                self._tensor_attributes(entries, name.partition(" ")[2], t, walker)
        for prefix, m, mode in layout:
            if mode is None:
                continue
            for key, value in self._attributes(m, mode):
                path = prefix + key
                if not self._is_public(path):
                    entries[f"attribute {path}"] = walker.named(path, value)
            if mode is _DATA_ONLY:  # a torch layer's configuration steers the step too (Dropout.p, label_smoothing)
                for key, value in _configuration(m):
                    if not self._is_public(prefix + key):
                        entries[f"configuration {prefix}{key}"] = value
        modes = training_modes(self.module, layout)  # a dropout switched off from the loss steers later steps
        for name, training in modes.items():
            entry = f"mode {name or '(model)'}"  # declared public by its name or by the entry's (as refusals say)
            if not training and not self._is_public(name) and not self._is_public(entry):
                entries[entry] = "eval"
        for prefix, m, _ in layout:
            for kind in _HOOK_DICTS:
                for handle, fn in (getattr(m, kind, None) or {}).items():
                    path = f"{prefix}{kind}[{handle}]"
                    if (not _library_callable(fn) or _binds(fn)) and not self._is_public(path):
                        entries[f"hook {path}"] = (*(walker.token(v) for v in callable_state(fn)),
                                                   *walker.attributes(fn))
        for cb in callbacks:
            every = every_callback or self.every_callback
            if (library_callback(cb) if every else trusted_callback(cb)) and id(cb) not in self._readers:
                continue
            label = type(cb).__name__
            kind = "datamodule" if is_datamodule(cb) else "callback"
            for key, value in _callback_state(cb):
                path = f"{label}.{key}"
                if not self._is_public(path) and not self._is_public(label):
                    entries[f"{kind} {path}"] = walker.named(path, value)
        users = [m for _, m, mode in layout if mode == []] + [cb for cb in callbacks if not trusted_callback(cb)]
        for cls, key, value in class_attributes(type(obj) for obj in users):
            path = f"{cls.__qualname__}.{key}"
            if not self._is_public(path) and not self._is_public(key):
                entries[f"class attribute {path}"] = walker.named(path, value)
        for label, obj in self.library_objects():
            fields = getattr(obj, "__dict__", {})
            known = self._known_keys.setdefault(id(obj), set(fields))
            for key, value in fields.items():
                # a name the libraries set later (`_opt_called`, `_last_val_time`) is theirs unless it holds data;
                # so is a function of theirs (a scheduler made mid-fit wraps `optimizer.step`: SWA's SWALR)
                if key not in known and (not key.startswith("_") or _holds_tensors(value)) \
                        and not _library_function(value) and not self._is_public(f"{label}.{key}"):
                    entries[f"attribute {label}.{key}"] = walker.named(f"{label}.{key}", value)
        entries.update(self.dataset_entries())
        for mod in self.modules():
            for key, value in list(vars(mod).items()):
                if isinstance(value, type) and value.__module__ == mod.__name__ and not key.startswith("__"):
                    self._class_entries(entries, value, walker)  # a class of the user's own module: its data
                    continue
                if key.startswith("__") or isinstance(value, (types.ModuleType, type)) \
                        or (isinstance(value, _FUNCTIONS) and not _mutable_state(value)):
                    continue  # a function that keeps a list, dict or tensor (a default argument, a closure) is state
                path = f"{mod.__name__}.{key}"
                if not self._is_public(key) and not self._is_public(path):
                    entries[f"global {path}"] = walker.named(path, value)
        names = [n for n, _ in tensors]
        entries.update(zip(names, self._sums.tokens([t for _, t in tensors], full)))
        self.graded = [name for name, key in walker.graded.items() if self._gradients.get(name) != key]
        self._gradients = walker.graded
        return entries

    def _class_entries(self, entries: Fingerprint, cls: type, walker: "_Walker") -> None:
        """Entries for the data a class of the user's own module holds in its body (:func:`class_attributes`): an
        ``autograd.Function`` subclass keeping the last step's raw gradient scale, a namespace class used as a mutable
        config (``HP.temperature`` set from the loss) — read by every later step, as a module's global is."""
        for owner, key, value in class_attributes([cls]):
            path = f"{owner.__module__}.{owner.__qualname__}.{key}"
            if not self._is_public(path) and not self._is_public(f"{owner.__qualname__}.{key}") \
                    and not self._is_public(key):
                entries[f"class attribute {path}"] = walker.named(path, value)

    def dataset_entries(self) -> Fingerprint:
        """The training data's entries (:func:`dataset_token`)."""
        return {f"dataset {i} ({type(d).__name__})": dataset_token(d) for i, d in enumerate(self.datasets())}

    def with_new_datasets(self, baseline: Fingerprint, callbacks: Sequence[Any] = ()) -> Fingerprint:
        """``baseline`` with the training data's entries, and the LightningDataModule's (which built the loader), taken
        now: a loader rebuilt on other records (``reload_dataloaders_every_n_epochs``), what they are now is what
        later steps must leave as it is."""
        fresh = {k: v for k, v in self.take(callbacks).items() if k.startswith("datamodule ")}
        kept = {k: v for k, v in baseline.items() if not k.startswith(("dataset ", "datamodule "))}
        return {**kept, **fresh, **self.dataset_entries()}

    def watch(self, callback: Any, baseline: Fingerprint, callbacks: Sequence[Any]) -> Fingerprint:
        """``callback`` read a value logged from the training data (:mod:`~lightning_dp.validators.logged_reads`):
        from now on its state is kept state, whatever hooks it overrides; returns ``baseline`` with its state now."""
        if id(callback) in self._readers or not trusted_callback(callback) \
                or type(callback).__module__.startswith(TRUSTED_CALLBACK_PREFIXES):
            return baseline
        self._readers.add(id(callback))
        now = self.take(callbacks)
        return {**baseline, **{k: v for k, v in now.items() if k not in baseline}}

    def _tensor_attributes(self, entries: Fingerprint, path: str, t: Tensor, walker: "_Walker") -> None:
        """Entries for the Python attributes of a parameter or buffer (the engine's own and torch's skipped)."""
        for key, value in vars(t).items():
            if key in self.skip_keys or key.startswith(("_dp_", "_dynamo_")) or _library_function(value):
                continue  # torch.compile marks the parameters it saw (`_dynamo_static_input_type`): torch's own
            if not self._is_public(f"{path}.{key}"):
                entries[f"attribute {path}.{key}"] = walker.named(f"{path}.{key}", value)

    def _attributes(self, m: nn.Module, mode: list[str]) -> list[tuple[str, Any]]:
        """(name, value) of ``m``'s attributes that are state (see :func:`_attribute_mode`). Which names those are is
        kept per module and reused while every attribute still holds the same object, of the same type."""
        if mode and mode is not _DATA_ONLY:
            return [(k, getattr(m, k)) for k in mode]
        fields = vars(m)
        held = (*map(id, fields.values()), *map(type, fields.values()))  # the objects, and their types (reused address)
        cached = self._state_keys.get(id(m))
        if cached is not None and cached[0] is m and cached[1] == held:
            return _rnn_listing(m, [(k, fields[k]) for k in cached[2]])
        keys = []
        for key, value in fields.items():
            if (key in self.skip_keys or key.startswith("_dp_") or isinstance(value, nn.Module)
                    or _library_function(value)):
                continue
            if mode is _DATA_ONLY and (value is None or isinstance(value, _CONFIGURATION) or callable(value)):
                continue  # a torch layer's configuration, or a forward swapped in (torch.compile, an engine)
            keys.append(key)
        self._state_keys[id(m)] = (m, held, keys)
        return _rnn_listing(m, [(k, fields[k]) for k in keys])

    # ------------------------------------------------------------------ comparing
    @staticmethod
    def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
        """Entries that differ, appeared or disappeared, in a stable order."""
        names = list(after) + [n for n in before if n not in after]
        return [n for n in names if before.get(n, _MISSING) != after.get(n, _MISSING)]

    def forget(self) -> None:
        """Drop cached checksums (a later fingerprint recomputes them)."""
        self._sums.forget()


_MISSING = object()
_CONFIGURATION = (bool, int, float, str, tuple, torch.dtype, torch.device, torch.Size)
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


_DATA_ONLY = ["<data>"]
"""The attribute mode of torch's own layers: only values that can hold data (tensors, arrays, containers, objects)."""


def _rnn_listing(m: nn.Module, fields: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``fields`` of a torch RNN layer with its list of weights for the fused kernel (``_flat_weights``, and the weak
    references ``_flat_weight_refs`` that tell it is stale) read as what its next forward runs on. torch keeps that
    list itself, from the parameters: a ``functional_call`` (the per-example replay of a layer whose inter-layer
    dropout draws, the probe's dropout-free pass) leaves its substitutes listed, and the next forward lists the
    parameters again (``_update_flat_weights``). So the entry is, per weight, whether the next forward runs on a
    parameter (or on the weight the module holds now: a ``functional_call``'s while it runs): always, when the listing
    is stale; a plain tensor written into an up-to-date list is still seen."""
    if not isinstance(m, nn.RNNBase) or not all(hasattr(m, k) for k in ("_flat_weights", "_flat_weights_names")):
        return fields
    stale = getattr(m, "_weights_have_changed", None)
    relisted = bool(stale()) if callable(stale) else False
    runs_on = tuple(relisted or isinstance(w, nn.Parameter) or w is getattr(m, name, None)
                    for name, w in zip(m._flat_weights_names, m._flat_weights))
    return [(k, runs_on if k == "_flat_weights" else v) for k, v in fields if k != "_flat_weight_refs"]


def _configuration(m: nn.Module) -> list[tuple[str, Any]]:
    """A torch layer's numbers and flags that set what its forward computes (``Dropout.p``, ``eps``, a loss's
    ``label_smoothing`` or ``reduction``): set from the data between two releases they steer the next step by it.
    Its mode (``training``) is read apart, as the next training step will run it (:func:`training_modes`)."""
    return [(k, v) for k, v in vars(m).items()
            if type(v) in _NUMBERS and k != "training" and not k.startswith("_")]


_NUMBERS = (bool, int, float, str)


_EVALUATING = ("validating", "sanity_checking", "testing", "predicting")


def training_modes(module: nn.Module, layout: Optional[Sequence[tuple[str, nn.Module, Any]]] = None) -> dict[str, bool]:
    """Every submodule's mode (``training``; name → flag, the model's own under ``""``) as the next training step will
    run it: a dropout put in eval mode once the batch loss is low (``self.net[2].eval()``) is a decision taken from the
    data, kept for every later step. While Lightning's evaluation loop runs (the sanity check, a validation inside the
    fit, ``trainer.validate``/``test``/``predict``) the modes are those it captured before putting the model in eval
    mode and puts back after (``_ModuleMode``): its own toggling is not the user's decision."""
    pairs = [(prefix[:-1] if prefix else "", m) for prefix, m, _ in layout] if layout is not None \
        else list(module.named_modules())
    modes = {name: m.training for name, m in pairs}
    captured = _captured_modes(module) if not module.training else None
    if captured:
        modes.update({name: captured[name] for name in modes if name in captured})
    return modes


def _captured_modes(module: nn.Module) -> Optional[dict[str, bool]]:
    """The modes Lightning's running evaluation loop captured (and will put back), or ``None`` outside one."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not any(getattr(trainer, flag, False) for flag in _EVALUATING):
        return None
    try:
        loop = trainer.predict_loop if trainer.predicting else trainer._evaluation_loop
    except Exception:  # noqa: BLE001  (no evaluation loop in scope)
        return None
    mode = getattr(getattr(loop, "_module_mode", None), "mode", None)
    return mode if isinstance(mode, dict) else None


def _attribute_mode(m: nn.Module) -> Optional[list[str]]:
    """How :class:`StateFingerprint` reads ``m``'s attributes: for torch's own layers only the values that can hold
    data (their configuration — sizes, flags, names — is not state, but a tensor a user caches on an ``nn.Linear`` is:
    :data:`_DATA_ONLY`), for a torchmetrics ``Metric`` the names of its persistent states (``None``: it has none),
    else ``[]``: every attribute."""
    if type(m).__module__.startswith("torch."):
        return _DATA_ONLY
    states = _metric_states(m)
    if states is not None:
        return states if states else None
    return []


def _metric_states(m: nn.Module) -> Optional[list[str]]:
    """A torchmetrics ``Metric``'s persistent states (what its state dict keeps), or ``None`` for other modules."""
    defaults = getattr(m, "_defaults", None)
    persistent = getattr(m, "_persistent", None)
    if not isinstance(defaults, dict) or not isinstance(persistent, dict) or not hasattr(m, "_update_count"):
        return None
    return [name for name in defaults if persistent.get(name)]


_LIGHTNING_KEYS = frozenset({"_hparams_name", "_log_hyperparams", "trainer", "prepare_data_per_node",
                              "allow_zero_length_dataloader_with_multiple_devices"})
"""What Lightning keeps on a LightningDataModule (or another object with its ``HyperparametersMixin``) itself."""

_LAZY_KEYS = frozenset({"_hparams", "_hparams_initial"})
"""Made empty by Lightning on first reading ``self.hparams`` (a checkpoint reads the datamodule's): empty, they are
the same as absent; with contents (``save_hyperparameters``, ``self.hparams.x = ...``) they are state, saved in
every checkpoint."""


def _hparams_mixin(obj: Any) -> bool:
    return any(b.__name__ == "HyperparametersMixin" for b in type(obj).__mro__)


def lightning_fields(obj: Any) -> dict[str, Any]:
    """``vars(obj)``, less what Lightning keeps or lazily makes on a LightningDataModule or another
    ``HyperparametersMixin`` itself (:data:`_LIGHTNING_KEYS`, an empty ``_hparams``): the datamodule held as a global
    of the script is fingerprinted as the trainer's is."""
    fields = vars(obj)
    if not _hparams_mixin(obj):
        return fields
    return {k: v for k, v in fields.items()
            if k not in _LIGHTNING_KEYS and not (k in _LAZY_KEYS and isinstance(v, dict) and not v)}


def _callback_state(cb: Any) -> Iterator[tuple[str, Any]]:
    owned = lightning_owned(type(cb))  # a subclass of Lightning's callback: what Lightning's own code writes is its
    fields = lightning_fields(cb)
    for key, value in fields.items():
        if key not in owned and not _library_function(value):
            yield key, value
    try:
        state = cb.state_dict()
    except Exception:  # noqa: BLE001  (a user's state_dict that fails here fails in checkpoints too)
        state = None
    if state and owned and isinstance(state, dict):  # Lightning's entries (ModelCheckpoint's best_model_path) are its
        state = {k: v for k, v in state.items() if not (k in owned and v is fields.get(k, _MISSING))}
    if state:
        yield "state_dict()", state


_OWNED: "weakref.WeakKeyDictionary[type, frozenset[str]]" = weakref.WeakKeyDictionary()


def lightning_owned(cls: type) -> frozenset[str]:
    """The attributes of ``cls`` — the user's subclass of one of Lightning's (or lightning_dp's) callbacks — that are
    Lightning's state: those its own methods write (``ModelCheckpoint``'s ``best_model_path``, ``best_k_models``,
    ``kth_value``, ``current_score``; ``EarlyStopping``'s ``wait_count``, ``best_score``), from the values it monitors
    (judged by rule 10) and the loop's counters, and that the user's code never names (then it may write them: they are
    judged). Empty — everything judged — for a class that is not such a subclass, and where the user's code calls one
    of the base's own methods that are not hooks (``self._save_topk_checkpoint(trainer, {...})``: it hands Lightning's
    code values of its own) or overrides one that returns a value Lightning's code then keeps
    (``_monitor_candidates``, ``format_checkpoint_name``)."""
    try:
        known = _OWNED.get(cls)
    except TypeError:
        return frozenset()
    if known is None:
        known = _OWNED[cls] = _lightning_owned(cls)
    return known


def _lightning_owned(cls: type) -> frozenset[str]:
    library = [b for b in cls.__mro__ if (b.__module__ or "").startswith(TRUSTED_CALLBACK_PREFIXES)]
    users = [b for b in cls.__mro__ if (b.__module__ or "").split(".")[0] not in LIBRARY_PREFIXES
             and b.__module__ not in ("abc", "builtins")]
    if not library or not users or cls in library:
        return frozenset()
    hooks = {k for b in library if b.__name__ == "Callback" for k in vars(b)}
    helpers = {k for b in library for k, v in vars(b).items() if _codes(v) and k not in hooks
               and not (k.startswith("__") and k.endswith("__"))}
    named: set[str] = set()
    for b in users:
        for key, value in vars(b).items():
            codes = _codes(value)
            for code in codes:
                names = _names(code)
                if (names - {key}) & helpers:  # a helper of Lightning's called (its own, through super(): Lightning's)
                    return frozenset()
                named |= names
            if key in helpers and any(_returns_value(code) for code in codes):
                return frozenset()
    stored = {name for b in library for v in vars(b).values() for code in _codes(v) for name in _stored(code)}
    return frozenset(stored - named)


def _codes(value: Any) -> list[types.CodeType]:
    """The code objects of a class's member: a function's, a static or class method's, a property's accessors."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [c for f in (value.fget, value.fset, value.fdel) for c in _codes(f)]
    code = getattr(value, "__code__", None)
    return [code] if isinstance(code, types.CodeType) else []


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _names(code: types.CodeType) -> set[str]:
    """Every attribute and global name ``code`` (and the functions it defines) reads or writes."""
    return {name for c in _nested(code) for name in c.co_names}


def _stored(code: types.CodeType) -> set[str]:
    """The attribute names ``code`` (and the functions it defines) assigns (``self.best_model_path = ...``)."""
    import dis

    return {ins.argval for c in _nested(code) for ins in dis.get_instructions(c)
            if ins.opname in ("STORE_ATTR", "DELETE_ATTR")}


def _returns_value(code: types.CodeType) -> bool:
    """Whether ``code`` may return something other than None."""
    import dis

    instructions = list(dis.get_instructions(code))
    for before, ins in zip([None, *instructions], instructions):
        if ins.opname == "RETURN_CONST" and ins.argval is not None:
            return True
        if ins.opname == "RETURN_VALUE" and not (before is not None and before.opname == "LOAD_CONST"
                                                 and before.argval is None):
            return True
    return False


class _Walker:
    """Turns Python values into hashable tokens; tensors go through the shared checksum cache."""

    def __init__(self, params_and_buffers: set[int], registered: set[int], sums: _Checksums, full: bool,
                 skip_keys: frozenset[str] = frozenset()) -> None:
        self._known = params_and_buffers
        self._skip_keys = skip_keys
        self._registered = registered
        self._sums = sums
        self._full = full
        self._objects: set[int] = set()
        self._name = ""
        self.graded: dict[str, tuple[int, int]] = {}
        """Where tensors outside the parameters hold a gradient (:func:`holds_gradient`): entry name → the gradient's
        identity and version counter."""

    def named(self, name: str, value: Any) -> Hashable:
        """:meth:`token` of the value held at entry ``name`` (what :attr:`graded` names)."""
        self._name = name
        return self.token(value)

    def token(self, value: Any, depth: int = 0) -> Hashable:
        if value is None or isinstance(value, (bool, int, str, bytes)):
            return (type(value).__name__, value)
        if isinstance(value, float):
            return ("float", repr(value))
        if isinstance(value, Tensor):
            if id(value) in self._known:
                return ("state tensor", id(value))  # a parameter or buffer held again: fingerprinted by its name
            if holds_gradient(value):
                self.graded[self._name] = (id(value.grad), value.grad._version)
            token = ("tensor", self._sums.tokens([value], self._full)[0])
            if value.__dict__ and depth < MAX_DEPTH:  # Python attributes set on the tensor (`self.temp.stats = x`)
                return (*token, *self.attributes(value, depth))
            return token
        if callable(getattr(value, "cache_info", None)) and callable(getattr(value, "cache_clear", None)):
            return ("cached function", getattr(value, "__qualname__", ""), value.cache_info().currsize)  # lru_cache
        if isinstance(value, types.GeneratorType) and depth < MAX_DEPTH:  # a running average kept in its frame
            frame = value.gi_frame
            return ("generator", getattr(value, "__qualname__", ""),
                    tuple((k, self.token(v, depth + 1)) for k, v in (frame.f_locals if frame else {}).items()))
        np_token = _numpy_token(value)
        if np_token is not None:
            return np_token
        if isinstance(value, nn.Module) and id(value) not in self._registered and depth < MAX_DEPTH:
            # a module held outside the model's registry (in a Python list, a dict, a helper object): its tensors are
            # nobody else's to fingerprint
            tensors = [*value.parameters(), *value.buffers()]
            return ("unregistered module", type(value).__name__, tuple(self.token(t, depth + 1) for t in tensors))
        if isinstance(value, _FUNCTIONS) and (not _library_callable(value) or _binds(value)) and depth < MAX_DEPTH:
            if id(value) in self._objects:
                return ("seen", id(value))
            self._objects.add(id(value))  # what a closure, a default argument, a bound object or its attributes keep
            return ("callable", getattr(value, "__qualname__", type(value).__name__),
                    tuple(self.token(v, depth + 1) for v in callable_state(value)), *self.attributes(value, depth))
        if isinstance(value, (nn.Module, _FUNCTIONS)):
            return (type(value).__name__, id(value))
        if depth >= MAX_DEPTH:
            return ("deep", type(value).__name__, id(value))
        if isinstance(value, (list, tuple, deque)):
            return (type(value).__name__, len(value), tuple(self.token(v, depth + 1) for v in _sample(value)))
        if isinstance(value, dict):
            return (type(value).__name__, len(value),
                    tuple((repr(k), self.token(v, depth + 1)) for k, v in _sample(list(value.items()))))
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, len(value), frozenset(self.token(v, depth + 1) for v in value))
        raw = _raw_token(value)
        if raw is not None:
            return raw
        if isinstance(value, Dataset):
            return dataset_token(value)  # the data, not state: its tensors by version, so an in-place write shows
        if _is_library(value) and _configuration_object(value) and id(value) not in self._objects:
            self._objects.add(id(value))  # a library's configuration (Hugging Face's model.config): a namespace
            return ("configuration", type(value).__name__,
                    tuple((k, self.token(v, depth + 1)) for k, v in vars(value).items() if not k.startswith("_")))
        if _is_library(value) or not hasattr(value, "__dict__") or isinstance(value, type):
            return ("object", type(value).__name__, id(value))
        if id(value) in self._objects:
            return ("seen", id(value))
        self._objects.add(id(value))
        fields = lightning_fields(value)  # a LightningDataModule held as a global: its lazily made `_hparams` skipped
        shared = [(f"{c.__qualname__}.{k}", v) for c, k, v in class_attributes([type(value)])]  # `history = []`
        return ("object", type(value).__name__,
                tuple((k, self.token(v, depth + 1)) for k, v in [*fields.items(), *shared]
                      if not _library_function(v)))

    def attributes(self, value: Any, depth: int = 0) -> tuple[Hashable, ...]:
        """Tokens of the Python attributes a tensor or a user's function holds in its ``__dict__`` (``hook.stats = x``,
        ``self.temp.stats = x`` on a plain tensor attribute), torch's, Python's and the mechanism's own skipped
        (:func:`kept_attributes`); empty when there are none."""
        fields = kept_attributes(value, self._skip_keys)
        if not fields:
            return ()
        return (("attributes", len(fields),
                 tuple((k, self.token(v, depth + 1)) for k, v in _sample(fields))),)


def kept_attributes(value: Any, skip_keys: frozenset[str] = frozenset()) -> list[tuple[str, Any]]:
    """(name, value) of the Python attributes set on a tensor or a function of the user's (its ``__dict__``): the
    mechanism's engine's (``skip_keys``, ``_dp_``), torch's (``_dynamo_``, ``_torchdynamo_``), dunder names
    (``__wrapped__``: what a wrapper calls is in its closure too) and libraries' functions left out. A tensor
    subclass of a library's (DTensor's ``_local_tensor``, ``_spec``) keeps its own."""
    if isinstance(value, functools.partial):  # a partial's own attributes, and its function's
        own = kept_attributes(types.SimpleNamespace(**vars(value)), skip_keys)
        return [*own, *kept_attributes(value.func, skip_keys)]
    if isinstance(value, types.MethodType):
        return kept_attributes(value.__func__, skip_keys)
    if isinstance(value, Tensor):
        if type(value) not in (Tensor, nn.Parameter) and _is_library(value):
            return []
    elif not isinstance(value, (types.FunctionType, types.SimpleNamespace)) or _library_callable(value):
        return []
    fields = getattr(value, "__dict__", None)
    if not fields:
        return []
    return [(k, v) for k, v in list(fields.items()) if isinstance(k, str) and k not in skip_keys
            and not k.startswith(("_dp_", "_dynamo_", "_torchdynamo_", "__")) and not _library_function(v)]


def _configuration_object(value: Any) -> bool:
    """A library's configuration object: a dataclass or an object that writes itself out as a dict (Hugging Face's
    ``PretrainedConfig`` and ``GenerationConfig``, peft's configs). Code uses one as a namespace
    (``model.config.temperature = …``), and it is saved with the model (``config.json``): its public fields are read
    as state; its ``_``-prefixed ones are the library's own."""
    return hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module, Tensor)) \
        and (dataclasses.is_dataclass(value) or callable(getattr(value, "to_dict", None)))


def holds_gradient(t: Tensor) -> bool:
    """Whether ``t`` holds a gradient a backward left in it: a leaf that requires grad (a temperature, loss weights
    kept outside the parameters) or a tensor that retains its gradient (``h.retain_grad()``). Nothing noised it."""
    if not t.requires_grad:
        return False
    if t.is_leaf:
        return t.grad is not None
    return t.retains_grad and t.grad is not None


def _mutable_defaults(fn: Any) -> bool:
    """Whether a function keeps a list, dict, set or tensor as a default argument or in a closure."""
    return any(isinstance(v, (list, dict, set, deque, Tensor)) for v in callable_state(fn))


def _mutable_state(fn: Any) -> bool:
    """Whether a function keeps something it can write between calls (:func:`_mutable_defaults`, or its own
    attributes: ``fn.stats = x``, whatever they hold)."""
    return _mutable_defaults(fn) or bool(kept_attributes(fn))


def class_attributes(classes: Iterable[type]) -> Iterator[tuple[type, str, Any]]:
    """(class, name, value) of the data held by the user's classes themselves — ``history = []`` in a class body,
    shared by every instance, appended through ``self.history`` — for ``classes`` and their bases, libraries'
    left out; methods, properties and other descriptors, nested classes and dunder names skipped."""
    seen: set[type] = set()
    for cls in classes:
        for base in cls.__mro__:
            if base in seen or (base.__module__ or "").split(".")[0] in LIBRARY_PREFIXES:
                continue
            seen.add(base)
            for key, value in list(vars(base).items()):
                if isinstance(value, types.FunctionType) and not key.startswith("__"):  # a method: what it keeps
                    if _mutable_defaults(value):
                        yield base, f"{key}.__defaults__", value.__defaults__ or ()  # `def f(self, v, _acc={})`
                    fields = kept_attributes(value)
                    if fields:  # `MyModel.forward.stats = x`
                        yield base, f"{key}.__dict__", dict(fields)
                    continue
                if key.startswith("__") or hasattr(type(value), "__get__") \
                        or isinstance(value, (type, types.ModuleType)):
                    continue
                yield base, key, value


def _holds_tensors(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is or holds (in a list, tuple, deque or dict, two levels deep) a tensor or a NumPy array."""
    if isinstance(value, Tensor) or type(value).__module__ == "numpy":
        return True
    if depth < 2 and isinstance(value, (list, tuple, deque)):
        return any(_holds_tensors(v, depth + 1) for v in _sample(value))
    if depth < 2 and isinstance(value, dict):
        return any(_holds_tensors(v, depth + 1) for v in _sample(list(value.values())))
    return False


def dataset_parts(dataset: Any) -> tuple[list[Any], list[tuple[str, Tensor]]]:
    """The datasets ``dataset`` is made of (itself and those it wraps: ``Subset.dataset``, ``ConcatDataset.datasets``,
    any dataset held as an attribute) and the tensors they hold (in their attributes and in those attributes'
    lists, tuples and dicts of at most 64 items), each once, six attribute or item levels deep; tensors named by
    their path."""
    datasets: list[Any] = []
    tensors: list[tuple[str, Tensor]] = []
    seen: set[int] = set()

    def visit(value: Any, path: str, depth: int) -> None:
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, Tensor):
            tensors.append((path, value))
        elif isinstance(value, (list, tuple)) and len(value) <= 64:
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict) and len(value) <= 64:
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, Dataset):
            datasets.append(value)
            for key, item in (vars(value).items() if hasattr(value, "__dict__") else ()):
                visit(item, f"{path}.{key}", depth + 1)

    visit(dataset, "", 0)
    return datasets, tensors


def dataset_token(dataset: Any) -> Hashable:
    """A dataset's identity and its tensors (:func:`dataset_parts`) by identity, shape and version counter, and the
    records its datasets hold as NumPy arrays or Python lists of numbers or strings (:func:`_records_token`): a
    record written in place (a label relabelled from the batch) shows. Tensors' contents are not read (a dataset's
    size is unbounded), nor are caches of other types (a dict a lazy ``__getitem__`` fills)."""
    datasets, tensors = dataset_parts(dataset)
    return ("dataset", type(dataset).__name__, id(dataset),
            tuple((path, (id(t), t._version, tuple(t.shape))) for path, t in tensors),
            tuple((key, token) for d in datasets for key, value in (vars(d).items() if hasattr(d, "__dict__") else ())
                  for token in [_records_token(value)] if token is not None))


def _records_token(value: Any) -> Optional[Hashable]:
    """A NumPy array of records (:func:`_array_digest`) or a list of plain numbers or strings (labels kept as a
    list: its length and hash), else ``None``."""
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype != object:
        return ("ndarray", value.shape, str(value.dtype), _array_digest(value))
    if isinstance(value, list) and value and isinstance(value[0], (int, float, str, bool)):
        try:
            return ("list", len(value), hash(tuple(value)))
        except TypeError:  # an unhashable item further on
            return ("list", len(value), id(value))
    return None


def user_modules(classes: Iterable[type]) -> list[types.ModuleType]:
    """The Python modules that define ``classes`` and their bases, libraries' left out (the user's own code: a
    training script's ``__main__``, the module of a LightningModule or of a callback handed the batch), whose
    module-level globals a step could write (``global MEMORY; MEMORY.append(x)``)."""
    names = {base.__module__ for cls in classes for base in cls.__mro__}
    found = [sys.modules.get(name) for name in sorted(names)
             if name and name.split(".")[0] not in LIBRARY_PREFIXES]
    return [m for m in found if m is not None]


def hyperparameters(optimizer: Any) -> Fingerprint:
    """What sets the next update besides the released gradient, as fingerprint entries: each parameter group's
    hyper-parameters (every key but ``params``: learning rate, momentum, betas, weight decay, …;
    ``"optimizer param_groups[0].lr"``), its ``defaults`` (``"optimizer defaults.lr"``) and its state
    (``"optimizer state[0][1].exp_avg"``: group, parameter, key; a tensor by identity, shape and version counter, so an
    in-place write shows)."""
    out = settings(optimizer)
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                token = ((id(value), value._version, tuple(value.shape)) if isinstance(value, Tensor)
                         else _hyper_token(value))
                out[f"optimizer state[{i}][{j}].{key}"] = token
    return out


def settings(optimizer: Any) -> Fingerprint:
    """Each parameter group's hyper-parameters and the optimizer's ``defaults`` (:func:`hyperparameters` without the
    state: cheap enough to note at every batch's end)."""
    out: Fingerprint = {f"optimizer defaults.{key}": _hyper_token(value)
                        for key, value in (getattr(optimizer, "defaults", None) or {}).items()}
    for i, group in enumerate(optimizer.param_groups):
        out.update({f"optimizer param_groups[{i}].{key}": _hyper_token(value)
                    for key, value in group.items() if key != "params"})
    return out


def steered_hyperparameters(optimizer: Any, replays: Sequence[Callable[[], None]], loop: Any = None) -> list[str]:
    """Run each of ``replays`` (the loop's batch hooks on different examples) from the optimizer as it is now
    (:func:`replay_records`) and name what the data steers: a hyper-parameter or default the replays set to different
    values (a learning rate from the loss; a warm-up from the step count sets the same value whatever the batch, and
    is allowed), or a state entry any replay wrote (a moment written from the batch)."""
    before, seen = replay_records(optimizer, replays, loop)
    apart = {n for h in seen[1:] for n in StateFingerprint.changed(seen[0], h)}
    return sorted(set(state_written(before, seen)) | apart)


def replay_records(optimizer: Any, replays: Sequence[Callable[[], None]],
                   loop: Any = None) -> tuple[Fingerprint, list[Fingerprint]]:
    """Run each of ``replays``, putting the optimizer's hyper-parameters and defaults back after each; returns the
    :func:`hyperparameters` before and after each replay. ``loop`` (the trainer): its ``should_stop``,
    ``max_epochs`` and ``max_steps`` are recorded (``"trainer should_stop"``) and put back the same way (training
    stopped, or lengthened, when the loss or a training accuracy crosses a threshold), and so are the mechanism's σ and
    C (:func:`mechanism_settings`)."""
    before = hyperparameters(optimizer)
    saved = ([{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
             dict(getattr(optimizer, "defaults", None) or {}))
    controls, mechanism = loop_controls(loop), mechanism_settings(loop)
    seen: list[Fingerprint] = []
    for replay in replays:
        try:
            replay()
        finally:
            seen.append(replay_decisions(optimizer, loop))
            put_loop_controls(loop, controls)
            put_mechanism_settings(loop, mechanism)
            for group, values in zip(optimizer.param_groups, saved[0]):  # as they were: a key a replay added goes
                params = group["params"]
                group.clear()
                group.update(values, params=params)
            if isinstance(getattr(optimizer, "defaults", None), dict):
                optimizer.defaults.clear()
                optimizer.defaults.update(saved[1])
    return before, seen


def replay_decisions(optimizer: Any, loop: Any) -> Fingerprint:
    """What :func:`replay_records` compares after each replay: the optimizer's :func:`hyperparameters`, the trainer's
    :func:`loop_controls` (``"trainer should_stop"``) and the mechanism's σ and C (:func:`mechanism_decisions`)."""
    return {**hyperparameters(optimizer), **{f"trainer {k}": v for k, v in loop_controls(loop).items()},
            **mechanism_decisions(loop)}


def step_decisions(trainer: Any) -> Fingerprint:
    """What a step may not change between its ``training_step`` and its release: σ, C and what else decides the
    release (:func:`mechanism_state`: the clipping policy's settings and state, the noise, the plan) and the trainer's
    decisions and library settings (:func:`loop_controls`), as fingerprint entries."""
    step = getattr(getattr(trainer, "strategy", None), "private_step", None)
    return {**mechanism_state(step), **{f"trainer {k}": v for k, v in loop_controls(trainer).items()}}


def state_written(before: Fingerprint, seen: Sequence[Fingerprint]) -> list[str]:
    """The optimizer state entries (moments) any replay wrote: a replay of the hooks may not touch them at all."""
    return sorted({n for h in seen for n in StateFingerprint.changed(before, h) if n.startswith("optimizer state")})


def moved_by_data(plain: Fingerprint, again: Fingerprint, other: Fingerprint) -> list[str]:
    """The entries a replay on other data (``other``) set apart from a replay on the data (``plain``), except those
    a second replay on the same data (``again``) already set apart: a wall-clock time, a random draw is not the
    data's."""
    noisy = set(StateFingerprint.changed(plain, again))
    return [name for name in StateFingerprint.changed(plain, other) if name not in noisy]


def loop_controls(loop: Any) -> dict[str, Any]:
    """The trainer's decisions on how long training runs, and the library objects' settings that decide when it
    validates, checkpoints or stops (:func:`library_settings`; none without a trainer)."""
    if loop is None:
        return {}
    fit = getattr(loop, "fit_loop", None)
    return {"should_stop": bool(getattr(loop, "should_stop", False)), "max_epochs": getattr(fit, "max_epochs", None),
            "max_steps": getattr(getattr(fit, "epoch_loop", None), "max_steps", None),
            **{name: value for name, (_, _, value) in library_settings(loop).items()}}


TRAINER_SETTINGS = ("val_check_batch", "val_check_interval", "check_val_every_n_epoch", "limit_train_batches",
                    "limit_val_batches", "num_training_batches", "num_sanity_val_steps", "log_every_n_steps",
                    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
                    "reload_dataloaders_every_n_epochs", "fit_loop.min_epochs", "fit_loop.epoch_loop.min_steps")
"""The trainer's (and its loops') scheduling settings a user's hook may write: when it validates, how many batches an
epoch or a validation has, how often it logs, how long it must run at least."""

_SETTING_TYPES = (bool, int, float, str, type(None), datetime.timedelta, enum.Enum)

_SET_UP = ("__init__", "setup", "load_state_dict", "on_load_checkpoint", "on_fit_start", "on_train_start")
"""The methods of a library callback that set its configuration, before training starts (``ModelCheckpoint``'s
``__init_triggers`` too: a name holding ``__init``)."""


def library_settings(trainer: Any) -> dict[str, tuple[Any, str, Any]]:
    """The settings of the library objects that steer the fit — ``"EarlyStopping.patience"``,
    ``"Timer._duration"``, ``"ModelCheckpoint._every_n_train_steps"``, ``"val_check_batch"`` (:data:`TRAINER_SETTINGS`)
    — as name → (object, attribute, value). A library callback's (Lightning's, lightning_dp's) are its attributes
    holding a number, a string, a flag, ``None``, a duration or an enum that its own code writes only as it is set up
    (:data:`_SET_UP`); what it writes as it runs (``EarlyStopping.wait_count``, ``best_score``, ``ModelCheckpoint``'s
    best paths, ``Timer``'s start times) is its state, from held-out metrics and the clock, not a setting. Written by
    the user's code from the training data (a patience, a threshold, a duration, a checkpoint or validation schedule
    set from the batch loss), they decide later stops, releases and validations: judged as the optimizer's
    hyper-parameters are (:func:`replay_records`, :mod:`.decisions`)."""
    out: dict[str, tuple[Any, str, Any]] = {}
    for path in TRAINER_SETTINGS:
        *parents, key = path.split(".")
        obj = trainer
        for parent in parents:
            obj = getattr(obj, parent, None)
        value = vars(obj).get(key, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        if isinstance(value, _SETTING_TYPES):
            out[path] = (obj, key, value)
    callbacks = [cb for cb in getattr(trainer, "callbacks", None) or () if library_callback(cb)]
    labels = [type(cb).__name__ for cb in callbacks]
    for i, (cb, label) in enumerate(zip(callbacks, labels)):
        if labels.count(label) > 1:
            label = f"{label}[{labels[:i].count(label)}]"
        running = _running_state(type(cb))
        for key, value in vars(cb).items():
            if key not in running and isinstance(value, _SETTING_TYPES):
                out[f"{label}.{key}"] = (cb, key, value)
    return out


_RUNNING: "weakref.WeakKeyDictionary[type, frozenset[str]]" = weakref.WeakKeyDictionary()


def _running_state(cls: type) -> frozenset[str]:
    """The attributes a library callback's own methods write after it is set up (:data:`_SET_UP`): its state."""
    known = _RUNNING.get(cls)
    if known is None:
        known = _RUNNING[cls] = frozenset(
            name for b in cls.__mro__ if (b.__module__ or "").split(".")[0] in LIBRARY_PREFIXES
            for key, value in vars(b).items() if key not in _SET_UP and "__init" not in key
            for code in _codes(value) for name in _stored(code))
    return known


def mechanism_settings(loop: Any) -> dict[str, Any]:
    """The Gaussian mechanism's settings where ``loop`` (a trainer) trains with a private strategy
    (:func:`step_mechanism` of its private step); none without one."""
    return step_mechanism(getattr(getattr(loop, "strategy", None), "private_step", None))


def step_mechanism(step: Any) -> dict[str, Any]:
    """A private step's σ (``noise_multiplier``) and clipping policy (``clipping``: flat clipping by its C; a policy
    that moves its own bound, by the policy object, whose moves are its own releases', and its configuration — an
    adaptive policy's target quantile and learning rate: ``ClippingPolicy.settings``). Set from the data between two
    releases — a C from the batch's losses, a σ lowered once the loss crosses a threshold — they steer the next release
    by un-noised data, and C is released with every step (the noise's scale, ``privacy/clip_norm``)."""
    if step is None or not hasattr(step, "clipping"):
        return {}
    clipping = step.clipping
    bound = ("C", clipping.max_grad_norm) if isinstance(clipping, FlatClipping) else \
        (type(clipping), id(clipping), clipping.settings())
    return {"noise_multiplier": step.noise_multiplier, "clipping": bound, "policy": clipping}


def mechanism_decisions(loop: Any) -> Fingerprint:
    """:func:`mechanism_settings` as fingerprint entries (``"privacy noise_multiplier"``, ``"privacy clipping"``)."""
    return mechanism_entries(mechanism_settings(loop))


def mechanism_entries(settings: dict[str, Any]) -> Fingerprint:
    """:func:`step_mechanism`'s settings as fingerprint entries (``"privacy noise_multiplier"``)."""
    return {f"privacy {k}": v for k, v in settings.items() if k != "policy"}


def mechanism_state(step: Any) -> Fingerprint:
    """:func:`step_mechanism`'s entries with what else decides the next release's noise and clipping: the clipping
    policy's own settings and state (its bound, quantile, rates, budgets: a policy's attribute set by hand), the noise
    mechanisms in use (which objects, their public settings) and the sampling plan the ledger charges (q, B). What a
    step may not change between its ``begin`` and its release (nor a plain loop between releases, unless declared)."""
    out = mechanism_entries(step_mechanism(step))
    if not out:
        return out
    out["privacy clipping state"] = _scalar_settings(step.clipping, private=True)
    for name, noise in (("noise", getattr(step, "noise", None)),
                        ("release noise", getattr(getattr(step, "_privatizer", None), "noise", None))):
        if noise is not None:
            out[f"privacy {name}"] = (id(noise), _scalar_settings(noise, private=False))
    plan = getattr(step, "plan", None)
    out["privacy sampling"] = None if plan is None else repr(plan)
    return out


def _scalar_settings(obj: Any, private: bool) -> tuple[tuple[str, str], ...]:
    """``obj``'s attributes that are numbers, strings, flags or dicts of them, as text (``private``: the underscored
    ones too: a policy's bound is ``_bound``)."""
    items = []
    for name, value in sorted(getattr(obj, "__dict__", {}).items()):
        if name.startswith("_") and not private:
            continue
        if isinstance(value, dict) and all(isinstance(v, (bool, int, float, str)) for v in value.values()):
            items.append((name, repr(sorted((str(k), v) for k, v in value.items()))))
        elif value is None or isinstance(value, (bool, int, float, str)):
            items.append((name, repr(value)))
    return tuple(items)


def put_mechanism_settings(loop: Any, settings: dict[str, Any]) -> None:
    """σ and the clipping policy of ``loop``'s private step set back to ``settings`` (:func:`mechanism_settings`)."""
    step = getattr(getattr(loop, "strategy", None), "private_step", None)
    if step is None or not settings:
        return
    if step.noise_multiplier != settings["noise_multiplier"]:
        step.noise_multiplier = settings["noise_multiplier"]
    if step.clipping is not settings["policy"]:
        step.clipping = settings["policy"]
    bound = settings.get("clipping")
    if isinstance(bound, tuple) and len(bound) == 3:  # a policy's configuration (ClippingPolicy.settings) as noted
        for key, value in bound[2]:
            if getattr(step.clipping, key, value) != value:
                setattr(step.clipping, key, value)


def decisions(trainer: Any) -> Fingerprint:
    """What a hook outside the step may decide for later steps: each optimizer's hyper-parameters and defaults
    (:func:`~.kept_state.settings`, ``"optimizer 0 param_groups[0].lr"``), which optimizers step (one swapped for
    another), the learning-rate schedulers' states (a scheduler told the loss, applying it at its next step), which
    of the model's parameters train (a backbone unfrozen), the trainer's length decisions (``"trainer should_stop"``)
    and the mechanism's σ and C (:func:`mechanism_decisions`)."""
    out: Fingerprint = {f"trainer {k}": v for k, v in loop_controls(trainer).items()}
    out.update(mechanism_decisions(trainer))
    optimizers = list(getattr(trainer, "optimizers", None) or ())
    out["trainer optimizers"] = tuple(type(o).__qualname__ for o in optimizers)
    for i, optimizer in enumerate(optimizers):
        out.update({f"optimizer {i} {key.partition(' ')[2]}": v for key, v in settings(optimizer).items()})
    for i, scheduler in enumerate(schedulers(trainer)):
        out.update({f"scheduler {i} {key}": _hyper_token(value) for key, value in scheduler.state_dict().items()})
    module = getattr(trainer, "lightning_module", None)
    if module is not None:
        out["model trainable"] = tuple(name for name, p in module.named_parameters() if p.requires_grad)
    return out


def schedulers(trainer: Any) -> list[Any]:
    """The learning-rate schedulers Lightning steps for ``trainer``."""
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or ()]


def put_loop_controls(loop: Any, controls: dict[str, Any]) -> None:
    """The trainer's decisions of :func:`loop_controls` set back to ``controls``."""
    if loop is None:
        return
    loop.should_stop = controls["should_stop"]
    fit = getattr(loop, "fit_loop", None)
    if fit is not None and getattr(fit, "max_epochs", None) != controls["max_epochs"]:
        fit.max_epochs = controls["max_epochs"]
    epoch_loop = getattr(fit, "epoch_loop", None)
    if epoch_loop is not None and getattr(epoch_loop, "max_steps", None) != controls["max_steps"]:
        epoch_loop.max_steps = controls["max_steps"]
    for name, (obj, key, value) in library_settings(loop).items():  # as the replayed hooks found them
        if name in controls and (type(value) is not type(controls[name]) or value != controls[name]):
            setattr(obj, key, controls[name])


def accepted(baseline: Fingerprint, now: Fingerprint, names: Sequence[str]) -> Fingerprint:
    """``baseline`` with the entries ``names`` (and the norms of their contents, ``"contents of …"``) as they are
    ``now`` (gone where gone)."""
    names = {*names, *(f"contents of {name}" for name in names)}
    kept = {k: v for k, v in baseline.items() if k not in names}
    return {**kept, **{k: now[k] for k in names if k in now}}


def raw_gradient_error(names: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of tensors outside the model's parameters that hold a gradient at the release (rule 2)."""
    return PrivacyConfigurationError(
        f"Tensors outside the model's trainable parameters hold a gradient from this step's backward: "
        f"{', '.join(names[:6])}{' and more' if len(names) > 6 else ''} (a tensor with requires_grad=True kept as an "
        "attribute — a temperature, loss weights — a second optimizer's, or an activation's retain_grad()). Only the "
        "parameters' per-example gradients are clipped and noised: that gradient is the batch's own, and a step "
        "taken with it, or a value read from it, would leave the guarantee. Nothing was released. Make the tensor "
        "an nn.Parameter of the model (it is then privatised with the others and stepped by the optimizer), or "
        "detach it (requires_grad=False) if it is not trained.")


def hyperparameters_error(changed: Sequence[str], where: str) -> PrivacyConfigurationError:
    """The refusal of an optimizer hyper-parameter or state entry changed within a step (rule 3)."""
    return PrivacyConfigurationError(
        f"The optimizer's hyper-parameters or state, the mechanism's σ or C, how long the trainer runs or a library "
        f"callback's or the trainer's setting changed {where}: {', '.join(changed[:6])}. A learning rate, momentum or "
        "weight decay set from the batch or its loss, a moment written from it, a noise multiplier σ or clipping "
        "bound C set from it, a stop (should_stop, max_epochs, max_steps; an EarlyStopping patience or threshold, a "
        "Timer duration) or a validation or checkpoint schedule decided from it steers every later update (or how "
        "many are released) by un-noised training data, outside the "
        "guarantee. Nothing more was released. Set hyper-parameters from the step count (a learning-rate scheduler, "
        "which Lightning steps after the update) or from held-out data at validation; leave σ and C to the strategy "
        "(a target ε calibrates σ; AdaptiveClipping moves C privately), and the optimizer's state to its step.")


def _hyper_token(value: Any) -> Hashable:
    if isinstance(value, Tensor):  # a tensor learning rate (capturable or fused optimizers)
        return ("tensor", tuple(value.shape), tuple(value.detach().reshape(-1).tolist()) if value.numel() <= 16
                else (id(value), value._version))
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""The hooks a module keeps: a user's hook may keep what it sees in its closure, a default argument or its object."""


def _library_callable(fn: Any) -> bool:
    """A hook defined by a library (an engine's capture, Opacus', torch's own): its state is its owner's."""
    target = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None) if isinstance(target, types.FunctionType) else type(target).__module__
    return (module or "").split(".")[0] in LIBRARY_PREFIXES


def _library_function(value: Any) -> bool:
    """A function, method or partial defined by a library: nothing of the user's is kept in it (a partial binding
    arguments keeps them: ``partial(F.cross_entropy, weight=w)`` holds the user's ``w``)."""
    return isinstance(value, _FUNCTIONS) and _library_callable(value) and not _binds(value)


def _binds(value: Any) -> bool:
    """A ``functools.partial`` with bound arguments: what they hold is its maker's, whatever function it wraps."""
    return isinstance(value, functools.partial) and bool(value.args or value.keywords)


def callable_state(fn: Any) -> list[Any]:
    """What a callable keeps between calls: a partial's arguments, a bound method's object, a function's closure
    cells and default arguments (``def hook(m, i, o, store=[])``), a callable object itself."""
    if isinstance(fn, functools.partial):
        return [*fn.args, *fn.keywords.values(), *callable_state(fn.func)]
    if isinstance(fn, types.MethodType):
        return [fn.__self__, *callable_state(fn.__func__)]
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        return [*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    return [fn]


def _sample(items: Sequence[Any]) -> Sequence[Any]:
    if len(items) <= MAX_ITEMS:
        return items
    stride = len(items) // MAX_ITEMS + 1
    return [*items[:64], *items[64:-64:stride], *items[-64:]]


def _norm_tokens(named: Sequence[tuple[str, Tensor]]) -> Fingerprint:
    """Each tensor's L2 norm, by one fused reduction: a write through ``p.data`` (which moves neither the storage nor
    the version counter) changes it. On the CPU one entry per tensor (``"contents of parameter NAME"``); on an
    accelerator one entry per device holding the norms there (:class:`_DeviceNorms`: no host copy until compared,
    so taking the baseline after the update does not wait for the device)."""
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for name, t in named:
        by_device.setdefault(t.device, []).append((name, t))
    out: Fingerprint = {}
    with torch.no_grad():
        for device, group in by_device.items():
            norms = torch.stack(torch._foreach_norm([t.detach() for _, t in group])).to(torch.float64)
            if device.type == "cpu":
                out.update({f"contents of {name}": value for (name, _), value in zip(group, norms.tolist())})
            else:
                out[f"contents of {len(group)} parameters and buffers on {device}"] = _DeviceNorms(norms)
    return out


class _DeviceNorms:
    """Norms kept on their device; equal when every norm is (one comparison, one wait for the device)."""

    def __init__(self, norms: Tensor) -> None:
        self.norms = norms

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _DeviceNorms) and self.norms.shape == other.norms.shape and bool(
            torch.equal(self.norms, other.norms))

    def __hash__(self) -> int:
        return hash(tuple(self.norms.shape))


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _raw_token(value: Any) -> Optional[Hashable]:
    """Mutable byte containers and streams, which hold data without a ``__dict__``: their contents (``bytearray``,
    ``array.array``, ``memoryview``, ``io.BytesIO``, ``io.StringIO``) or, for another stream (a file written by the
    step), its position: a write moves it."""
    if isinstance(value, (bytearray, memoryview)):
        return (type(value).__name__, _digest(value))
    if isinstance(value, array.array):
        return ("array", value.typecode, _digest(value.tobytes()))
    if isinstance(value, io.BytesIO):
        return ("BytesIO", _digest(value.getbuffer()), value.tell())
    if isinstance(value, io.StringIO):
        return ("StringIO", _digest(value.getvalue().encode("utf-8", "surrogatepass")), value.tell())
    if isinstance(value, io.IOBase):
        try:
            position = None if value.closed else value.tell()
        except (OSError, ValueError):  # a pipe or socket: not seekable
            position = None
        return ("stream", type(value).__name__, id(value), value.closed, position)
    return None


def _numpy_token(value: Any) -> Optional[Hashable]:
    module = type(value).__module__
    if module != "numpy":
        return None
    import numpy as np

    if isinstance(value, np.generic):
        return ("numpy scalar", repr(value.item()))
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("ndarray", value.shape, "object", id(value))
        return ("ndarray", value.shape, str(value.dtype), _array_digest(value))
    return None


ARRAY_BYTES = 1 << 20
"""NumPy arrays up to this size are compared by a digest of all their bytes; larger ones (a datamodule's raw data)
by their identity, memory address and a digest of :data:`ARRAY_BYTES` bytes in strided rows, every step."""


def _array_digest(value: Any) -> bytes:
    if value.nbytes <= ARRAY_BYTES:
        return _digest(value.tobytes())
    flat = value.reshape(-1) if value.flags.c_contiguous else value.ravel()
    stride = max(1, flat.size // (ARRAY_BYTES // max(1, value.itemsize)))
    return _digest(flat[::stride].tobytes()) + id(value).to_bytes(8, "little") + \
        value.__array_interface__["data"][0].to_bytes(8, "little")
