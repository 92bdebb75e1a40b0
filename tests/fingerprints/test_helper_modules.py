"""The user's helper modules (fingerprints/helper_modules.py): a step writing the globals of a module the user's code
imports (``import helper; helper.MEMORY.append(x)``, or a function of it that appends to its own globals) is refused
as a global written from the batch; installed packages and the standard library are not the user's code."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import types

import pytest
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.fingerprints.helper_modules import MAX_HOPS, helper_modules, is_user_code
from lightning_dp.fingerprints.state_walker import user_modules

HELPER = """
import torch
MEMORY = []
TOTAL = torch.zeros(4)
def remember(x):
    MEMORY.append(x.detach().clone())
def accumulate(x):
    TOTAL.add_(x.mean(0))
"""

MODEL = """
import torch
import pytorch_lightning as pl
from torch import nn
import {helper} as helper
from {helper} import remember, accumulate

class Model(pl.LightningModule):
    def __init__(self, habit="none"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.habit = habit

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.habit == "append":
            helper.MEMORY.append(x.detach())
        elif self.habit == "function":
            remember(x)
        elif self.habit == "in_place":
            accumulate(x)
        elif self.habit == "read":
            _ = len(helper.MEMORY)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


@pytest.fixture
def project(tmp_path, request):
    """A user's project on disk: a helper module and a module defining the LightningModule, imported as a script
    would import them (their directory on sys.path); both removed after."""
    tag = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    names = {"helper": f"ldp_helper_{tag}", "model": f"ldp_model_{tag}"}
    (tmp_path / f"{names['helper']}.py").write_text(HELPER)
    (tmp_path / f"{names['model']}.py").write_text(textwrap.dedent(MODEL.format(helper=names["helper"])))
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        yield importlib.import_module(names["model"]), importlib.import_module(names["helper"])
    finally:
        sys.path.remove(str(tmp_path))
        for name in names.values():
            sys.modules.pop(name, None)


def _fit(model) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=3).fit(model, DataLoader(data, batch_size=16))


def test_a_helper_module_imported_by_the_users_module_is_read(project):
    model_module, helper = project
    modules = user_modules([model_module.Model])
    assert model_module in modules and helper in modules
    assert not any(m.__name__.split(".")[0] in ("torch", "pytorch_lightning", "lightning_dp", "json", "builtins")
                   for m in modules)


def test_installed_packages_and_the_standard_library_are_not_user_code(project):
    _, helper = project
    assert is_user_code(helper)
    assert not is_user_code(json) and not is_user_code(torch) and not is_user_code(sys)


@pytest.mark.parametrize("habit, name", [("append", "MEMORY"), ("function", "MEMORY"), ("in_place", "TOTAL")])
def test_a_helper_modules_global_written_from_the_batch_is_refused(project, habit, name):
    model_module, helper = project
    model = model_module.Model(habit)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=rf"global {helper.__name__}\.{name}"):
        _fit(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_helper_module_read_but_not_written_trains(project):
    model_module, helper = project
    model = model_module.Model("read")
    _fit(model)
    assert model.trainer.global_step == 3 and helper.MEMORY == []


def test_helpers_are_followed_a_bounded_number_of_imports_deep(tmp_path):
    """A chain of user modules, each importing the next: the first MAX_HOPS beyond the start are found."""
    names = [f"ldp_chain_{i}" for i in range(MAX_HOPS + 2)]
    for i, name in enumerate(names):
        body = f"import {names[i + 1]}\n" if i + 1 < len(names) else "STATE = []\n"
        (tmp_path / f"{name}.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        start = importlib.import_module(names[0])
        found = [m.__name__ for m in helper_modules([start])]
        assert found == names[1:MAX_HOPS + 1]
        assert isinstance(sys.modules[names[-1]], types.ModuleType)
    finally:
        sys.path.remove(str(tmp_path))
        for name in names:
            sys.modules.pop(name, None)
