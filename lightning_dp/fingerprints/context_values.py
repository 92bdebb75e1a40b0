"""Values a ``contextvars.ContextVar`` holds (rule 3 of docs/release_boundary.md: the module-level globals of the
user's code).

A ``ContextVar`` kept as a global of the user's code is one object for the whole fit, and its value lives in the
running context, not in the object: the globals' fingerprint read it by identity, so a scale set from the batch loss
at a batch's end (``SCALE.set(loss)``) and read by the next forward steered every later step unseen (zoo16 cv1: the
weights of neighbouring datasets part after steps that did not sample the changed record). The fingerprint reads a
context variable by its value (:func:`value_of`) and the snapshots that put the user's state back after each replay
set it again (:func:`restore`), as they do a global rebound.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

__all__ = ["UNSET", "is_context_variable", "value_of", "restore"]

UNSET = object()
"""What :func:`value_of` gives for a variable without a value in this context (and no default)."""


def is_context_variable(value: Any) -> bool:
    """Whether ``value`` is a ``contextvars.ContextVar``."""
    return isinstance(value, contextvars.ContextVar)


def value_of(variable: "contextvars.ContextVar[Any]") -> Any:
    """``variable``'s value in the running context (its default when unset; :data:`UNSET` without one)."""
    try:
        return variable.get()
    except LookupError:
        return UNSET


def restore(variable: "contextvars.ContextVar[Any]") -> Callable[[], None]:
    """A function that sets ``variable`` back to its value now (its default, set explicitly, when unset now; a
    variable without a value or a default is left as it will be: it cannot be unset without the token of the ``set``
    that gave it its value)."""
    value = value_of(variable)

    def put() -> None:
        if value is not UNSET and value_of(variable) is not value:
            variable.set(value)
    return put
