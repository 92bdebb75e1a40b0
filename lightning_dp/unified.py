"""The same strategy and callbacks for the unified ``lightning`` package (``import lightning as L``).

``pytorch_lightning`` and ``lightning.pytorch`` are two class hierarchies: ``L.Trainer`` refuses a
``pytorch_lightning`` Strategy and ``pl.Trainer`` an ``L.LightningModule``. A user of the unified
package imports from here instead of from ``lightning_dp``::

    import lightning as L
    from lightning_dp.unified import DPStrategy, PrivacyBudget, AdamVariant, SecondMomentMonitor, PublicPretraining
    # and DPShardedStrategy for models sharded by FSDP2

    trainer = L.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=5)

The classes are built from the same source files as :mod:`lightning_dp.strategy` and
:mod:`lightning_dp.callbacks`, executed once more with ``pytorch_lightning``/``lightning_fabric``
resolved to ``lightning.pytorch``/``lightning.fabric`` (and with each other: this module's
``AdamVariant`` recognises this module's ``DPStrategy``). Nothing is copied; everything outside
those files (the mechanism, accounting, optimizers) is shared. The ``lightning-dp`` command line
runs on ``pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import lightning_dp.callbacks  # noqa: F401  (the pytorch_lightning build: loads every module we re-run)
import lightning_dp.sharded_strategy  # noqa: F401
import lightning_dp.strategy  # noqa: F401

_NAMESPACES = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}
_GLUE = (  # the files that import Lightning, in dependency order (package last)
    "lightning_dp._strategy_glue",
    "lightning_dp.strategy",
    "lightning_dp.sharded_strategy",
    "lightning_dp.callbacks.adam_variant",
    "lightning_dp.callbacks.privacy_budget",
    "lightning_dp.callbacks.public_pretraining",
    "lightning_dp.callbacks.second_moment_monitor",
    "lightning_dp.callbacks",
)
_PREFIX = "lightning_dp._unified"


def _counterpart(name: str) -> str:
    for old, new in _NAMESPACES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    raise KeyError(name)


@contextmanager
def _resolving_to_unified(copies: dict[str, ModuleType]) -> Iterator[None]:
    """While the glue files run again: ``pytorch_lightning.*`` → ``lightning.pytorch.*`` (every
    submodule the first run loaded), ``lightning_fabric.*`` → ``lightning.fabric.*``, and the glue
    modules to their new copies."""
    names = [n for n in list(sys.modules) if n.split(".")[0] in _NAMESPACES]
    saved = {n: sys.modules[n] for n in names + list(copies)}
    try:
        for n in names:
            try:
                sys.modules[n] = importlib.import_module(_counterpart(n))
            except ImportError:
                del sys.modules[n]  # no counterpart (e.g. __about__): the glue files do not import it
        sys.modules.update(copies)
        yield
    finally:
        sys.modules.update(saved)


def _build() -> dict[str, ModuleType]:
    copies: dict[str, ModuleType] = {}
    for name in _GLUE:
        original = sys.modules[name]
        spec = importlib.util.spec_from_file_location(f"{_PREFIX}.{name.split('.', 1)[1]}", original.__file__,
                                                      submodule_search_locations=getattr(original, "__path__", None))
        assert spec is not None and spec.loader is not None
        copies[name] = importlib.util.module_from_spec(spec)
    for name, module in list(sys.modules.items()):  # the packages' Lightning-free submodules are shared
        parent, _, short = name.rpartition(".")
        if parent in copies and name not in copies:
            setattr(copies[parent], short, module)
    with _resolving_to_unified(copies):
        for name in _GLUE:
            spec = copies[name].__spec__
            sys.modules[spec.name] = copies[name]  # kept: pickling (DDP spawn) finds the classes by this name
            spec.loader.exec_module(copies[name])
    return copies


importlib.import_module("lightning.pytorch")  # fails clearly if the unified package is not installed
_copies = _build()
DPStrategy = _copies["lightning_dp.strategy"].DPStrategy
DPShardedStrategy = _copies["lightning_dp.sharded_strategy"].DPShardedStrategy
PrivacyBudget = _copies["lightning_dp.callbacks"].PrivacyBudget
AdamVariant = _copies["lightning_dp.callbacks"].AdamVariant
PublicPretraining = _copies["lightning_dp.callbacks"].PublicPretraining
SecondMomentMonitor = _copies["lightning_dp.callbacks"].SecondMomentMonitor

__all__ = ["AdamVariant", "DPShardedStrategy", "DPStrategy", "PrivacyBudget", "PublicPretraining",
           "SecondMomentMonitor"]
