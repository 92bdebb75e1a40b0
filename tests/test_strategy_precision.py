"""Trainer precisions the strategies support: ``64-true`` (the probe and the batch check convert the inputs with the
precision plugin as Lightning's loop does: float32 data into a float64 model) and ``bf16-mixed`` on every engine
(the vmap engine replays a layer under the autocast its call ran under)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent / "zoo"))
sys.path.insert(0, str(Path(__file__).parent / "privacy" / "boundary"))
import zoo  # noqa: E402
from cases import Classifier, data  # noqa: E402

from lightning_dp import DPStrategy  # noqa: E402

ENGINES = ["ghost", "vmap", "opacus_hooks"]


@pytest.mark.parametrize("engine", ENGINES)
def test_float64_training_on_float32_data_is_exact(engine):
    """One step, zero noise, q = 1: the update is −Σ_i clip_C(g_i)/B of the float64 per-example loop."""
    train = data(16)  # float32 features
    model = Classifier()
    reference = zoo.reference_update(copy.deepcopy(model).double(), zoo._as_double(train),
                                     torch.utils.data._utils.collate.default_collate, 0.3, 16.0)
    before = [p.detach().clone() for p in model.double().parameters()]
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.3, per_sample=engine, noise=zoo.ZeroNoise())
    quiet_trainer(strategy=strategy, max_steps=1, precision="64-true").fit(model, DataLoader(train, batch_size=16))
    for p, b, want in zip(model.parameters(), before, reference):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.detach() - b.to(p.device), want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_mixed_trains_on_every_engine(engine):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    model = Classifier()
    quiet_trainer(strategy=strategy, max_steps=3, precision="bf16-mixed").fit(
        model, DataLoader(data(64), batch_size=16))
    assert strategy.ledger.steps == 3 and strategy.engine_name == engine
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
