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

import contextlib
import logging
import warnings
from typing import Iterator

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


#: Lightning 2.6 logs two product adverts at every fit ("💡 Tip: For seamless cloud logging ... try
#: installing litlogger" and "... litmodels"): informational lines about optional cloud services,
#: not about the run. ``lightning-dp`` (our console, the main job) drops them; a user's own
#: Trainer, outside the CLI, keeps Lightning's output untouched.
_ADVERT_PREFIX = "💡 Tip:"
_ADVERT_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")


class _LightningAdverts(logging.Filter):
    """Drops Lightning's "💡 Tip:" log lines (see above); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_ADVERT_PREFIX)


def quiet_lightning_adverts() -> None:
    """Install :class:`_LightningAdverts` on Lightning's rank-zero loggers (idempotent)."""
    for name in _ADVERT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LightningAdverts) for f in logger.filters):
            logger.addFilter(_LightningAdverts())


def said(message: str) -> None:
    """``message`` as one INFO line on Lightning's rank-zero console, where the strategy's other lines go (a logger of
    lightning_dp's own has no handler: its INFO lines were never shown — newcomer30)."""
    from pytorch_lightning.utilities.rank_zero import rank_zero_info

    rank_zero_info(message)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's, Fabric's and lightning_dp's info logging at ERROR for the duration (sweeps that
    print one line per run); the levels are restored on exit, so a caller's own logging is left as it was."""
    names = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric", "lightning_dp")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


#: torch's notice when a full backward hook fires on a module none of whose inputs requires grad (torch/utils/hooks.py)
OUTPUT_HOOK_NOTICE = "Full backward hook is firing when gradients are computed with respect to module outputs"


@contextlib.contextmanager
def output_hook_notice_quieted(engine: str) -> Iterator[None]:
    """A backward through engine ``engine``'s hooks, without torch's notice :data:`OUTPUT_HOOK_NOTICE`.

    Opacus' hooks (``opacus_hooks``) are full backward hooks on every layer with parameters; on the first layer,
    whose input is the data (which requires no gradient), torch calls them with the output gradient only and says
    so, once per backward's call site. That gradient is all Opacus' rules use: the notice describes the intended
    case, not a mistake of the user's. Only this message, only around a backward that the strategy or the probe
    runs itself, only for that engine; every other warning is left alone."""
    if engine != "opacus_hooks":  # the engine whose full backward hooks torch notices (grad_sample/opacus_hooks.py)
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OUTPUT_HOOK_NOTICE, category=UserWarning)
        yield
