"""A deprecated alias: the module names of ``lightning_dp.mechanism``, which the privacy core and the
per-example machinery left for their own packages (docs/architecture.md, "Moved modules").

``from lightning_dp.mechanism import GaussianNoise`` and ``import lightning_dp.mechanism.private_step`` keep
working: importing this package puts a finder on ``sys.meta_path`` that answers each old module name with the
module at its new home — the same module object, so classes, ``isinstance`` checks and pickled checkpoints
agree. This is the one place the alias lives; new code imports the new homes. The finder changes nothing else
and is never removed (removing it would break modules imported by their old names).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional

from lightning_dp._lazy import lazy_exports

#: old module (under ``lightning_dp.mechanism``) -> new module; a package maps its submodules along.
MOVED = {
    "private_step": "lightning_dp.privacy.private_step",
    "noise": "lightning_dp.privacy.noise",
    "csprng": "lightning_dp.privacy.csprng",
    "banded_noise": "lightning_dp.privacy.banded_noise",
    "sampling": "lightning_dp.privacy.sampling",
    "min_sep_sampling": "lightning_dp.privacy.min_sep_sampling",
    "seeding": "lightning_dp.secure_random",
    "release": "lightning_dp.privacy.release",
    "privatizer": "lightning_dp.privacy.privatizer",
    "sharded_privatizer": "lightning_dp.sharding.privatizer",
    "sign_privatizer": "lightning_dp.sign_sgd.privatizer",
    "sign_vote": "lightning_dp.sign_sgd.vote",
    "budget_shortfall": "lightning_dp.accounting.budget_shortfall",
    "noise_prefetch": "lightning_dp.performance.noise_prefetch",
    "fixed_batch": "lightning_dp.performance.fixed_batch",
    "boundary.state": "lightning_dp.validators.kept_state",
    "boundary.snapshot": "lightning_dp.validators.snapshot",
    "boundary.coverage": "lightning_dp.validators.optimizer_coverage",
    "boundary": "lightning_dp.privacy.boundary",
    "banded_coefficients": "lightning_dp.accounting.banded_coefficients",
    "grad_sample.ghost_recurrent": "lightning_dp.grad_sample.recurrent_rule",
    "grad_sample": "lightning_dp.grad_sample",
    "capture": "lightning_dp.grad_sample.capture.activations",
    "broadcast_sites": "lightning_dp.grad_sample.capture.broadcast_sites",
    "example_dims": "lightning_dp.grad_sample.capture.example_dims",
    "engine_hooks": "lightning_dp.grad_sample.capture.engine_hooks",
    "attention_nodes": "lightning_dp.grad_sample.capture.attention_nodes",
    "recurrent_tape": "lightning_dp.grad_sample.capture.recurrent_tape",
    "root_parameters": "lightning_dp.grad_sample.capture.root_parameters",
    "fsdp_layout": "lightning_dp.sharding.fsdp_layout",
    "validators": "lightning_dp.validators",
    "collate": "lightning_dp.records.collate",
    "fetch": "lightning_dp.records.fetch",
    "distinct_records": "lightning_dp.records.distinct_records",
    "record_fingerprint": "lightning_dp.records.record_fingerprint",
    "recorded_batches": "lightning_dp.records.recorded_batches",
    "clipping": "lightning_dp.clipping",
    "units.user_sampler": "lightning_dp.privacy.user_sampling",
    "units": "lightning_dp.units",
    "diagnostics": "lightning_dp.diagnostics",
}


def new_name(old: str) -> Optional[str]:
    """The new home of module ``old`` (a full ``lightning_dp.mechanism.…`` name), or None."""
    rest = old[len(__name__) + 1:] if old.startswith(__name__ + ".") else None
    if not rest:
        return None
    for prefix in sorted(MOVED, key=len, reverse=True):
        if rest == prefix or rest.startswith(prefix + "."):
            return MOVED[prefix] + rest[len(prefix):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the new module itself (registered under both names)."""

    def __init__(self) -> None:
        self._specs: dict[str, Optional[ModuleSpec]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[ModuleSpec]:
        new = new_name(fullname)
        found = importlib.util.find_spec(new) if new is not None else None
        if found is None:
            return None
        return ModuleSpec(fullname, self, is_package=found.submodule_search_locations is not None)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(new_name(spec.name))  # type: ignore[arg-type]
        self._specs[spec.name] = module.__spec__  # the import system sets __spec__ to the alias's next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new home already: only its own ``__spec__`` is put back."""
        for old, real in list(self._specs.items()):
            if real is not None and real.name == module.__name__:
                module.__spec__ = self._specs.pop(old)


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

__getattr__ = lazy_exports(__name__, {
    "ClippedBatch": "lightning_dp.engine_api", "GradSampleEngine": "lightning_dp.engine_api",
    "available_engines": "lightning_dp.engine_api", "make_engine": "lightning_dp.engine_api",
    "register_engine": "lightning_dp.engine_api",
    "GaussianNoise": "lightning_dp.privacy.noise", "NoiseMechanism": "lightning_dp.privacy.noise",
    "Privatizer": "lightning_dp.privacy.privatizer", "flat_all_reduce": "lightning_dp.release_reduce",
    "validate_privacy_params": "lightning_dp.privacy.privatizer",
    "DEFAULT_REQUEST": "lightning_dp.privacy.release", "MechanismRequest": "lightning_dp.privacy.release",
    "PrivateOptimizer": "lightning_dp.privacy.release", "Release": "lightning_dp.privacy.release",
    "PoissonBatchSampler": "lightning_dp.privacy.sampling", "secure_seed": "lightning_dp.privacy.sampling",
    "steps_per_epoch_for": "lightning_dp.privacy.sampling",
    "EmptySafeCollate": "lightning_dp.records.collate", "batch_size_of": "lightning_dp.records.collate",
    "validate_module": "lightning_dp.validators",
})
