"""What is library code, as every walk of the user's state needs to know it: objects of these packages are compared
by identity and never walked into, callbacks of Lightning and lightning_dp keep no state from the batch, and the
attribute names torch's ``nn.Module`` and Lightning's ``LightningModule`` keep themselves are not the user's.

Kept below the validators (the kept-state fingerprint, :mod:`lightning_dp.validators.kept_state`, re-exports these
names) so that the records' own walks (:mod:`~lightning_dp.records.user_generators`) read the same rules."""

from __future__ import annotations

import types
import weakref

from typing import Any, Optional

from torch import nn

from lightning_dp.records.library_code import LIBRARY_PREFIXES, library_named, library_type  # noqa: F401

TRUSTED_CALLBACK_PREFIXES = ("pytorch_lightning.callbacks", "lightning.pytorch.callbacks", "lightning_dp.")
"""Callbacks defined here keep no state computed from the training batch (ModelCheckpoint, EMA, progress bars,
lightning_dp's own)."""


USER_SET_KEYS = frozenset({"_example_input_array"})
"""Names a fresh ``LightningModule`` holds whose values the user sets: ``self.example_input_array = x[:1]`` (for the
model summary, ``log_graph``, ``to_onnx``) is the user's state like any attribute, a training record if taken from
the batch or the training set."""


def module_keys() -> frozenset[str]:
    """The attribute names a fresh ``nn.Module`` and a fresh ``LightningModule`` hold (less :data:`USER_SET_KEYS`)."""
    import pytorch_lightning as pl

    keys = set(vars(nn.Module())) | set(vars(pl.LightningModule()))
    return frozenset(keys - USER_SET_KEYS)


_FRAMEWORK_KEYS: Optional[frozenset[str]] = None


def framework_keys() -> frozenset[str]:
    """Attribute names that torch's ``nn.Module`` and Lightning's ``LightningModule`` keep themselves."""
    global _FRAMEWORK_KEYS
    if _FRAMEWORK_KEYS is None:
        _FRAMEWORK_KEYS = module_keys() | {"_hparams_name", "_log_hyperparams", "_ldp_probe"}
    return _FRAMEWORK_KEYS


def is_library(obj: Any) -> bool:
    """Whether ``obj``'s class is a library's (:func:`~lightning_dp.records.library_code.library_type`: named in one of
    :data:`LIBRARY_PREFIXES` and written there; a user's class claiming ``__module__ = "torch.nn"`` is walked)."""
    return library_type(type(obj))


def library_callback(callback: Any) -> bool:
    """One of Lightning's or lightning_dp's own callbacks (their hooks are not the user's code)."""
    return library_named(type(callback), TRUSTED_CALLBACK_PREFIXES)


_WRAPPERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def mark_wrapper(wrapper: Any) -> Any:
    """Note ``wrapper`` (a function lightning_dp puts in place of a user's hook for a fit, ``functools.wraps``-ed:
    the logger judge's) as the library's: what it keeps is its own, and walks of the user's state read the hook it
    wraps (:func:`unwrapped`) — else the class's data would change as the wrapper comes and goes. Returns it."""
    _WRAPPERS.add(wrapper)
    return wrapper


def unwrapped(fn: Any) -> Any:
    """The user's function behind lightning_dp's wrappers (:func:`mark_wrapper`); ``fn`` itself otherwise."""
    while isinstance(fn, types.FunctionType) and fn in _WRAPPERS:
        fn = fn.__wrapped__
    return fn
