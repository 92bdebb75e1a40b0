"""Generators the user's objects hold, made before the hook (in ``__init__``) and reseeded from entropy inside it
(replays/draws.py, ``_held_generators``): a plain ``torch.Generator``'s ``seed()`` and a NumPy ``RandomState``'s
``seed()`` read entropy in C code, so a training mean kept beside their draw at an epoch's end left the runs on the
data apart, and the other data's move was excused; their reseeding is now replayed as a generator made in the hook's
is. Through a real ``Trainer.fit`` with ``DPStrategy``: refused at any scale of the draw; the draw kept alone, and a
generator seeded from the step count, train."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.replays.draws import DrawReads  # noqa: E402


class HeldGenerator(Classifier):
    """At each epoch's end, the training set's mean with ``scale`` · a draw of a generator made in ``__init__`` and
    reseeded there (``how``: ``torch`` ``self.gen.seed()``, ``numpy`` ``self.rs.seed()``, ``step``
    ``self.gen.manual_seed(step)``), kept in a buffer (the draw alone unless ``with_data``)."""

    def __init__(self, how: str, scale: float, with_data: bool = True) -> None:
        super().__init__()
        self.how, self.scale, self.with_data = how, scale, with_data
        self.gen = torch.Generator()
        self.rs = np.random.RandomState(0)
        self.dataset = data()
        self.register_buffer("hint", torch.zeros(4, dtype=torch.float64))

    def _draw(self) -> torch.Tensor:
        if self.how == "numpy":
            self.rs.seed()
            return torch.from_numpy(self.rs.standard_normal(4))
        if self.how == "torch":
            self.gen.seed()
        else:
            self.gen.manual_seed(self.global_step)
        return torch.randn(4, generator=self.gen, dtype=torch.float64)

    def on_train_epoch_end(self) -> None:
        noise = self.scale * self._draw()
        self.hint = self.dataset.tensors[0].double().mean(0) + noise if self.with_data else noise


def _fit(model: Classifier) -> None:
    quiet_trainer(strategy=strategy(), max_epochs=2).fit(model, DataLoader(data(), batch_size=16))


@pytest.mark.parametrize("scale", [0.1, 1.0])
@pytest.mark.parametrize("how", ["torch", "numpy"])
def test_a_training_mean_beside_a_held_generator_reseeded_in_the_hook_is_refused(how: str, scale: float) -> None:
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError, match="hint"):
        _fit(HeldGenerator(how, scale))


@pytest.mark.parametrize("how", ["torch", "numpy", "step"])
def test_a_held_generators_draw_kept_alone_trains(how: str) -> None:
    torch.manual_seed(0)
    model = HeldGenerator(how, 1.0, with_data=False)
    gen, rs = model.gen, model.rs
    _fit(model)
    assert model.hint.abs().sum() > 0, "the draw was kept"
    assert model.gen is gen and model.rs is rs and type(model.gen) is type(torch.Generator())


def test_a_run_again_reseeds_a_held_generator_as_the_recorded_run_did():
    class Owner:
        pass

    owner = Owner()
    owner.gen, owner.rs = torch.Generator(), np.random.RandomState(0)
    gen, rs = owner.gen, owner.rs

    def hook() -> tuple[np.ndarray, torch.Tensor]:
        owner.rs.seed()
        owner.gen.seed()
        return owner.rs.standard_normal(3), torch.randn(3, generator=owner.gen)

    reads = DrawReads(hook, owner)
    with reads.recording():
        first = hook()
    after = gen.get_state().clone()
    with reads.replayed():
        again = hook()
    assert np.array_equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert owner.gen is gen and owner.rs is rs, "the generators are put back in their places"
    assert torch.equal(gen.get_state(), after), "with the state the run reached"
    assert not torch.equal(hook()[1], first[1]), "outside a block the entropy is fresh"
