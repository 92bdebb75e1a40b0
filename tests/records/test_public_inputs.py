"""The input rows stepped on inside public_steps(), kept with the parameters stepped (records/public_inputs.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp  # noqa: F401  (installs the step hook once torch.optim is imported)
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_statistics.public_overlap import check_public_steps
from lightning_dp.records import public_inputs
from lightning_dp.records.outside_steps import public_steps
from lightning_dp.records.public_inputs import SAMPLE_ROWS, public_rows


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _train(model: nn.Module, dataset: TensorDataset, epochs: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for x, y in DataLoader(dataset, batch_size=16):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def test_the_outermost_inputs_are_sampled_and_kept_with_the_stepped_parameters():
    model, other = _model(), _model()
    private = _data(400, seed=1)
    with public_steps():
        _train(model, private)
        with torch.no_grad():
            other(torch.randn(5, 6))  # a forward without gradients: not a training input
    rows = public_rows(model.parameters())
    assert len(rows) == SAMPLE_ROWS and all(r.shape == (6,) for r in rows)  # the Linear's input, not the Tanh's
    train_rows = {tuple(r.tolist()) for r in private.tensors[0]}
    assert all(tuple(r.tolist()) in train_rows for r in rows)
    assert public_rows(other.parameters()) == []
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)inside lightning_dp.public_steps\(\) are rows of the "
                                                        r"training set.*Pass public data"):
        check_public_steps(model.parameters(), private)


def test_public_data_and_steps_outside_the_block_are_not_refused():
    model = _model()
    private = _data(400, seed=1)
    with public_steps():
        _train(model, _data(400, seed=2))  # other draws of the same task: public
    check_public_steps(model.parameters(), private)
    fresh = _model()
    _train(fresh, private)  # outside the block: counted by outside_steps.py, not sampled here
    assert public_rows(fresh.parameters()) == []
    check_public_steps(fresh.parameters(), private)


def test_the_hooks_live_only_inside_the_block_and_the_sample_goes_with_the_parameters():
    from torch.nn.modules import module as torch_module

    before = len(torch_module._global_forward_pre_hooks)
    model = _model()
    with public_steps():
        with public_steps():  # nested: one block
            assert len(torch_module._global_forward_pre_hooks) == before + 1
            _train(model, _data(40, seed=3), epochs=1)
    assert len(torch_module._global_forward_pre_hooks) == before
    keys = {id(p) for p in model.parameters()}
    assert keys <= set(public_inputs._LINKED)
    del model
    gc.collect()
    assert not keys & set(public_inputs._LINKED)
