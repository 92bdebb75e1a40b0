"""What is a library's code, decided in one place by where the code that runs lies, never by the names a class body
or ``functools.wraps`` can set (``__module__``, ``__qualname__``): a function is a library's when its code file lies
in an imported library's package (:func:`library_code`, :func:`library_callable`); a class is a library's when the
code its MRO defines is (:func:`library_class`); and a class is a library's for trusting its objects — their data
left unwalked, their hooks unjudged, a mode left on the stack — when, besides, it was written in that library
(:func:`library_type`: a user's class claiming ``__module__ = "torch.nn"`` or ``"lightning_dp.x"`` is the user's,
whether it defines code or holds only data). Every trust decision of the walks, the validators and the mechanism
reads these (docs/release_boundary.md, "Library code").

Kept at the floor of the package (:mod:`lightning_dp.records`) so that :mod:`~lightning_dp.records.library_objects`,
the fingerprints' walks and :mod:`lightning_dp.mode_free` read the same rule. Not seen: a code object whose file name
was itself rewritten (``code.replace(co_filename=...)``), or a class a user hung on a library's module under its
own name (``torch.nn.Evil = Evil``) and gave only a library's functions: Python lets a program rewrite these too."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
import weakref
from typing import Any, Iterator, Optional

LIBRARY_PREFIXES = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_dp", "torchmetrics",
                    "transformers", "peft", "timm", "numpy", "tensorboard", "logging", "threading", "builtins",
                    "opacus", "jsonargparse", "omegaconf", "hydra", "typing", "collections", "functools")
"""Classes from these packages are library objects: compared by identity, never walked into."""

FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
"""The callables the walk reads as functions (what they keep: their closure, defaults, bound arguments)."""


def library_callable(fn: Any) -> bool:
    """A hook or function defined by a library (an engine's capture, Opacus', torch's own): its state is its owner's.

    Decided by the code that runs, not by the names ``functools.wraps`` copies (``__module__``, ``__qualname__``: a
    user's step decorated with ``functools.wraps(torch.optim.SGD.step)`` claims torch's module; zoo35 R09, R12, R14):
    a Python function is a library's when its own code lies in a library's package (:func:`library_code`); a bound
    method, by its function; a ``functools.partial``, by the function it calls; a builtin method bound to an object
    (``table.__getitem__``, ``[...].append``) or a callable object, by the object's class (:func:`library_class`: a
    user's ``dict`` subclass with a ``__missing__`` is the user's; zoo35 R11); and all of it down the ``__wrapped__``
    chain (torch's ``no_grad`` or step wrapper around a user's function, a ``functools.lru_cache`` of it, lightning_dp's
    wrapper of a user's hook are the user's code). A library's method replaced on its class by a user's function
    (``torch.optim.SGD.step = patched``) is then the user's where it is read from the class."""
    kind = type(fn)
    if kind is _PARTIAL:
        fn = fn.func
        kind = type(fn)
    if kind is _METHOD:
        fn = fn.__func__
        kind = type(fn)
    if kind is _FUNCTION:  # the common case, decided before (this is called for every hook of every walk)
        known = _FUNCTIONS.get(id(fn))
        if known is not None and known[0]() is fn and known[1] is fn.__code__:
            return known[2]
    elif kind is _BUILTIN:
        owner = fn.__self__
        if owner is None or type(owner) is _MODULE:
            return True  # a builtin function (len, torch's operators): C code
        owner = owner if isinstance(owner, type) else type(owner)
        if not owner.__flags__ & _HEAP_TYPE:
            return library_module(owner.__module__)  # `[...].append`: a method of a class written in C
    return _library_callable(fn)


def _library_callable(fn: Any, seen: Optional[dict[int, bool]] = None) -> bool:
    """:func:`library_callable` past its fast path; ``seen``: the functions being decided (a library's recursive
    helper holds itself in its closure: taken as a library's while it is decided, and then not kept)."""
    seen = {} if seen is None else seen
    for _ in range(_MAX_WRAPPED):
        kind = type(fn)
        if kind is _FUNCTION:
            return _library_function(fn, seen)
        if kind is _METHOD:
            fn = fn.__func__
            continue
        if isinstance(fn, _PARTIAL):
            fn = fn.func
            continue
        if isinstance(fn, _BOUND_BUILTINS):
            owner = fn.__self__
            return owner is None or isinstance(owner, types.ModuleType) \
                or library_class(owner if isinstance(owner, type) else type(owner))  # `Table().__getitem__`
        if isinstance(fn, _UNBOUND_BUILTINS):
            return library_class(fn.__objclass__)
        if not library_class(kind):
            return False  # a callable object of the user's
        fn = getattr(fn, "__wrapped__", None)  # a library's wrapper object (lru_cache) around a function
        if fn is None:
            return True
    return False  # a __wrapped__ chain that does not end: not a library's


