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
* the module tree's structure: each module's class and each container's submodule names in order
  (:meth:`StateFingerprint._structure_entries`, ``"structure net.1"``: a parameter-free layer replaced, its
  ``__class__`` reassigned or a ``Sequential`` reordered from the batch shows nowhere else);
* the bytes of a parameter's or buffer's storage that none of the state's tensors covers (a buffer registered as a
  view of a larger tensor, written past its view by ``as_strided(..., offset)`` or ``untyped_storage()``:
  :func:`beyond_views`), and the tensor held in the ``.grad`` slot of a buffer or a frozen parameter (none, zeros, or
  the gradient of a parameter's last update left by a freeze are no data: :meth:`StateFingerprint._left_by_training`);
* every submodule's mode (``training``) as the next training step will run it (:func:`training_modes`: the modes
  Lightning captured while its evaluation loop runs), an entry ``"mode net.2"`` for each module in eval mode;
* the Python attributes set on a parameter or buffer tensor itself (``self.fc.weight.cache = x.detach()``), read
  as module attributes are (the engine's own, such as Opacus' ``grad_sample``, skipped), and those of every other
  tensor reached as state (a plain tensor attribute, a tensor in a container: :func:`kept_attributes`);
* the attributes of every module whose class is not torch's own — tensors, NumPy arrays, numbers,
  strings, containers of them, and plain Python objects (a ``RunningMeanStd`` helper; a ``__slots__`` object of the
  user's class by its slots: :func:`~lightning_dp.fingerprints.state_walker.slot_fields`) to a bounded depth;
  a torchmetrics ``Metric`` contributes only its persistent states (non-persistent ones feed ``self.log``,
  whose values are reported, not released: see the README's caveats);
* the same attributes of every callback that is handed the batch (it overrides ``on_train_batch_start``,
  ``on_train_batch_end`` or ``on_before_backward``), or that read a value logged from the data (:meth:`watch`), and
  is not one of Lightning's or lightning_dp's own, and what its ``state_dict()`` returns (what a checkpoint keeps of
  it); and of the user's LightningDataModule (the first step's epoch-hook replays take every user callback's:
  ``take(every_callback=True)``);
* the data held by the user's classes themselves (:func:`class_attributes`: ``history = []`` in a class body, the
  default arguments of their methods), and by the library classes among their bases and the torch layers' classes,
  ``nn.Module`` included (:func:`library_class_attributes`: ``pl.LightningModule.offset = x.mean()``);
* attributes added to the loop's own objects (the trainer, its strategy, the optimizers, the training loader, its
  loops, accelerator, precision plugin, profiler and loggers) after the first fingerprint: ``trainer.memory = batch``,
  and private names holding a tensor or an array (``library_objects``; set by the Lightning glue); by the same rule,
  to any other library's object the walk reaches and to the library objects its attributes hold
  (:func:`added_attributes`, :data:`~lightning_dp.fingerprints.first_fields.FIRST_SEEN`: the training
  ``DataLoader`` kept as a global of the script, ``DL.center = x.mean(0)``), lightning_dp's own left out;
