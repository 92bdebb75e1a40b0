"""The arrays of the user's state given other values for a judged logger hook's run again, and the user's
generators replayed (validators/held_values.py)."""

from __future__ import annotations

import types

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.validators.held_values import derived_from_released, numbers_held, other_values, user_generators


class Model(nn.Module):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.norms = x.norm(dim=1)  # derived from the data
        self.view = x[:8]  # a view of the training data: exchanged with it, not flipped twice
        self.register_buffer("scale", x.std(0))


def _trainer(x: torch.Tensor) -> types.SimpleNamespace:
    model = Model(x)
    datamodule = types.SimpleNamespace(x_std=(x - x.mean(0)) / x.std(0))
    strategy = types.SimpleNamespace(private_step=None)
    return types.SimpleNamespace(lightning_module=model, datamodule=datamodule, callbacks=[], strategy=strategy,
                                 stash=np.asarray(x) * 2.0, val_dataloaders=DataLoader(TensorDataset(x.double())),
                                 test_dataloaders=None)


def test_every_array_but_the_released_state_and_the_exchanged_data_gets_other_values_then_its_own():
    x = torch.randn(32, 4)
    trainer = _trainer(x)
    model = trainer.lightning_module
    held = [model.norms, model.scale, trainer.datamodule.x_std, torch.as_tensor(trainer.stash),
            trainer.val_dataloaders.dataset.tensors[0]]
    kept = [model.layer.weight, x, model.view]
    before = [t.clone() for t in held + kept]
    versions = [t._version for t in held]
    others = other_values(trainer, None, [], exchanged=[x], released=list(model.parameters()))
    with others.exchanged():
        assert all(not torch.equal(t, b) for t, b in zip(held, before))
        assert all(torch.equal(t, b) for t, b in zip(kept, before[len(held):]))
    assert all(torch.equal(t, b) for t, b in zip(held + kept, before))
    assert [t._version for t in held] == versions  # written through .data: no version counter moves
    derived_from_released([model.norms])  # reproduced by a judged hook's run again: left from now on
    with other_values(trainer, None, [], exchanged=[x], released=[]).exchanged():
        assert torch.equal(model.norms, before[0])


def test_the_generators_the_module_holds_are_set_back():
    model = nn.Linear(2, 2)
    model.gen = torch.Generator().manual_seed(1)
    model.rngs = [np.random.default_rng(0)]
    put_back = user_generators([model])
    first = torch.randn(3, generator=model.gen), model.rngs[0].standard_normal(3)
    put_back()
    assert torch.equal(torch.randn(3, generator=model.gen), first[0])
    assert np.array_equal(model.rngs[0].standard_normal(3), first[1])


def test_the_python_values_of_the_model_datamodule_and_datasets_not_of_the_trainer_or_the_optimizer():
    x = torch.randn(32, 4)
    trainer = _trainer(x)
    trainer.lightning_module.stat, trainer.lightning_module.lr, trainer.lightning_module.steps = float(x.norm()), 0.1, 3
    trainer.datamodule.n_positive = int((x[:, 0] > 0).sum())
    trainer.noted = 2.5  # on the trainer: Lightning's settings, not walked
    trainer.optimizers = [torch.optim.SGD(trainer.lightning_module.parameters(), lr=0.1)]
    trainer.global_step = 3
    found = numbers_held(trainer, None, public=["declared"])
    assert sorted(found.names) == ["datamodule.n_positive", "stat"]  # lr: the group's; steps: the trainer's step
