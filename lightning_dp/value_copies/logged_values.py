"""Which numbers are copies of the logged values, and how each moves: by name (a key, a column, the name beside it in
a row or a line) and by value (equal to a value logged this fit, as a float64, a float32 or rounded to the digits it
shows).

A logger keeps what Lightning handed it: ``float(tensor)`` (the float32 value exactly) in memory, ``repr`` of it in a
file (``json.dumps``, ``csv``), or fewer digits (``f"{v:.4f}"``). A number equal to such a value is taken for its copy
when the value is distinctive: not a whole number and shown with at least :data:`DIGITS` significant digits (a logged
0.5 or 3.0 could be a learning rate or a step count; those copies are found by name only). A number shown with fewer
digits than the value (``0.6412`` for 0.641237…) is its copy when it has :data:`DIGITS` significant digits or more.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

__all__ = ["DIGITS", "LoggedValues", "Moves", "as_float", "distinctive", "significant"]

DIGITS = 4
"""The significant digits a number shows at least to be matched by value."""

Moves = tuple[Callable[[Any], Any], Callable[[Any], Any]]
"""How a logged value moves at an even position of a history, and at an odd one."""

_MANTISSA = re.compile(r"^[-+]?(\d*)\.?(\d*)")


def significant(text: str) -> int:
    """The significant digits the decimal ``text`` shows (``"0.6412"``: 4; ``"1e-05"``: 1)."""
    found = _MANTISSA.match(text.strip())
    return len((found.group(1) + found.group(2)).lstrip("0")) if found else 0


def _single(x: float) -> Optional[float]:
    """``x`` rounded to float32 (``None`` past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except (OverflowError, struct.error):
        return None


def as_float(value: Any) -> Optional[float]:
    """``value`` as a float if it is a non-flag number or a one-element floating tensor, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value.detach().float().cpu())
    if type(value).__module__ == "numpy" and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        return float(value) if value.dtype.kind in "fiu" else None
    return None


def distinctive(x: float, shown: Optional[str] = None) -> bool:
    """Whether the number ``x`` (as ``shown``) is matched by value: finite, not whole, :data:`DIGITS` digits shown."""
    return math.isfinite(x) and x != int(x) and significant(shown or repr(x)) >= DIGITS


class LoggedValues:
    """The logged ``names`` (also after a logger's prefix: ``keys``) and their ``values`` this fit, and how a copy of
    one moves (``moves``: at an even and at an odd position along its history)."""

    def __init__(self, names: Iterable[str], values: Mapping[str, Iterable[Any]], moves: Moves,
                 keys: Iterable[str] = ()) -> None:
        self.names = set(names) | set(keys)
        self.moves = moves
        self._exact: dict[float, str] = {}
        self._single: dict[float, str] = {}
        self._rounded: dict[int, dict[float, str]] = {}
        for name, kept in values.items():
            for value in kept:
                x = as_float(value)
                if x is not None and distinctive(x):
                    self._exact.setdefault(x, name)
                    if (single := _single(x)) is not None:
                        self._single.setdefault(single, name)
        pattern = "|".join(re.escape(n) for n in sorted(self.names, key=len, reverse=True))
        self._before = re.compile(rf"(?<![\w-])({pattern})[\"']?\s*[:=,\t]\s*[\"']?$") if pattern else None

    def __bool__(self) -> bool:
        return bool(self.names)

    def named(self, key: Any) -> Optional[str]:
        """``key`` if it is a logged name (as a logger keys it)."""
        return key if isinstance(key, str) and key in self.names else None

    def of(self, x: float, shown: Optional[str] = None) -> Optional[str]:
        """The logged name whose value the number ``x`` (written ``shown``) is a copy of, if any."""
        shown = shown or repr(x)
        if not self._exact or not distinctive(x, shown):
            return None
        found = self._exact.get(x) or self._single.get(_single(x) or x)
        if found is None and "e" not in shown.lower() and "." in shown:
            decimals = len(shown.split(".")[1])
            if decimals not in self._rounded:
                self._rounded[decimals] = {}
                for value, name in self._exact.items():
                    self._rounded[decimals].setdefault(round(value, decimals), name)
            found = self._rounded[decimals].get(x)
        return found

    def before(self, text: str) -> Optional[str]:
        """The logged name ``text`` ends with, followed by a separator (``"train_loss": ``, ``train_loss=``,
        ``train_loss,``): the number after it is that name's."""
        found = self._before.search(text) if self._before is not None else None
        return found.group(1) if found else None

    def move(self, value: Any, position: int) -> Any:
        """``value`` moved as the ``position``-th value of its name along a history (alternately)."""
        return self.moves[position % 2](value)