def _library_function(fn: types.FunctionType, seen: dict[int, bool]) -> bool:
    """:func:`library_callable` of a Python function: its own code, the function it wraps and the functions its
    closure holds (torch's ``no_grad`` wrapper calls the user's function it holds in a cell, whatever
    ``functools.wraps`` then set as its ``__wrapped__``), decided once per function object (and code)."""
    code = fn.__code__
    key = id(fn)
    known = _FUNCTIONS.get(key)
    if known is not None and known[0]() is fn and known[1] is code:
        return known[2]
    if key in seen:
        seen[-1] = True  # a cycle: assumed a library's here, decided by its first visit
        return True
    seen[key] = False
    wrapped = fn.__dict__.get("__wrapped__")
    inner = [*([wrapped] if wrapped is not None else []), *_called_cells(fn)]
    kind = _code_kind(code)
    if kind == _USERS or kind == _NO_FILE and not library_module(fn.__module__):
        library = False
    elif kind == _HELPER and not inner:
        library = library_module(fn.__module__)  # a standard library function: by its name, as before
    else:  # a library's function, or a helper's wrapper (contextlib's): what it calls decides too
        library = all(_library_callable(v, seen) for v in inner)
    del seen[key]
    if not seen.get(-1) or len(seen) == 1:  # not decided under an assumption (a cycle) of a caller's being a library's
        _FUNCTIONS[key] = (weakref.ref(fn, lambda ref: _FUNCTIONS.get(key, (None,))[0] is ref and _FUNCTIONS.pop(key)),
                           code, library)
    return library


def _called_cells(fn: types.FunctionType) -> Iterator[Any]:
    """The functions a function's closure holds (what a wrapper calls: ``func`` of torch's ``no_grad`` wrapper)."""
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, FUNCTION_TYPES):
            yield value


_FUNCTIONS: dict[int, tuple["weakref.ref[types.FunctionType]", types.CodeType, bool]] = {}
"""Per live function (by id, held weakly): its code then and whether it was a library's."""


_MAX_WRAPPED = 32
"""``__wrapped__`` links followed; a longer (or cyclic) chain is not taken for a library's."""

_FUNCTION, _METHOD, _PARTIAL, _BUILTIN, _MODULE = (types.FunctionType, types.MethodType, functools.partial,
                                                    types.BuiltinMethodType, types.ModuleType)
_BOUND_BUILTINS = (types.BuiltinMethodType, types.MethodWrapperType)
_UNBOUND_BUILTINS = (types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType)


def library_code(fn: Any) -> bool:
    """Whether a Python function's own code lies in the package directory of an imported library of
    :data:`LIBRARY_PREFIXES` (``fn.__code__.co_filename``, decided once per code
    object); code made at run time (``exec``, dataclasses' generated methods, torch.fx, frozen modules: a file name in
    ``<...>``) has no file and is judged by its module's name. Only the function's own code: a wrapper's
    ``__wrapped__`` is :func:`library_callable`'s to follow. Not a function: ``False``."""
    if type(fn) is not _FUNCTION:
        return False
    kind = _code_kind(fn.__code__)
    return kind == _LIBRARY or kind == _NO_FILE and library_module(fn.__module__)


def _code_kind(code: types.CodeType) -> int:
    """Where ``code`` lies: a library's package (:data:`_LIBRARY`); the standard library or another installed
    package (:data:`_HELPER`: ``contextlib``'s and ``typing_extensions.deprecated``'s wrappers, which are whatever
    they wrap; ``enum``'s, ``lightning_utilities``'); no file (:data:`_NO_FILE`: ``exec``, generated methods); or
    elsewhere: the user's (:data:`_USERS`). Kept per code object, which is kept with it (its id is not reused)."""
    known = _CODE_KINDS.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    file = code.co_filename
    if file.startswith("<frozen "):
        kind = _HELPER
    elif file.startswith("<"):
        kind = _NO_FILE
    elif file.startswith(_library_roots()):
        kind = _LIBRARY
    elif file.startswith(_installed_roots()):
        kind = _HELPER
    else:
        kind = _USERS
    _CODE_KINDS[id(code)] = (code, kind)
    return kind


