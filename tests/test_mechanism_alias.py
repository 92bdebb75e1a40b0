"""``lightning_dp.mechanism`` (the package the core left): every old module name gives the module at its new home
itself, the old package-level names load, and names that moved between modules are still readable by the old
module (lightning_dp/mechanism/__init__.py, docs/architecture.md "Moved modules")."""

from __future__ import annotations

import importlib
import pickle

import pytest

from lightning_dp.mechanism import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_module_name_is_the_new_module(old):
    module = importlib.import_module(f"lightning_dp.mechanism.{old}")
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]  # the real module's own spec, not the alias's


def test_old_submodules_of_moved_packages_and_package_names_resolve():
    import lightning_dp.mechanism.grad_sample.ghost as old_ghost
    import lightning_dp.grad_sample.ghost as ghost
    from lightning_dp.mechanism import GaussianNoise, PrivateOptimizer, make_engine
    from lightning_dp.privacy.noise import GaussianNoise as new_noise

    assert old_ghost is ghost and GaussianNoise is new_noise and callable(make_engine) and PrivateOptimizer
    noise = pickle.loads(pickle.dumps(GaussianNoise(seed=1)))
    assert type(noise) is new_noise


def test_names_that_moved_out_of_a_module_are_read_from_their_new_home():
    from lightning_dp.grad_sample.linear_rule import linear_stats
    from lightning_dp.mechanism.grad_sample.ghost import linear_stats as old
    from lightning_dp.mechanism.private_step import PROBE_EXAMPLES
    from lightning_dp.validators.probe import PROBE_EXAMPLES as probe_examples

    assert old is linear_stats and PROBE_EXAMPLES == probe_examples
    with pytest.raises(ImportError):
        from lightning_dp.mechanism.private_step import no_such_name  # noqa: F401


def test_an_unknown_old_name_is_not_invented():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_dp.mechanism.no_such_module")
