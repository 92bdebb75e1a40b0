"""Fixed-shape batches (issue 38): padding rows add exactly nothing; the step's examples are the Poisson sample's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_dp.performance.fixed_batch import PaddedCollate, chunks, zeroed
from lightning_dp.grad_sample import make_engine


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _clip(engine_name, x, y, padding=0, C=0.5):
    model = _model()
    engine = make_engine(engine_name)
    engine.attach(model)
    engine.begin_step(len(x))
    F.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters()]
    engine.padding_rows = padding
    out = engine.clip_and_sum(params, C)
    engine.detach()
    return params, out


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
def test_padding_rows_add_nothing_whatever_they_hold(engine):
    """n = 5 examples, then 3 padding rows holding huge values: the sums of the n examples alone, their norms,
    their count. (The loss over 8 rows is the mean: n·∂mean = the per-example gradient, as for the n alone.)"""
    torch.manual_seed(1)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    pad_x, pad_y = 1e3 * torch.randn(3, 6), torch.randint(0, 3, (3,))
    params, alone = _clip(engine, x, y)
    padded_params, padded = _clip(engine, torch.cat([x, pad_x]), torch.cat([y, pad_y]), padding=3)
    assert padded.batch_size == 5 and padded.norms.shape == (5,)
    # the padded batch's mean loss has 8 rows: its per-example gradients are those of a batch of 8, i.e. the same
    torch.testing.assert_close(padded.norms, alone.norms, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, padded_params):  # the same initial weights (two copies of one model)
        torch.testing.assert_close(padded.sums[q], alone.sums[p], rtol=1e-5, atol=1e-6)


def test_an_all_padding_batch_sums_to_zero():
    params, out = _clip("ghost", torch.randn(4, 6), torch.randint(0, 3, (4,)), padding=4)
    assert out.batch_size == 0 and out.norms.numel() == 0
    assert all(torch.count_nonzero(out.sums[p]) == 0 for p in params)


@pytest.mark.parametrize("n,size", [(0, 4), (3, 4), (4, 4), (5, 4), (9, 4), (12, 4)])
def test_chunks_partition_the_sample_into_batches_of_exactly_f_rows(n, size):
    parts = chunks(list(range(n)), size)
    assert [i for part, _ in parts for i in part] == list(range(n))  # every example once, in order
    assert all(len(part) + pad == size for part, pad in parts)
    assert len(parts) == max(1, -(-n // size))


def test_padded_collate_pads_to_f_rows_of_zeroed_records_and_leaves_larger_batches():
    data = TensorDataset(torch.arange(1.0, 21.0).view(10, 2), torch.arange(10))
    collate = PaddedCollate(data, rows=4)
    x, y = collate([data[3], data[7]])
    assert x.shape == (4, 2) and torch.equal(x[:2], torch.stack([data[3][0], data[7][0]]))
    assert torch.count_nonzero(x[2:]) == 0 and torch.count_nonzero(y[2:]) == 0  # no record's data in the padding
    x, _ = collate([data[i] for i in range(6)])
    assert x.shape == (6, 2)  # more than F: split by the strategy
    x, _ = collate([])
    assert x.shape == (4, 2) and torch.count_nonzero(x) == 0


def test_zeroed_keeps_structure_and_types():
    record = {"x": torch.ones(2), "n": 3, "f": 1.5, "flag": True, "name": "a", "pair": (torch.ones(1), 7)}
    z = zeroed(record)
    assert torch.equal(z["x"], torch.zeros(2)) and z["n"] == 0 and z["f"] == 0.0 and z["flag"] is True
    assert z["name"] == "a" and torch.equal(z["pair"][0], torch.zeros(1)) and z["pair"][1] == 0
