"""The walk of the user's Python state: values turned into hashable tokens (:class:`Walker`), to a bounded depth
(:data:`MAX_DEPTH`) and sample (:data:`MAX_ITEMS`), and where that state lives besides a module's attributes — what a
callable keeps (:func:`callable_state`: closure cells, default arguments, a partial's arguments, a bound object),
the Python attributes of a tensor or a function (:func:`kept_attributes`), the slots of a ``__slots__`` object of
the user's class (:func:`slot_fields`), a function's default arguments
(:func:`function_defaults`), the tensor hung in the ``.grad`` of one that trains nothing (:func:`hung_gradient`),
class bodies (:func:`class_attributes`) and the data library classes hold (:func:`library_class_attributes`),
the user's Python modules (:func:`user_modules`), a library's configuration object (:func:`configuration_object`),
what was added to a library's object since first seen (:func:`added_attributes`, :meth:`Walker._added`) —
and what is a library's (:func:`library_function`; :func:`library_callable`, :func:`library_class`,
:func:`library_type`: re-exported from :mod:`lightning_dp.records.library_code`, the one rule every trust decision
reads: decided by where the code that runs lies and where a class was written, not by ``__module__``) or
Lightning's (:func:`lightning_fields`).

The same rules token the plain values held outside the modules — an optimizer's hyper-parameters and its state kept
under other keys, a learning-rate scheduler's state and its lambdas' closures — without the walk's checksum cache
(:func:`freeze`, :func:`closure_token`): one way to turn a value or a closure into a comparable token.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
from collections import deque
from typing import Any, Hashable, Iterable, Iterator, Optional, Sequence, Sized

from torch import Tensor, nn
from torch.utils.data import Dataset
from torch.utils.hooks import RemovableHandle

from lightning_dp.records.library_code import (  # noqa: F401  (re-exported: the walks' one rule)
    FUNCTION_TYPES, LIBRARY_PREFIXES, _FUNCTION, _HELPER, _MAX_WRAPPED, _METHOD, _PARTIAL, _called_cells, _code_kind,
    defining_modules, library_callable, library_class, library_code, library_module, library_named, library_type)
from lightning_dp.records.library_objects import is_library as _is_library
from lightning_dp.records.library_objects import unwrapped
from lightning_dp.records.identity import Same
from lightning_dp.fingerprints.checksums import Checksums, numpy_token, _raw_token
from lightning_dp.fingerprints.context_values import is_context_variable, value_of
from lightning_dp.fingerprints.dataset_tokens import dataset_token
from lightning_dp.fingerprints.first_fields import FirstFields
from lightning_dp.fingerprints.helper_modules import helper_modules

MAX_ITEMS = 16384
"""Container items tokenised one by one; a longer container is compared by its length and a strided sample."""


MAX_DEPTH = 4
"""Nesting depth followed into containers and plain objects."""


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


class Walker:
    """Turns Python values into hashable tokens; tensors go through the shared checksum cache."""

    def __init__(self, params_and_buffers: set[int], registered: set[int], sums: Checksums, full: bool,
                 skip_keys: frozenset[str] = frozenset(), first: Optional[FirstFields] = None) -> None:
        self._known = params_and_buffers
        self._first = first
        """The names each library object held when first seen (:func:`added_attributes`); ``None``: library objects by
        identity only."""
        self._skip_keys = skip_keys
        self._registered = registered
        self._sums = sums
        self._full = full
        self._objects: set[int] = set()
        self._name = ""
        self._fresh = False
        self.graded: dict[str, tuple[int, int]] = {}
        """Where tensors outside the parameters hold a gradient (:func:`holds_gradient`): entry name → the gradient's
        identity and version counter."""

    def named(self, name: str, value: Any, fresh: bool = False) -> Hashable:
        """:meth:`token` of the value held at entry ``name`` (what :attr:`graded` names). ``fresh``: the value was
        built by the call that returned it (a callback's ``state_dict()``), so the identity of a container beyond
        :data:`MAX_DEPTH` says nothing (a new list at each call, at whatever address the allocator had free: two runs
        alike were told apart by it); its length stands in for it."""
        self._name, self._fresh = name, fresh
        try:
            return self.token(value)
        finally:
            self._fresh = False

    def token(self, value: Any, depth: int = 0) -> Hashable:
        scalar = _scalar_token(value)
        if scalar is not None:
            return scalar
        if isinstance(value, Tensor):
            if id(value) in self._known:
                return ("state tensor", id(value))  # a parameter or buffer held again: fingerprinted by its name
            if holds_gradient(value):
                self.graded[self._name] = (id(value.grad), value.grad._version)
            token = ("tensor", self._sums.tokens([value], self._full)[0])
            hung = hung_gradient(value)
            if hung is not None:  # a tensor hung in the `.grad` slot of one that trains nothing: `t.grad = x.mean(0)`
                token = (*token, ("grad", self._sums.tokens([hung], self._full)[0]))
            if value.__dict__ and depth < MAX_DEPTH:  # Python attributes set on the tensor (`self.temp.stats = x`)
                return (*token, *self.attributes(value, depth))
            return token
        if callable(getattr(value, "cache_info", None)) and callable(getattr(value, "cache_clear", None)):
            return ("cached function", getattr(value, "__qualname__", ""), value.cache_info().currsize)  # lru_cache
        if isinstance(value, types.GeneratorType) and depth < MAX_DEPTH:  # a running average kept in its frame
            frame = value.gi_frame
            return ("generator", getattr(value, "__qualname__", ""),
                    tuple((k, self.token(v, depth + 1)) for k, v in (frame.f_locals if frame else {}).items()))
        np_token = numpy_token(value)
        if np_token is not None:
            return np_token
        if isinstance(value, nn.Module) and id(value) not in self._registered and depth < MAX_DEPTH:
            # a module held outside the model's registry (in a Python list, a dict, a helper object): its tensors are
            # nobody else's to fingerprint
            tensors = [*value.parameters(), *value.buffers()]
            return ("unregistered module", type(value).__name__, tuple(self.token(t, depth + 1) for t in tensors))
        if isinstance(value, FUNCTION_TYPES) and (not library_callable(value) or binds(value)) and depth < MAX_DEPTH:
            if id(value) in self._objects:
                return ("seen", id(value))
            self._objects.add(id(value))  # what a closure, a default argument, a bound object or its attributes keep
            return ("callable", getattr(value, "__qualname__", type(value).__name__),
                    tuple(self.token(v, depth + 1) for v in callable_state(value)), *self.attributes(value, depth))
        if isinstance(value, (nn.Module, FUNCTION_TYPES)):
            return (type(value).__name__, Same(value))
        if depth >= MAX_DEPTH:
            if self._fresh:
                return ("deep", type(value).__name__, len(value) if isinstance(value, Sized) else None)
            return ("deep", type(value).__name__, Same(value))
        if isinstance(value, (list, tuple, deque)):
            return (type(value).__name__, len(value), tuple(self.token(v, depth + 1) for v in _sample(value)))
        if isinstance(value, dict):
            return (type(value).__name__, len(value),
                    tuple((repr(k), self.token(v, depth + 1)) for k, v in _sample(list(value.items()))))
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, len(value), frozenset(self.token(v, depth + 1) for v in value))
        if is_context_variable(value):  # its value lives in the running context, not in the object
            return ("context variable", value.name, self.token(value_of(value), depth + 1))
        raw = _raw_token(value)
        if raw is not None:
            return raw
        if isinstance(value, Dataset):
            return dataset_token(value)  # the data, not state: its tensors by version, so an in-place write shows
        if _is_library(value) and configuration_object(value) and id(value) not in self._objects:
            self._objects.add(id(value))  # a library's configuration (Hugging Face's model.config): a namespace
            return ("configuration", type(value).__name__,
                    tuple((k, self.token(v, depth + 1)) for k, v in vars(value).items() if not k.startswith("_")))
        parameters = _distribution_parameters(value)
        if parameters is not None:
            return ("distribution", type(value).__name__, tuple((k, self.token(v, depth + 1)) for k, v in parameters))
        if isinstance(value, RemovableHandle):
            return handle_token(value)
        slots = slot_fields(value) if not isinstance(value, type) else []
        if slots and not hasattr(value, "__dict__") and id(value) not in self._objects:  # a memo in a __slots__ object
            self._objects.add(id(value))
            return ("object", type(value).__name__, tuple((k, self.token(v, depth + 1)) for k, v in slots))
        if _is_library(value) or not hasattr(value, "__dict__") or isinstance(value, type):
            token = ("object", type(value).__name__, Same(value))
            if self._first is None or not library_object(value) or id(value) in self._objects:
                return token
            self._objects.add(id(value))
            added = self._added(value, depth)  # `loader.center = x.mean(0)` on a DataLoader held as state
            return (*token, ("added", added)) if added else token
        if id(value) in self._objects:
            return ("seen", id(value))
        self._objects.add(id(value))
        fields = lightning_fields(value)  # a LightningDataModule held as a global: its lazily made `_hparams` skipped
        shared = [(f"{c.__qualname__}.{k}", v) for c, k, v in class_attributes([type(value)])]  # `history = []`
        return ("object", type(value).__name__,
                tuple((k, self.token(v, depth + 1)) for k, v in [*fields.items(), *slots, *shared]
                      if not library_function(v)))

    def _added(self, value: Any, depth: int) -> tuple[Hashable, ...]:
        """Tokens of the attributes added to a library's object since first seen (:func:`added_attributes`) and, to
        :data:`MAX_DEPTH` levels, to the library objects its own attributes hold (``loader.sampler.center = x``),
        whose own attributes are not read (they are the library's: a loader's iterator changes every epoch)."""
        added = added_attributes(value, self._first)  # type: ignore[arg-type]
        out = [(k, self.token(v, depth + 1)) for k, v in added]
        if depth + 1 < MAX_DEPTH:
            names = {k for k, _ in added}
            for k, v in list(vars(value).items()):
                if not library_object(v) or k in names or id(v) in self._objects:
                    continue
                self._objects.add(id(v))
                inner = self._added(v, depth + 1)
                if inner:
                    out.append((k, ("added", inner)))
        return tuple(out)

    def attributes(self, value: Any, depth: int = 0) -> tuple[Hashable, ...]:
        """Tokens of the Python attributes a tensor or a user's function holds in its ``__dict__`` (``hook.stats = x``,
        ``self.temp.stats = x`` on a plain tensor attribute), torch's, Python's and the mechanism's own skipped
        (:func:`kept_attributes`); empty when there are none."""
        fields = kept_attributes(value, self._skip_keys)
        if not fields:
            return ()
        return (("attributes", len(fields),
                 tuple((k, self.token(v, depth + 1)) for k, v in _sample(fields))),)


def library_object(value: Any) -> bool:
    """Whether ``value`` is a library's object read for what was added to it (:meth:`Walker._added`): of a class of
    :data:`LIBRARY_PREFIXES` whose objects have a ``__dict__``, not a class, a module (the model's are fingerprinted as
    such; another's tensors by the walk), a tensor, a function, or lightning_dp's own (the mechanism's book-keeping,
    set as it runs: the strategy, among the loop's objects, is read as one of them), nor torch.distributed's (FSDP2's
    state objects, process groups: set lazily as they run). Answered per class."""
    cls = type(value)
    read = _READ.get(cls)
    if read is None:
        module = cls.__module__ or ""
        read = _READ[cls] = library_type(cls) and not module.startswith("lightning_dp.") \
            and not module.startswith("torch.distributed.") \
            and cls.__dictoffset__ != 0 and not issubclass(cls, (type, nn.Module, Tensor, *FUNCTION_TYPES,
                                                                  types.ModuleType))
    return read


_READ: dict[type, bool] = {}
"""Per class, :func:`library_object`'s answer."""


def added_attributes(obj: Any, first: FirstFields) -> list[tuple[str, Any]]:
    """(name, value) of the attributes set on a library's object (its ``__dict__``) since :class:`FirstFields` first
    saw it: public names, and private ones holding a tensor or an array — the libraries' own lazily set names
    (``_last_val_time``, ``_opt_called``) hold numbers and flags that change as they run — less a library's function
    (a scheduler made mid-fit wraps ``optimizer.step``). The first call for an object records its names and returns
    nothing."""
    try:
        fields = vars(obj)
    except TypeError:  # no __dict__
        return []
    known = first.known(obj, fields)
    if len(fields) == len(known) and known.issuperset(fields):
        return []
    return [(k, v) for k, v in list(fields.items()) if k not in known and isinstance(k, str)
            and (not k.startswith("_") or holds_tensors(v)) and not library_function(v)]


def handle_token(handle: RemovableHandle) -> Hashable:
    """A module hook's handle kept by the user (``self.h = layer.register_forward_hook(fn)``) as what it removes: the
    table it points into and the hook's place among the user's hooks there (``kept_state`` names them so), ``None``
    once removed. Its number comes from a global counter, so a run again registering the same hook holds another
    handle: by identity, every such run would differ."""
    table = handle.hooks_dict_ref()
    if table is None or handle.id not in table:
        return ("hook handle", None)
    users = [k for k, fn in table.items() if not library_callable(fn) or binds(fn)]
    return ("hook handle", id(table), users.index(handle.id) if handle.id in users else -1)


def _distribution_parameters(value: Any) -> Optional[list[tuple[str, Any]]]:
    """A ``torch.distributions.Distribution``'s parameters by the names of its ``arg_constraints`` (``loc``,
    ``scale``; ``probs`` and ``logits`` both, the lazy one computed and cached now, so that a later first read of
    it changes nothing): a prior or an input density fitted to the batch (``Normal(x.mean(0), x.std(0))``) holds the
    batch's statistics, compared by value as a tensor would be (a new object each step is not a new value; the
    replays on other data set it apart). ``None`` for any other object, or one whose parameters cannot be read."""
    distributions = sys.modules.get("torch.distributions")
    if distributions is None or not isinstance(value, distributions.Distribution):
        return None
    try:
        names = list(getattr(type(value), "arg_constraints", {}) or {})
        return [(name, getattr(value, name)) for name in names if name in vars(value) or hasattr(type(value), name)]
    except Exception:  # noqa: BLE001  (a parameterisation that cannot be computed: compared by identity instead)
        return None


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
    elif not isinstance(value, (types.FunctionType, types.SimpleNamespace)) or library_callable(value):
        return []
    fields = getattr(value, "__dict__", None)
    if not fields:
        return []
    return [(k, v) for k, v in list(fields.items()) if isinstance(k, str) and k not in skip_keys
            and not k.startswith(("_dp_", "_dynamo_", "_torchdynamo_", "__")) and not library_function(v)]


def slot_fields(value: Any) -> list[tuple[str, Any]]:
    """(name, value) of the ``__slots__`` fields set on an object of the user's class (a memo kept in a
    ``__slots__`` object has no ``__dict__``): the slots the user's classes of its MRO declare, read through their
    descriptors (no code of the user's runs); an unset slot left out. A library's object: none (its slots are its
    own book-keeping). The slots are found once per class."""
    cls = type(value)
    out = []
    for name, descriptor in slot_descriptors(cls):
        try:
            out.append((name, descriptor.__get__(value, cls)))
        except AttributeError:  # an unset slot
            continue
    return out


def slot_descriptors(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, member descriptor) of the slots the user's classes of ``cls``'s MRO declare (:func:`slot_fields`);
    found once per class."""
    names = _SLOTS.get(cls)
    if names is None:
        found: dict[str, Any] = {}
        for base in cls.__mro__ if not library_type(cls) else ():
            declared = base.__dict__.get("__slots__") or ()
            for name in (declared,) if isinstance(declared, str) else declared:
                stored = _mangled(base, name)
                descriptor = vars(base).get(stored)
                if not library_type(base) and isinstance(descriptor, types.MemberDescriptorType):
                    found.setdefault(stored, descriptor)
        names = _SLOTS[cls] = tuple(found.items())
    return names


def _mangled(cls: type, name: str) -> str:
    """A slot's attribute name as Python stores it (``__x`` of class ``C`` is ``_C__x``)."""
    return f"_{cls.__name__.lstrip('_')}{name}" if name.startswith("__") and not name.endswith("__") else name


_SLOTS: dict[type, tuple[tuple[str, Any], ...]] = {}
"""Per class, the slots :func:`slot_fields` reads: (name, member descriptor)."""


def configuration_object(value: Any) -> bool:
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


def hung_gradient(t: Tensor) -> Optional[Tensor]:
    """The tensor held in the ``.grad`` slot of a tensor that does not require grad (a buffer, a frozen parameter, a
    plain tensor attribute): no backward writes it, so whatever is there a hook put there (``self.center.grad =
    batch[0].mean(0)``, read back by the next forward); ``None`` when the slot is empty. (A tensor that does not
    require grad is a leaf: reading its ``.grad`` warns of nothing.)"""
    return None if t.requires_grad else t.grad


def function_defaults(fn: Any) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    """A user's function's default arguments, positional and keyword-only (``__defaults__``, ``__kwdefaults__``),
    ``None`` when it has none or is a library's: a number a hook writes there (``shift.__kwdefaults__["by"] =
    float(mean)``, ``f.__defaults__ = (mean,)``) is read by every later call that omits the argument."""
    if not isinstance(fn, types.FunctionType) or library_callable(fn):
        return None
    fn = unwrapped(fn)
    if not fn.__defaults__ and not fn.__kwdefaults__:
        return None
    return tuple(fn.__defaults__ or ()), dict(fn.__kwdefaults__ or {})


def _mutable_defaults(fn: Any) -> bool:
    """Whether a function keeps a list, dict, set or tensor as a default argument or in a closure."""
    return any(isinstance(v, (list, dict, set, deque, Tensor)) for v in callable_state(fn))


def mutable_state(fn: Any) -> bool:
    """Whether a function keeps something it can write between calls (:func:`_mutable_defaults`, or its own
    attributes: ``fn.stats = x``, whatever they hold)."""
    return _mutable_defaults(fn) or bool(kept_attributes(fn))


def users_method(value: types.FunctionType) -> types.FunctionType:
    """A method of a class body as the user wrote it, whether the logger judge wraps it now or not, a library's wrapper
    set for the fit (a logger's watched ``log``, torch's step wrapper ``profile_hook_step``, which carries the user's
    step's name) taken off: the wrappers whose own code is a library's (:func:`library_code`) are looked through, to
    the function of the user's they call (held in their closure or as ``__wrapped__``)."""
    value = unwrapped(value)
    for _ in range(_MAX_WRAPPED):
        if not library_code(value) and not (type(value) is _FUNCTION and _code_kind(value.__code__) == _HELPER):
            break
        wrapped = value.__dict__.get("__wrapped__")
        users = [v for v in (wrapped, *_called_cells(value))
                 if isinstance(v, types.FunctionType) and not library_callable(v)]
        if users:  # the user's function a library's wrapper calls (torch's no_grad: `func` in its closure)
            value = users[0]
        elif isinstance(wrapped, types.FunctionType):
            value = wrapped
        else:
            break
    return value


def method_cells(fn: types.FunctionType) -> list[types.CellType]:
    """The closure cells of a user's method that hold a value (``kept = {}`` of the function that made the method, a
    counter it rebinds with ``nonlocal``); the ``__class__`` cell ``super()`` uses is the class itself, not data, and
    a cell holding a function, a class or a module is code the method calls (a reader ``read = lambda:
    torch.load(path)``), not followed."""
    names = fn.__code__.co_freevars
    cells = []
    for name, cell in zip(names, fn.__closure__ or ()):
        try:
            cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if name != "__class__" and not isinstance(cell.cell_contents, (*FUNCTION_TYPES, type, types.ModuleType)):
            cells.append(cell)
    return cells


def class_attributes(classes: Iterable[type]) -> Iterator[tuple[type, str, Any]]:
    """(class, name, value) of the data held by the user's classes themselves — ``history = []`` in a class body,
    shared by every instance, appended through ``self.history`` — for ``classes`` and their bases, libraries'
    left out; methods, properties and other descriptors, nested classes and dunder names skipped. A method's own
    state is data too: its default arguments (``f.__defaults__``: positional and keyword-only), what its closure
    holds (``f.__closure__``: the contents of every cell but ``__class__``, compared whatever their type) and its
    attributes (``f.__dict__``)."""
    seen: set[type] = set()
    for cls in classes:
        for base in cls.__mro__:
            if base in seen or library_type(base):  # (a user's class claiming torch's module: read)
                continue
            seen.add(base)
            for key, value in list(vars(base).items()):
                if isinstance(value, types.FunctionType) and not key.startswith("__"):  # a method: what it keeps
                    value = users_method(value)
                    defaults = function_defaults(value)
                    if defaults is not None:  # `def f(self, v, _acc={})`; `M.f.__kwdefaults__["by"] = x`
                        yield base, f"{key}.__defaults__", defaults
                    cells = method_cells(value)
                    if cells:  # a method made in a closure: `kept = {}` of its maker, written through the closure
                        yield base, f"{key}.__closure__", tuple(cell.cell_contents for cell in cells)
                    fields = kept_attributes(value)
                    if fields:  # `MyModel.forward.stats = x`
                        yield base, f"{key}.__dict__", dict(fields)
                    continue
                if key.startswith("__") or hasattr(type(value), "__get__") \
                        or isinstance(value, (type, types.ModuleType)):
                    continue
                yield base, key, value


def library_class_attributes(classes: Iterable[type]) -> Iterator[tuple[type, str, Any]]:
    """(class, name, value) of the data held by the library classes among ``classes``' bases, and by ``nn.Module``
    itself: ``pl.LightningModule.offset = float(x.mean())`` at a batch's end, read by the next forward as
    ``self.offset``, is one value every module of that class shares. Public names holding anything but a function,
    a descriptor (a property, a method), a class or a Python module; private names (the libraries' own, set as they
    run: ``LightningModule._jit_is_scripting``) only when they hold a tensor or an array. Which names those are is kept
    per class (:data:`_LIBRARY_NAMES`) while its ``__dict__`` holds the same values (a new name, a name bound to
    another kind of value, shows; the values themselves are read anew at every call), so an unchanged class costs
    one comparison of its values in C."""
    classes = frozenset(classes)
    bases = _LIBRARY_BASES.get(classes)
    if bases is None:
        found = dict.fromkeys(b for c in (*sorted(classes, key=_qualified), nn.Module) for b in c.__mro__
                              if b is not object and library_type(b))
        bases = _LIBRARY_BASES[classes] = list(found)
    for base in bases:
        fields = vars(base)
        values = list(fields.values())
        kept = _LIBRARY_NAMES.get(base)
        try:
            same = kept is not None and kept[0] == values  # (identical items compare equal without __eq__)
        except Exception:  # noqa: BLE001  (a value rebound to a tensor or an array: no truth value)
            same = False
        if not same:
            names = [k for k, v in fields.items() if isinstance(k, str) and not k.startswith("__")
                     and not callable(v) and not hasattr(type(v), "__get__")
                     and not isinstance(v, (type, types.ModuleType)) and (not k.startswith("_") or holds_tensors(v))]
            kept = _LIBRARY_NAMES[base] = (values, names)
        for key in kept[1]:
            yield base, key, fields[key]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_LIBRARY_BASES: dict[frozenset, list[type]] = {}
"""The library classes :func:`library_class_attributes` reads for a set of classes, ``nn.Module`` last."""


_LIBRARY_NAMES: dict[type, tuple[list[Any], list[str]]] = {}
"""Per library class, its ``__dict__``'s values and the names :func:`library_class_attributes` reads there (which
names depends only on what kind of value each holds)."""


def holds_tensors(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is or holds (in a list, tuple, deque or dict, two levels deep) a tensor or a NumPy array."""
    if isinstance(value, Tensor) or type(value).__module__ == "numpy":
        return True
    if depth < 2 and isinstance(value, (list, tuple, deque)):
        return any(holds_tensors(v, depth + 1) for v in _sample(value))
    if depth < 2 and isinstance(value, dict):
        return any(holds_tensors(v, depth + 1) for v in _sample(list(value.values())))
    return False


def user_modules(classes: Iterable[type]) -> list[types.ModuleType]:
    """The Python modules that define ``classes`` and their bases, libraries' left out (the user's own code: a
    training script's ``__main__``, the module of a LightningModule or of a callback handed the batch), and the
    user's helper modules they import (:func:`~lightning_dp.fingerprints.helper_modules.helper_modules`), whose
    module-level globals a step could write (``global MEMORY; MEMORY.append(x)``, ``utils.MEMORY.append(x)``)."""
    names = {name for cls in classes for base in cls.__mro__ if not library_type(base)
             for name in defining_modules(base)}  # (a class claiming torch's module: the file its methods lie in)
    found = [sys.modules.get(name) for name in sorted(names)
             if name and name.split(".")[0] not in LIBRARY_PREFIXES]
    found = [m for m in found if m is not None]
    key = tuple((m.__name__, len(vars(m))) for m in found)  # the helpers change when a user module's globals do
    helpers = _HELPERS.get(key)
    if helpers is None:
        helpers = _HELPERS[key] = helper_modules(found)
    return found + helpers


_HELPERS: dict[tuple, list[types.ModuleType]] = {}  # the user modules (and their globals' count) → their helpers



def written_name(fn: Any) -> str:
    """The name a callable's code was written under (``co_qualname``, and its file and line when a wrapper's copied
    name says otherwise: a step of the user's dressed as ``SGD.step`` by ``functools.wraps``), for messages."""
    target = fn
    while isinstance(target, (_PARTIAL, _METHOD)):
        target = target.func if isinstance(target, _PARTIAL) else target.__func__
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_qualname != name:
        return f"{code.co_qualname} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    return name


def library_function(value: Any) -> bool:
    """A function, method or partial defined by a library: nothing of the user's is kept in it (a partial binding
    arguments keeps them: ``partial(F.cross_entropy, weight=w)`` holds the user's ``w``)."""
    return isinstance(value, FUNCTION_TYPES) and library_callable(value) and not binds(value)


def binds(value: Any) -> bool:
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
        fn = unwrapped(fn)  # lightning_dp's wrapper of a user's hook for the fit: the hook's own state
        return [*_cells(fn), *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    return [fn]


_EMPTY = object()


def _cells(fn: types.FunctionType, empty: Any = _EMPTY) -> list[Any]:
    """The contents of ``fn``'s closure cells, an empty cell as ``empty`` (left out by default)."""
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            if empty is not _EMPTY:
                out.append(empty)
    return out


def _scalar_token(value: Any) -> Optional[Hashable]:
    """``None``, a flag, a number, a string or bytes by its type and value (a float by its ``repr``, so a NaN equals
    itself); ``None`` for any other value."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    return None


PLAIN_DEPTH = 4
"""Nesting depth :func:`freeze` follows into containers, objects and closures (deeper values by their type)."""


PLAIN_ITEMS = 256
"""Items of a container :func:`freeze` tokens (the first ones; lists, tuples and sets by their length too)."""


SMALL_TENSOR = 16
"""Tensors up to this many elements are tokened by :func:`freeze` by their values; larger ones by identity and
version counter."""


def freeze(value: Any, depth: int = 0) -> Hashable:
    """A token of a plain value held outside the modules (an optimizer's hyper-parameter or extra state, a scheduler's
    state): two tokens are equal when a write from the data could not have told the values apart. Scalars as the walk
    reads them (:func:`_scalar_token`), and NumPy values (:func:`numpy_token`); a tensor by its values when small
    (:data:`SMALL_TENSOR`), else by identity, shape and version counter; containers item by item; a function by what
    it keeps (:func:`closure_token`); a plain object by its attributes; to :data:`PLAIN_DEPTH` levels. Modules,
    classes and objects without attributes by identity (their contents are the walk's to read, not a setting's)."""
    scalar = _scalar_token(value)
    if scalar is not None:
        return scalar
    if isinstance(value, Tensor):
        if value.numel() <= SMALL_TENSOR and not value.is_sparse:
            return ("tensor", tuple(value.shape), str(value.dtype),
                    tuple(repr(v) for v in value.detach().reshape(-1).tolist()))
        return ("tensor", tuple(value.shape), Same(value), value._version)
    np_token = numpy_token(value)
    if np_token is not None:
        return np_token
    if depth >= PLAIN_DEPTH:
        return ("deep", type(value).__qualname__)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), freeze(v, depth + 1)) for k, v in list(value.items())[:PLAIN_ITEMS])))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(freeze(v, depth + 1) for v in list(value)[:PLAIN_ITEMS]), len(value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(freeze(v, depth + 1)) for v in list(value)[:PLAIN_ITEMS])), len(value))
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return closure_token(value, depth + 1)
    slots = slot_fields(value) if not isinstance(value, (type, types.ModuleType, nn.Module)) else []
    if isinstance(value, (type, types.ModuleType, nn.Module)) or not hasattr(value, "__dict__") and not slots:
        return ("object", type(value).__qualname__, Same(value))
    return (type(value).__qualname__, freeze(getattr(value, "__dict__", {}), depth + 1), freeze(dict(slots), depth + 1))


def closure_token(fn: Any, depth: int = 0) -> Hashable:
    """:func:`freeze`'s token of what a function keeps between calls: its closure cells' contents (an empty cell as
    ``None``) and its default arguments (a bound method: its function's; a callable object: its attributes)."""
    target = getattr(fn, "__func__", fn)
    if not isinstance(target, types.FunctionType):
        return freeze(getattr(fn, "__dict__", None), depth)
    return ("function", target.__qualname__, freeze(_cells(target, empty=None), depth),
            freeze(target.__defaults__, depth), freeze(target.__kwdefaults__, depth),
            freeze(dict(kept_attributes(target)), depth))  # (its own attributes: `rate.memo = {}`)


def _sample(items: Sequence[Any]) -> Sequence[Any]:
    if len(items) <= MAX_ITEMS:
        return items
    stride = len(items) // MAX_ITEMS + 1
    return [*items[:64], *items[64:-64:stride], *items[-64:]]