_USERS, _LIBRARY, _HELPER, _NO_FILE = 0, 1, 2, 3
_CODE_KINDS: dict[int, tuple[types.CodeType, int]] = {}


def _installed_roots() -> tuple[str, ...]:
    """The standard library's directory and where installed packages lie (``site-packages``, ``dist-packages``)."""
    paths = sysconfig.get_paths()
    return tuple(os.path.join(os.path.abspath(p), "") for p in (
        paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"], *sys.path)
        if p and (p in paths.values() or os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")))


def _library_roots() -> tuple[str, ...]:
    """The directories of the imported library packages (a single-file module: its file), read anew: a library
    imported later adds its own (called only on a code object not seen before)."""
    roots = []
    for name in LIBRARY_PREFIXES:
        module = sys.modules.get(name)
        if module is None:
            continue
        paths = list(getattr(module, "__path__", None) or ())
        if paths:
            roots += [os.path.join(os.path.abspath(p), "") for p in paths]
        elif getattr(module, "__file__", None):
            roots.append(os.path.abspath(module.__file__))
    return tuple(roots)


def library_module(module: Optional[str]) -> bool:
    """Whether a module name is one of :data:`LIBRARY_PREFIXES`' packages."""
    known = _LIBRARY_MODULES.get(module)
    if known is None:
        known = _LIBRARY_MODULES[module] = (module or "").split(".")[0] in LIBRARY_PREFIXES
    return known


_LIBRARY_MODULES: dict[Any, bool] = {}


def library_class(cls: type) -> bool:
    """Whether a class runs only library code: the code its bodies, down its MRO, define (methods, static and class
    methods, properties, callables set as attributes) is a library's (:func:`library_callable`: a class body
    claiming ``__module__ = "torch.optim"`` with a method of the user's file is the user's) or the standard
    library's own (``enum.Enum``'s). ``dict``, ``list`` and other builtins are; a user's subclass of them with a
    ``__missing__`` is not (one that defines no code runs none of the user's). Decided once per class (a method set on
    the class later is not seen); a class written in C, by its module's name."""
    if not cls.__flags__ & _HEAP_TYPE:
        return library_module(cls.__module__)
    known = _LIBRARY_CLASSES.get(cls)
    if known is None:
        _LIBRARY_CLASSES[cls] = True  # while it is decided (a class holding an instance of itself)
        known = _LIBRARY_CLASSES[cls] = all(_library_base(base) for base in cls.__mro__ if base is not object)
    return known


def _library_base(base: type) -> bool:
    code = []
    for value in list(vars(base).values()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            code += [f for f in (value.fget, value.fset, value.fdel) if f is not None]
        elif isinstance(value, (_FUNCTION, _METHOD, _PARTIAL)) \
                or type(value).__flags__ & _HEAP_TYPE and callable(value) and not isinstance(value, type):
            code.append(value)  # Python code (C slots and descriptors of the class itself are not)
    return all(library_callable(v) or _standard_library_code(v) for v in code)


def _standard_library_code(fn: Any, depth: int = 0) -> bool:
    """A function of the standard library's or another installed package's own (``enum.Enum``'s methods, a base of
    torch's enums; sympy's cached methods) calling only such functions or a library's: no code of the user's."""
    if type(fn) is not _FUNCTION or depth > 4:
        return False
    kind = _code_kind(fn.__code__)
    if kind == _NO_FILE:
        return (fn.__module__ or "").startswith("namedtuple_")  # the __new__ namedtuple generates
    wrapped = fn.__dict__.get("__wrapped__")
    return kind == _HELPER and all(library_callable(v) or _standard_library_code(v, depth + 1)
                                   for v in [*([wrapped] if wrapped is not None else []), *_called_cells(fn)])


_HEAP_TYPE = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: set on classes made by a ``class`` statement or ``type(...)``."""

_LIBRARY_CLASSES: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()



def library_type(cls: type) -> bool:
    """Whether ``cls`` is a library's class for trusting its objects: named in one of :data:`LIBRARY_PREFIXES`'
    packages and written outside the user's code (:func:`installed_class`). A user's class claiming a library's
    ``__module__`` — holding only data, defining its own methods, or subclassing a library's class without a method of
    its own — is the user's. Decided once per class (read per object by the walks: one dictionary look-up)."""
    known = _LIBRARY_TYPES.get(cls)
    if known is None:
        known = _LIBRARY_TYPES[cls] = library_module(cls.__module__) and installed_class(cls)
    return known


_LIBRARY_TYPES: dict[type, bool] = {}
"""Per class, :func:`library_type`'s answer (classes are kept, as the walks' other per-class answers are)."""


def library_named(cls: type, prefixes: Any) -> bool:
    """:func:`installed_class`, of a class named under one of ``prefixes`` (``"torch."``, ``"lightning_dp."``, a
    tuple): which library it is is read from its name once the class is proved none of the user's."""
    return (cls.__module__ or "").startswith(prefixes) and installed_class(cls)


def library_rooted(cls: type, roots: Any) -> bool:
    """:func:`installed_class`, of a class whose module's top package is one of ``roots`` (a list the caller keeps:
    NumPy, the standard library's machinery)."""
    return (cls.__module__ or "builtins").split(".")[0] in roots and installed_class(cls)


def installed_class(cls: type) -> bool:
    """Whether ``cls`` was written outside the user's code — a library's, the standard library's or an installed
    package's: it runs only such code (:func:`library_class`) and every class of its MRO is what its module holds
    under its ``__qualname__``, or, made inside a function (``<locals>``) or by ``type(...)``, defines code of its own
    compiled in such a file under the class's name (``co_qualname``). Not by its ``__module__``, which a class body
    sets as it likes. A class written in C: ``True`` (a user cannot make one; its name says whose it is). Decided once
    per class."""
    if not cls.__flags__ & _HEAP_TYPE:
        return True
    known = _INSTALLED_CLASSES.get(cls)
    if known is None:
        _INSTALLED_CLASSES[cls] = False  # while it is decided
        known = _INSTALLED_CLASSES[cls] = library_class(cls) and all(
            _written_outside(b) for b in cls.__mro__ if b.__flags__ & _HEAP_TYPE)
    return known


def _written_outside(cls: type) -> bool:
    found: Any = sys.modules.get(cls.__module__ or "")
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None) if found is not None else None
    if found is cls:
        return True
    own = f"{cls.__qualname__}."
    for value in list(vars(cls).values()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if type(value) is _FUNCTION and value.__code__.co_qualname.startswith(own) \
                and _code_kind(value.__code__) in (_LIBRARY, _HELPER):
            return True
    return False


_INSTALLED_CLASSES: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def users_code(fn: Any) -> bool:
    """Whether a function's (a bound method's) own code lies in the user's files — or, made at run time, in a module
    not a library's — whatever its ``__module__`` says."""
    fn = getattr(fn, "__func__", fn)
    if type(fn) is not _FUNCTION:
        return False
    kind = _code_kind(fn.__code__)
    return kind == _USERS or kind == _NO_FILE and not library_module(fn.__globals__.get("__name__"))


def defining_modules(value: Any) -> tuple[str, ...]:
    """The names of the modules whose globals a function's or a class's own code reads (a function's
    ``__globals__["__name__"]``; a class's ``__module__`` and its own functions'): a user's class claiming
    ``__module__ = "torch.nn"`` still names the user's file its methods were written in."""
    if isinstance(value, type):
        known = _DEFINING.get(value)
        if known is None:
            names = dict.fromkeys([value.__module__ or ""])
            for item in list(vars(value).values()):
                item = getattr(item, "__func__", item)
                item = item.fget if isinstance(item, property) else item
                if type(item) is _FUNCTION:
                    names[item.__globals__.get("__name__") or ""] = None
            known = _DEFINING[value] = tuple(n for n in names if n)
        return known
    fn = getattr(value, "__func__", value)
    if type(fn) is _FUNCTION:
        return tuple(dict.fromkeys(n for n in (fn.__globals__.get("__name__"), fn.__module__) if n))
    name = getattr(value, "__module__", None)
    return (name,) if isinstance(name, str) and name else ()


_DEFINING: "weakref.WeakKeyDictionary[type, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def forged_or_own(cls: type, module: types.ModuleType) -> bool:
    """Whether a class a user's module holds is its own (defined there) or one claiming a library's module without
    being a library's (:func:`library_type`): either way the user's, whose class body data the fingerprint reads."""
    return cls.__module__ == module.__name__ or library_module(cls.__module__) and not library_type(cls)
