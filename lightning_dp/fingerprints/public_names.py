"""Declared public names (``public_state``): which paths of kept state the user has declared public, so that no
fingerprint, replay or data check reads them (:mod:`lightning_dp.validators.kept_state`,
:mod:`lightning_dp.record_statistics`)."""

from __future__ import annotations

import fnmatch
from typing import Sequence


def is_public(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` (``queue``, ``encoder.stats.mean``, ``MyCallback.bank``) is covered by a declared public
    name: an exact match, a prefix followed by ``.`` or ``[``, or a shell-style wildcard (``metrics.*``)."""
    for pattern in patterns:
        if path == pattern or path.startswith(pattern + ".") or path.startswith(pattern + "["):
            return True
        if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(path, pattern):
            return True
    return False
