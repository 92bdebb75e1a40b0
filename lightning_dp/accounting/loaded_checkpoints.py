"""A module built by Lightning's ``load_from_checkpoint`` continues the ledger its checkpoint carries, in any process.

A private fit writes its ledger into every checkpoint under :data:`CHECKPOINT_KEY` (full checkpoints and
``save_weights_only`` ones alike). ``trainer.fit(..., ckpt_path=...)`` restores it through the strategy, and in the
process that trained the weights :mod:`~lightning_dp.accounting.module_ledgers` finds them by their digests. But
``Model.load_from_checkpoint(path)`` in a new process, then a private fit of the result, would start a fresh ledger:
the first fit's releases dropped from ε. So, once per Lightning namespace (``pytorch_lightning`` and the unified
``lightning.pytorch``, when each is imported with ``lightning_dp`` imported), Lightning's
``core.saving._load_state`` — the function ``LightningModule.load_from_checkpoint`` builds the module and loads
the checkpoint's weights with, given the checkpoint's dict — is wrapped (:func:`install`): the module it returns,
from a checkpoint that holds the entry, gets that ledger as its record (:func:`continue_ledger`), as the in-process
record would be: for the module object and each of its submodules, and for the digests of its trainable weights
(a ``copy.deepcopy`` or ``load_state_dict`` of them into another object finds it). A later private fit of the
module, or of a model built around it, continues that ledger (one log line), so ε and ``target_epsilon`` count both
fits. A checkpoint without the entry (not written by a private fit) changes nothing.

Which weights the releases made what they are is written beside the ledger (``"trained_weights"``, their names:
:func:`~lightning_dp.accounting.module_ledgers.trained_names`), so a public backbone the fit kept frozen, or a layer
it left as the seed built it, carries no record. A checkpoint written before the names were kept: every trainable
floating weight that is not constant (a fresh norm's ones, a zero bias are not) is taken as trained (conservative:
another module holding exactly the same values of a weight the fit left unchanged then continues the record too).

Not seen here: weights loaded without Lightning's loader (``torch.load(path)`` then ``model.load_state_dict(ckpt[
"state_dict"])`` in a new process: no file is known to the library), and a module loaded before ``lightning_dp`` was
first imported. On the machine that trained them the ledger store finds those weights when a private fit attaches
them (accounting/ledger_store.py: it holds every fit's lookup material, and this loader writes the checkpoint's
record there too); elsewhere, or with the store off, ``trainer.fit(model, ckpt_path=path)`` restores the ledger, or
load with ``Model.load_from_checkpoint(path)`` after ``import lightning_dp``. Lightning versions whose
``_load_state`` is missing or takes other arguments are left as they are (the loaded module starts a fresh record,
as before, but for the store).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Mapping

from torch import nn

from lightning_dp.accounting import module_ledgers
from lightning_dp.accounting.ledger import PrivacyLedger

CHECKPOINT_KEY = "lightning_dp"
"""Where the private step's state lives in a Lightning checkpoint dict (its ``"ledger"`` among it), full or
weights-only."""

_WRAPPED = "__lightning_dp_continues_ledger__"


def continue_ledger(module: nn.Module, checkpoint: Mapping[str, Any]) -> bool:
    """Give ``module`` (just loaded from ``checkpoint``) the ledger the checkpoint's :data:`CHECKPOINT_KEY` entry
    holds as its record (module docstring). Returns whether it had one with releases."""
    state = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, Mapping) else None
    if not isinstance(module, nn.Module) or not isinstance(state, Mapping) or not isinstance(state.get("ledger"),
                                                                                             Mapping):
        return False
    ledger = PrivacyLedger()
    ledger.load_state_dict(state["ledger"])
    if not ledger.steps:
        return False
    trained = state.get("trained_weights")
    module_ledgers.carry(module, ledger, list(trained) if isinstance(trained, (list, tuple)) else None)
    return True


def install(namespace: str) -> bool:
    """Wrap ``<namespace>.core.saving._load_state`` once (module docstring). Returns whether it is wrapped now;
    ``False`` when this Lightning version has no such function of the expected arguments (left as it is)."""
    try:
        saving = importlib.import_module(f"{namespace}.core.saving")
    except ImportError:
        return False
    original = getattr(saving, "_load_state", None)
    if getattr(original, _WRAPPED, False):
        return True
    if not callable(original) or list(inspect.signature(original).parameters)[:2] != ["cls", "checkpoint"]:
        return False
    saving._load_state = _wrapped(original)
    return True


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _load_state(cls: type, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        loaded = original(cls, checkpoint, *args, **kwargs)
        continue_ledger(loaded, checkpoint)
        return loaded

    setattr(_load_state, _WRAPPED, True)
    return _load_state