* what the user's hooks on the model's modules keep (forward and backward hooks: closure cells, default arguments,
  a partial's arguments, a bound method's object, the function's own attributes: ``hook.stats = x``), hooks
  defined by libraries (the engine's) left out; the same for the user's functions reached as state;
* the training dataset's tensors and those of every dataset reached above (:func:`dataset_token`: identity and
  version counter, so a record written in place shows), its records kept as NumPy arrays or lists, its containers;
* the module-level globals of the user's code (:func:`user_modules`: the modules defining the LightningModule and
  the callbacks above, and the user's helper modules they import), read as attributes are, under the Lightning
  strategies (a plain loop's own globals change every iteration); of their functions, the default arguments
  (:func:`function_defaults`: ``shift.__kwdefaults__["by"] = float(mean)``) and a partial's bound arguments.

What it cannot see: globals of libraries' modules and of plain loops, the bytes beyond the view of a tensor that
is no parameter or buffer, the ``.grad`` of a trainable parameter rewritten between the update and ``zero_grad``,
what a file on disk holds (a stream kept on the module is compared by its position, an in-memory
``BytesIO``/``StringIO`` or ``bytearray`` by its contents),
closures, objects of library classes mutated in place in the attributes they had when first seen (their identity is
compared, not their contents; attributes added since are compared), private names holding no tensor or array added to
them, attributes added to lightning_dp's own objects,
containers beyond :data:`MAX_ITEMS` items (their length and a sample are compared), and writes through an integer
buffer's ``.data`` between full passes (the version counter of ``.data`` is not the tensor's; the norms of
parameters and floating buffers are compared every time). Entries matching a declared public name
(``public_state``) are skipped.

This module holds the fingerprint itself, the modules' modes and the refusals of what it finds (a write to kept state:
:func:`state_written_error`; a gradient held outside the parameters: :func:`raw_gradient_error`). What it is made of
lives in :mod:`lightning_dp.fingerprints`, one concept a module: how a module tree and a module's attributes are read
(``module_tree``), the declared public names (``public_names``), the entries and their comparison
(``fingerprint_entries``), the tokens of contents (``checksums``), the walk of Python values, callables and class
bodies (``state_walker``), callbacks (``callback_state``), the training data (``dataset_tokens``); the decisions the
replays judge lie beside it: the optimizers', the trainer's and the library objects' settings
(:mod:`.steered_settings`) and σ and C (:mod:`.mechanism_settings`)."""

from __future__ import annotations

import functools
import operator
import types
import weakref
from collections import deque
from itertools import repeat
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError, listed
from lightning_dp.records.identity import IdentityMap, Same
from lightning_dp.records.library_code import forged_or_own, library_named
from lightning_dp.fingerprints.callback_state import callback_state_items, is_datamodule, trusted_callback
from lightning_dp.fingerprints.checksums import Checksums, beyond_views, norm_tokens
from lightning_dp.fingerprints.dataset_tokens import dataset_settings, dataset_token
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint, changed_entries
from lightning_dp.fingerprints.module_tree import ModuleAttributes, TreeShape, attribute_mode
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.fingerprints.replaced_objects import held_objects
from lightning_dp.fingerprints.first_fields import FIRST_SEEN
from lightning_dp.fingerprints.state_walker import (FUNCTION_TYPES, added_attributes, binds, function_defaults,
                                                    _scalar_token, library_callable, library_class_attributes,
                                                    library_function, mutable_state, Walker, callable_state,
                                                    class_attributes)
from lightning_dp.records.library_objects import TRUSTED_CALLBACK_PREFIXES, framework_keys, library_callback


def attribute_keys(module: nn.Module) -> set[str]:
    """Every attribute name held by ``module`` or a submodule (before and after an engine attaches: the difference
    is the engine's own, never fingerprinted nor restored)."""
    return {key for m in module.modules() for key in vars(m)}


_FIRST, _SECOND, _THIRD = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_MODULES = operator.attrgetter("_modules")


def same_parameters(a: Sequence[tuple[str, Tensor]], b: Sequence[tuple[str, Tensor]]) -> bool:
    """Whether two (name, parameter) lists (:meth:`StateFingerprint.trainable`) hold the same parameters, by identity,
    under the same names in the same order (compared in C loops; a list holds its parameters, so an id is not reused
    while it is kept)."""
    return len(a) == len(b) and all(map(operator.is_, map(_SECOND, a), map(_SECOND, b))) \
        and list(map(_FIRST, a)) == list(map(_FIRST, b))


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
        self._first = FIRST_SEEN  # the names each library object held when first seen (added_attributes)
        self._readers: IdentityMap[bool] = IdentityMap()  # callbacks that read a value logged from the data (watch)
        self._reader = ModuleAttributes(self.skip_keys, self._is_public)
        self.modules: Callable[[], Iterable[types.ModuleType]] = lambda: ()
        """The Python modules whose globals are fingerprinted too (:func:`user_modules`; set by the Lightning glue)."""
        self._sums = Checksums()
        self.every_callback = False  # take()'s default: every callback's state, not only the batch-handed ones'
        self._trained_gradients: dict[int, tuple[Any, int]] = {}  # id(parameter) → a weak reference to its gradient
        # and that gradient's version counter, as last seen while it trained (_left_by_training)
        self._gradients: dict[str, tuple[int, int]] = {}
        self.graded: list[str] = []  # where the last fingerprint found tensors holding a gradient they did not hold
        # (or not this one, or not so) at the one before: a backward's since (:class:`Walker`)
        self._layout: Optional[list[tuple[str, nn.Module, Optional[list[str]]]]] = None
        self._tree: Optional[TreeShape] = None  # the module tree's shape as walked
        self._registered: set[int] = set()
        self._layer_classes: set[type] = set()  # the classes of the modules of the tree (library_class_attributes)
        self._library_entries: dict[tuple[type, str], Optional[str]] = {}  # (class, name) → entry (None: public)
        self._param_slots: list[tuple[str, dict, str]] = []
        self._all_param_slots: list[tuple[str, dict, str]] = []
        self._buffer_slots: list[tuple[str, dict, str]] = []
        self._shapes: list[tuple[str, nn.Module]] = []  # (entry, module): its class and its submodules' order
        self._shape_modules: list[nn.Module] = []
        self._containers: list[nn.Module] = []
        self._shaped: Optional[tuple[list, list, list[tuple], Fingerprint]] = None  # _structure_entries' last
        self._public_memo: dict[str, bool] = {}
        self._tuples: dict[str, tuple[tuple, Hashable]] = {}  # entry → (tuple of scalars, its token): _tuple_token
        self._trainable: Optional[tuple[list, list, list[bool], list[tuple[str, Tensor]]]] = None  # trainable()

    def refresh(self) -> None:
        """Walk the module tree again at the next fingerprint (a re-attached engine, a changed parameter set)."""
        self._layout = None

    def _structure(self) -> list[tuple[str, nn.Module, Optional[list[str]]]]:
        """(name prefix, module, attribute mode) of every module, walked once (again when a module gains or loses a
        parameter, buffer or submodule, or a submodule is replaced in its container: :class:`TreeShape`): the mode
        (:func:`attribute_mode`) is ``DATA_ONLY`` for torch's own layers, the persistent state names of a
        torchmetrics ``Metric`` (``None``: none), else ``[]`` (all). Also the parameter and buffer slots, public ones
        left out, as (entry name, the module's dict, key): a tensor replaced in its slot is read anew."""
        if self._layout is not None and self._tree is not None and self._tree.same():
            return self._layout
        self._layout = [(f"{name}." if name else "", m, attribute_mode(m)) for name, m in self.module.named_modules()]
        self._tree = TreeShape([m for _, m, _ in self._layout])
        self._registered = {id(m) for _, m, _ in self._layout}
        self._layer_classes = {type(m) for _, m, _ in self._layout}
        self._all_param_slots = [(prefix + key, m._parameters, key) for prefix, m, _ in self._layout
                                 for key in m._parameters]
        self._param_slots = [(f"parameter {name}", slots, key) for name, slots, key in self._all_param_slots
                             if not self._is_public(name)]
        self._buffer_slots = [(f"buffer {prefix}{key}", m._buffers, key) for prefix, m, _ in self._layout
                              for key in m._buffers if not self._is_public(prefix + key)]
        named = [(prefix[:-1], m) for prefix, m, _ in self._layout]
        self._shapes = [(f"structure {name or '(model)'}", m) for name, m in named  # declared by name or entry
                        if not self._is_public(name) and not self._is_public(f"structure {name or '(model)'}")]
        self._shape_modules = list(map(_SECOND, self._shapes))
        self._containers = [m for m in self._shape_modules if m._modules]  # (one gaining a first child: walked again)
        return self._layout

    def _structure_entries(self) -> Fingerprint:
        """The ``structure`` entries: per module (public ones left out) its class and, for a container, the names of
        its submodules in order — what the forward composes, which no parameter shows for a parameter-free layer
        (``self.net[1] = nn.Sigmoid()``, ``layer.__class__ = ...``, ``_modules`` reordered). Kept while the same
        modules have the same classes and their containers the same names in the same order (read in C loops). A
        class the engine put on a module for the step (``root_parameters``' interceptor, while a parameter of the
        module's own trains) is read as the user's class it stands for: freezing that parameter gives it back."""
        shapes, modules, containers = self._shapes, self._shape_modules, self._containers
        classes = [cls.__dict__.get("_dp_user_class", cls) for cls in map(type, modules)]  # an engine's interceptor
        names = list(map(tuple, map(dict.keys, map(_MODULES, containers))))
        held = self._shaped
        if held is not None and held[0] is shapes and held[1] == classes and held[2] == names:
            return held[3]
        entries = {entry: (cls, *m._modules) if m._modules else cls
                   for (entry, m), cls in zip(shapes, classes)}
        self._shaped = (shapes, classes, names, entries)
        return entries

    def trainable(self) -> list[tuple[str, Tensor]]:
        """(name, parameter) of every trainable parameter, each once (as ``named_parameters``, without walking the
        module tree again: from the slots of :meth:`_structure`)."""
        if self.parameters is not None:
            return [(name, p) for name, p in self.parameters() if p.requires_grad]
        self._structure()
        slots = self._all_param_slots
        # what each slot holds and whether it trains, read in C loops: the same objects (held by the cache, so none
        # is at a freed one's address) with the same flags in the same slots give the same list
        held = list(map(dict.get, map(_SECOND, slots), map(_THIRD, slots)))
        flags = list(map(getattr, held, repeat("requires_grad"), repeat(False)))
        cached = self._trainable
        if cached is not None and cached[0] is slots and cached[2] == flags and all(map(operator.is_, held, cached[1])):
            return list(cached[3])
        out, seen = [], set()
        for (name, _, _), p, training in zip(slots, held, flags):
            if training and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        self._trainable = (slots, held, flags, out)
        return list(out)

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
        self.held = held_objects(layout, self._all_param_slots)  # what a baseline taken now holds: replaced_objects.py
        if self.parameters is not None:
            params = [(f"parameter {name}", p) for name, p in self.parameters() if not self._is_public(name)]
        else:
            params = [(name, p) for name, slots, key in self._param_slots if (p := slots.get(key)) is not None]
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
        buffers = [(name, b) for name, slots, key in self._buffer_slots if (b := slots.get(key)) is not None]
        tensors.extend(buffers)
        if not full:  # norms show a write through .data, which moves no version counter
            plain.extend((name, b) for name, b in buffers if type(b) is Tensor and b.dtype.is_floating_point
                         and b.layout == torch.strided and b.numel())
            entries.update(norm_tokens(plain, self._sums))
        entries.update(beyond_views([*params, *buffers], self._sums))  # `as_strided(..., offset)` past a view
        seen = {id(p) for _, p in params} | {id(b) for _, b in buffers}
        walker = Walker(seen, self._registered, self._sums, full, self.skip_keys, self._first)
        trained = self._trained_gradients
        for name, t in (*params, *buffers):
            if t.__dict__:  # Python attributes set on the tensor itself (`self.fc.weight.cache = x`)
                self._tensor_attributes(entries, name.partition(" ")[2], t, walker)
            if t.requires_grad:  # what a parameter frozen later (a finetuning callback) may still hold: its release
                if (g := t.grad) is not None:
                    trained[id(t)] = (weakref.ref(g), g._version)
            elif t.grad is not None and not self._left_by_training(t):  # hung_gradient: `self.center.grad = x`
                token = self._sums.tokens([t.grad], full)[0]
                if any(token[2][8:16]):  # (Σx² of the content sums: zeros, as `zero_grad` leaves them, are no data)
                    entries[f"the .grad of {name}"] = token
        entries.update(self._structure_entries())
        for prefix, m, mode in layout:
            if mode is None:
                continue
            state, configuration = self._reader.read(m, mode, prefix)
            for path, entry, value in state:
                entries[entry] = self._tuple_token(walker, path, entry, value) if type(value) is tuple \
                    else walker.named(path, value)
            entries.update(configuration)  # a torch layer's (Dropout.p, label_smoothing) steers the step too
        modes = training_modes(self.module, layout)  # a dropout switched off from the loss steers later steps
        for name, training in modes.items():
            entry = f"mode {name or '(model)'}"  # declared public by its name or by the entry's (as refusals say)
            if not training and not self._is_public(name) and not self._is_public(entry):
                entries[entry] = "eval"
        for prefix, m, _ in layout:
            for kind in _HOOK_DICTS:
                users = [fn for fn in (getattr(m, kind, None) or {}).values() if not library_callable(fn) or binds(fn)]
                for place, fn in enumerate(users):  # by its place among the user's hooks, not its handle's number
                    path = f"{prefix}{kind}[{place}]"  # (a global counter: each run again registering gets another)
                    if not self._is_public(path):
                        entries[f"hook {path}"] = (hook_identity(fn), *(walker.token(v) for v in callable_state(fn)),
                                                   *walker.attributes(fn))
        for cb in callbacks:
            every = every_callback or self.every_callback
            if (library_callback(cb) if every else trusted_callback(cb)) and cb not in self._readers:
                continue
            label = type(cb).__name__
            kind = "datamodule" if is_datamodule(cb) else "callback"
            for key, value in callback_state_items(cb):
                path = f"{label}.{key}"
                if not self._is_public(path) and not self._is_public(label):
                    entries[f"{kind} {path}"] = walker.named(path, value, fresh=key == "state_dict()")
        users = [m for _, m, mode in layout if mode == []] + [cb for cb in callbacks if not trusted_callback(cb)]
        for cls, key, value in class_attributes(type(obj) for obj in users):
            path = f"{cls.__qualname__}.{key}"  # (a callback declared by its class's name: its class's data too)
            if not self._is_public(path) and not self._is_public(key) and not self._is_public(f"{cls.__name__}.{key}"):
                entries[f"class attribute {path}"] = walker.named(path, value)
        names = self._library_entries
        for cls, key, value in library_class_attributes({*map(type, users), *self._layer_classes}):
            entry = names.get((cls, key), _MISSING)  # `pl.LightningModule.offset = x.mean()` at a batch's end
            if entry is _MISSING:
                path = f"{cls.__qualname__}.{key}"
                entry = names[(cls, key)] = None if self._is_public(path) or self._is_public(key) \
                    else f"attribute {key} of library class {cls.__qualname__}"
            if entry is not None:
                entries[entry] = _scalar_token(value) or (
                    walker.named(entry, value) if isinstance(value, _WALKED) or type(value).__module__ == "numpy"
                    else ("object", type(value).__name__, Same(value)))  # (a TypeVar: by identity, cheaply)
        for label, obj in self.library_objects():
            # a name the libraries set later (`_opt_called`, `_last_val_time`) is theirs unless it holds data; so is a
            # function of theirs (a scheduler made mid-fit wraps `optimizer.step`: SWA's SWALR): added_attributes
            for key, value in added_attributes(obj, self._first):
                if not self._is_public(f"{label}.{key}"):
                    entries[f"attribute {label}.{key}"] = walker.named(f"{label}.{key}", value)
        entries.update(self.dataset_entries())
        for mod in self.modules():
            for key, value in list(vars(mod).items()):
                if isinstance(value, type) and not key.startswith("__") and forged_or_own(value, mod):
                    self._class_entries(entries, value, walker)  # a class of the user's own module: its data
                    continue
                if key.startswith("__") or isinstance(value, (types.ModuleType, type)):
                    continue
                path = f"{mod.__name__}.{key}"
                if isinstance(value, FUNCTION_TYPES) and not mutable_state(value) and not binds(value):
                    # a function that keeps a list, dict or tensor (a default argument, a closure) is state below; one
                    # whose defaults are numbers or strings by those (`shift.__kwdefaults__["by"] = float(mean)`)
                    defaults = function_defaults(value)
                    if defaults is not None and not self._is_public(key) and not self._is_public(path):
                        entries[f"the defaults of function {path}"] = walker.named(path, defaults)
                    continue
                if not self._is_public(key) and not self._is_public(path):
                    entries[f"global {path}"] = walker.named(path, value)
        names = [n for n, _ in tensors]
        entries.update(zip(names, self._sums.tokens([t for _, t in tensors], full)))
        self.graded = [name for name, key in walker.graded.items() if self._gradients.get(name) != key]
        self._gradients = walker.graded
        return entries

    def _left_by_training(self, p: Tensor) -> bool:
        """Whether a parameter that does not require grad holds in ``.grad`` what it held when a fingerprint last
        found it training — the same tensor, unwritten since (its version counter): the gradient of its last update
        (noised, released), left there by a freeze between the update and ``zero_grad``."""
        held = self._trained_gradients.get(id(p))  # (by the parameter's id: another one at a freed one's address
        # would have to hold that very gradient, alive, to be taken for it)
        return held is not None and held[0]() is p.grad and p.grad._version == held[1]

    def _tuple_token(self, walker: "Walker", path: str, entry: str, value: tuple) -> Hashable:
        """The token of a tuple held at ``entry`` (a convolution's ``kernel_size``, ``padding``…): kept while the entry
        holds that very tuple and its items are numbers, strings, flags or ``None`` (then nothing in it can change;
        the tuple is held, so its ``id`` is not reused), else walked anew (:meth:`Walker.named`)."""
        held = self._tuples.get(entry)
        if held is not None and held[0] is value:
            return held[1]
        token = walker.named(path, value)
        if all(type(v) in _IMMUTABLE_ITEMS for v in value):
            self._tuples[entry] = (value, token)
        return token

    def _class_entries(self, entries: Fingerprint, cls: type, walker: "Walker") -> None:
        """Entries for the data a class of the user's own module holds in its body (:func:`class_attributes`): an
        ``autograd.Function`` subclass keeping the last step's raw gradient scale, a namespace class used as a mutable
        config (``HP.temperature`` set from the loss) — read by every later step, as a module's global is."""
        for owner, key, value in class_attributes([cls]):
            path = f"{owner.__module__}.{owner.__qualname__}.{key}"
            if not self._is_public(path) and not self._is_public(f"{owner.__qualname__}.{key}") \
                    and not self._is_public(key):
                entries[f"class attribute {path}"] = walker.named(path, value)

    def dataset_entries(self) -> Fingerprint:
        """The training data's entries (:func:`dataset_token`) and, under the Lightning strategies (whose replays tell a
        setting from the epoch number from one from the batch), its settings (:func:`dataset_settings`; a plain
        loop's ``set_epoch`` between releases is not judged: docs/release_boundary.md)."""
        entries: Fingerprint = {}
        loop = dict(self.library_objects())  # the Lightning glue's loop objects (a plain loop: none)
        loader = getattr(getattr(loop.get("trainer.strategy"), "private_step", None), "training_loader", None)
        for i, d in enumerate(self.datasets()):
            entries[f"dataset {i} ({type(d).__name__})"] = dataset_token(d)
            settings = dataset_settings(d, getattr(loader, "collate_fn", None)) if loop else {}
            entries.update((entry, token) for entry, token in settings.items()  # declared by `Class.key` or in full
                           if not self._is_public(entry.split(" ")[2]) and not self._is_public(entry))
        return entries

    def with_new_datasets(self, baseline: Fingerprint, callbacks: Sequence[Any] = ()) -> Fingerprint:
        """``baseline`` with the training data's entries, and the LightningDataModule's (which built the loader), taken
        now: a loader rebuilt on other records (``reload_dataloaders_every_n_epochs``), what they are now is what
        later steps must leave as it is."""
        fresh = {k: v for k, v in self.take(callbacks).items() if k.startswith("datamodule ")}
        kept = {k: v for k, v in baseline.items()
                if not k.startswith(("dataset ", "datamodule ", "collate ", "transform "))}
        return {**kept, **fresh, **self.dataset_entries()}

    def watch(self, callback: Any, baseline: Fingerprint, callbacks: Sequence[Any]) -> Fingerprint:
        """``callback`` read a value logged from the training data (:mod:`~lightning_dp.validators.logged_reads`):
        from now on its state is kept state, whatever hooks it overrides; returns ``baseline`` with its state now."""
        if callback in self._readers or not trusted_callback(callback) \
                or library_named(type(callback), TRUSTED_CALLBACK_PREFIXES):
            return baseline
        self._readers[callback] = True
        now = self.take(callbacks)
        return {**baseline, **{k: v for k, v in now.items() if k not in baseline}}

    def _tensor_attributes(self, entries: Fingerprint, path: str, t: Tensor, walker: "Walker") -> None:
        """Entries for the Python attributes of a parameter or buffer (the engine's own and torch's skipped)."""
        for key, value in vars(t).items():
            if key in self.skip_keys or key.startswith(("_dp_", "_dynamo_")) or library_function(value):
                continue  # torch.compile marks the parameters it saw (`_dynamo_static_input_type`): torch's own
            if not self._is_public(f"{path}.{key}"):
                entries[f"attribute {path}.{key}"] = walker.named(f"{path}.{key}", value)

    # ------------------------------------------------------------------ comparing
    @staticmethod
    def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
        """Entries that differ, appeared or disappeared, in a stable order."""
        return changed_entries(before, after)

    def forget(self) -> None:
        """Drop cached checksums (a later fingerprint recomputes them)."""
        self._sums.forget()


_MISSING = object()


_WALKED = (Tensor, list, tuple, dict, set, frozenset, deque, bytearray)
"""The values of a library class's attributes read by content (:meth:`Walker.named`); another object by identity."""


_IMMUTABLE_ITEMS = frozenset({int, float, bool, str, bytes, type(None)})
"""Types of the items of a tuple whose token is kept (:meth:`StateFingerprint._tuple_token`): exactly these, not a
subclass (which may carry attributes)."""


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



class StateWrittenError(PrivacyConfigurationError):
    """Kept state changed where only the release may leave the step (:func:`state_written_error`)."""


def state_written_error(changed: Sequence[str], where: str) -> StateWrittenError:
    """The refusal of a write to kept state: a short first line naming what changed and the fix; where, why after."""
    names = [c for c in dict.fromkeys(changed)  # a tensor named beside its contents: once
             if not (c.startswith("contents of ") and c.removeprefix("contents of ") in changed)]
    shown = listed(names)
    public = list(dict.fromkeys(public_name(c) for c in names))[:3]
    fix = (f"declare it public, DPStrategy(public_state={public!r}) (a plain loop: PrivateStep(..., "
           "public_state=...)), if it is not derived from the training data or may leave unprotected like a logged "
           "metric (outputs kept for an epoch-end log); else compute it from public data or the released model only")
    if any(c.startswith(tuple(p for p, _ in _HIDDEN_PLACES)) or " of library class " in c for c in names):
        fix += ("; a value kept beside the state — in a storage's bytes beyond a tensor's view, in the .grad of a "
                "tensor that trains nothing, in a function's default arguments, on a library's class — belongs in a "
                "registered buffer of its own (register_buffer), written from public values only")
    if all(c.removeprefix("contents of ").startswith("parameter ") for c in changed):
        fix = ("weights change only through the release (the optimizer's step on the noised update); a rollback or an "
               "edit between two releases chosen from the loss is a decision from un-noised data: restore an earlier "
               "state by resuming from its checkpoint (the model, the optimizer and the private step's or strategy's "
               "state together). A write computed from the released weights only (an adapter merged into frozen "
               f"weights) may be declared public: public_state={public!r}")
    return StateWrittenError(
        f"Kept state written outside the release: {shown}. Fix: {fix}.\nState changed {where}: {shown}. What a step "
        "computes from its batch and "
        "keeps (a buffer, an attribute such as a memory bank, a queue or a running mean, a callback's state) is saved "
        "in checkpoints and fed to later steps without noise; only the noised update may leave a private step, so "
        "the guarantee would not cover it. Nothing more was released.")


_HIDDEN_PLACES = (("storage of ", " beyond its view"), ("the .grad of ", ""), ("the defaults of function ", ""))
"""The entries of places a value hides beside the state (prefix, suffix): the rest names the tensor or function."""


def public_name(entry: str) -> str:
    """The name ``public_state`` accepts for a fingerprint entry (what :meth:`StateFingerprint._is_public` is asked
    for that entry): ``buffer stats.mean`` → ``stats.mean``, ``class attribute M.history`` → ``M.history``, ``attribute
    offset of library class LightningModule`` → ``LightningModule.offset``; an entry of another kind as it is."""
    entry = entry.removeprefix("contents of ")
    if entry.startswith("class attribute "):  # `M.history`, or `pkg.mod.M.history` (both accepted: is_public)
        return entry.removeprefix("class attribute ")
    for prefix, suffix in _HIDDEN_PLACES:
        if entry.startswith(prefix) and entry.endswith(suffix):
            entry = entry[len(prefix):len(entry) - len(suffix)]
            return entry.partition(" ")[2] if entry.startswith(("buffer ", "parameter ")) else entry
    if entry.startswith("attribute ") and " of library class " in entry:
        key, _, owner = entry.removeprefix("attribute ").partition(" of library class ")
        return f"{owner}.{key}"
    kind, _, path = entry.partition(" ")
    return path if kind in ("buffer", "attribute", "callback", "datamodule", "parameter", "global", "hook",
                            "configuration") else entry

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hook_identity(fn: Any) -> Hashable:
    """What a module hook runs, alike for the same code however often it is registered: a function's (or a bound
    method's, a partial's) code object, named, else a callable object's class (its state: :func:`callable_state`). A
    hook registered by each run again of a hook is the same entry when it runs the same code; another function set in
    its place (``double`` for ``halve``, chosen by the batch's labels) is another."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        return ("code", getattr(fn, "__module__", None), code.co_qualname if hasattr(code, "co_qualname")
                else getattr(fn, "__qualname__", ""), code.co_firstlineno, id(code))
    return ("callable", type(fn).__module__, type(fn).__qualname__)
"""The hooks a module keeps: a user's hook may keep what it sees in its closure, a default argument or its object."""
