"""Upstream warnings that say nothing to a lightning_dp user, filtered narrowly, in one place.

Only warnings raised inside Lightning's own code, matched by message, category and module,
and only where the cause is certainly harmless. Every warning lightning_dp means to give
(δ ≥ 1/N, non-private diagnostics, the noiseless variant, ...) is left alone.

Installed when lightning_dp registers with Lightning (``lightning_dp/__init__.py``, at import)
and again at ``setup`` of :class:`~lightning_dp.PrivacyBudget` and
:class:`~lightning_dp.SecondMomentMonitor`: a filter set during an import that runs inside
``warnings.catch_warnings()`` (pytest collects tests that way) is dropped when that block exits.
"""

from __future__ import annotations

import warnings

#: Lightning's copy of torch's tree flattening (``pytorch_lightning.utilities._pytree._tree_flatten``,
#: used by ``CombinedLoader`` on every fit/validate/test) builds ``torch.utils._pytree.LeafSpec()``,
#: which torch 2.13 deprecated in favour of ``treespec_leaf()``. The spec built is a valid leaf
#: spec and is only consumed by Lightning itself: nothing a user can or should change. The fix
#: belongs upstream in Lightning (still present in 2.6.6); until then the FutureWarning is noise.
_LEAFSPEC = dict(
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    category=FutureWarning,
    module=r"(pytorch_lightning|lightning\.pytorch)\.utilities\._pytree",
)


def filter_upstream_noise() -> None:
    """Install the filters above (idempotent: ``warnings.filterwarnings`` replaces a duplicate)."""
    warnings.filterwarnings("ignore", **_LEAFSPEC)
