"""The unseeded draws the replays of the user's hooks read (replays/draws.py, wired where the clocks are replayed): a
training-set statistic kept with an unseeded draw added (zoo32 e01/e02: ``x_train.mean(0) + 0.01 ·
np.random.default_rng().normal(size=d)`` at an epoch's end) is refused at any scale of the draw, through a real
``Trainer.fit`` with ``DPStrategy``; the same draw kept alone trains; the mechanism's noise stays fresh at every
step and is never read from a recording."""

from __future__ import annotations

import os
import random
import secrets
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

Draw = Callable[[int], torch.Tensor]
"""d → d float64 values from a source nobody seeds."""


def _torch_generator(d: int) -> torch.Tensor:
    g = torch.Generator()
    g.seed()
    return torch.randn(d, generator=g, dtype=torch.float64)


DRAWS: dict[str, Draw] = {
    "numpy default_rng": lambda d: torch.from_numpy(np.random.default_rng().normal(size=d)),
    "numpy PCG64": lambda d: torch.from_numpy(np.random.Generator(np.random.PCG64()).normal(size=d)),
    "torch.Generator().seed()": _torch_generator,
    "random.Random()": lambda d: torch.tensor([random.Random().gauss(0, 1) for _ in range(d)], dtype=torch.float64),
    "SystemRandom": lambda d: torch.tensor([random.SystemRandom().gauss(0, 1) for _ in range(d)],
                                           dtype=torch.float64),
    "secrets": lambda d: torch.tensor([secrets.randbelow(2**20) / 2**19 - 1 for _ in range(d)], dtype=torch.float64),
    "os.urandom": lambda d: torch.frombuffer(bytearray(os.urandom(8 * d)), dtype=torch.int64).double() / 2**63,
}
"""Sources of entropy a hook may draw from without a seed."""


class EpochHint(Classifier):
    """zoo32 e02: at each epoch's end, the training set's mean with ``scale`` · a draw added, kept in a buffer
    (``scale`` 0 with ``data=False``: the draw alone)."""

    def __init__(self, draw: Draw, scale: float, data: bool = True) -> None:
        super().__init__()
        self.draw, self.scale, self.with_data = draw, scale, data
        self.dataset = data_set = globals()["data"]()  # (the training set the epoch hook reads; exchanged in replays)
        self.register_buffer("hint", torch.zeros(data_set.tensors[0].shape[1], dtype=torch.float64))

    def on_train_epoch_end(self) -> None:
        x = self.dataset.tensors[0].double()
        noise = self.scale * self.draw(x.shape[1])
        self.hint = x.mean(0) + noise if self.with_data else noise


class BatchEndJitter(Classifier):
    """A judged write at a batch's end: ``scale`` · an unseeded draw kept in a buffer, with the batch's mean added
    when ``data``."""

    def __init__(self, draw: Draw, scale: float, data: bool = True) -> None:
        super().__init__()
        self.draw, self.scale, self.with_data = draw, scale, data
        self.register_buffer("jitter", torch.zeros(4, dtype=torch.float64))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        noise = self.scale * self.draw(4)
        with torch.no_grad():
            self.jitter.copy_(batch[0].double().mean(0) + noise if self.with_data else noise)


def _fit(model: Classifier, epochs: int = 2) -> None:
    quiet_trainer(strategy=strategy(), max_epochs=epochs).fit(model, DataLoader(data(), batch_size=16))


@pytest.mark.parametrize("scale", [1e-9, 0.01, 1.0, 10.0])
def test_a_training_mean_with_an_unseeded_draw_added_at_an_epochs_end_is_refused(scale: float) -> None:
    """zoo32 e01/e02 at every scale: the runs on the data read the same draw, so they agree, and the other data's
    run sets the mean apart."""
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError):
        _fit(EpochHint(DRAWS["numpy default_rng"], scale))


@pytest.mark.parametrize("source", sorted(DRAWS))
def test_every_source_of_entropy_beside_the_data_is_refused(source: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError):
        _fit(EpochHint(DRAWS[source], 0.01))


@pytest.mark.parametrize("source", ["numpy default_rng", "torch.Generator().seed()", "os.urandom"])
def test_an_unseeded_draw_kept_alone_at_an_epochs_end_trains(source: str) -> None:
    """The safe twin: the draw without the data (an exploration noise kept in state) is written alike in every run."""
    torch.manual_seed(0)
    model = EpochHint(DRAWS[source], 1.0, data=False)
    _fit(model)
    assert model.hint.abs().sum() > 0, "the draw was kept"


@pytest.mark.parametrize("scale", [1e-9, 10.0])
def test_a_batch_mean_with_an_unseeded_draw_added_at_a_batch_end_is_refused(scale: float) -> None:
    torch.manual_seed(0)
    model = BatchEndJitter(DRAWS["numpy default_rng"], scale)
    with pytest.raises(PrivacyConfigurationError):
        _fit(model, epochs=1)
    assert not model.jitter.abs().sum(), "nothing of the batch stayed in memory"


def test_jitter_kept_alone_at_a_batch_end_trains() -> None:
    """A judged write of a draw alone (dropout-like jitter kept in state) is reproduced exactly by the runs again:
    accepted, and the next batches draw afresh."""
    torch.manual_seed(0)
    seen: list[torch.Tensor] = []

    class Watched(BatchEndJitter):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(outputs, batch, batch_idx)
            seen.append(self.jitter.clone())

    model = Watched(DRAWS["numpy default_rng"], 1.0, data=False)
    _fit(model, epochs=1)
    assert len(seen) >= 4 and not torch.equal(seen[0], seen[-1]), "each batch drew afresh"


def test_the_mechanisms_noise_is_fresh_at_every_step_and_never_replayed() -> None:
    """The noise the mechanism adds differs from step to step (from the same weights and batch, two steps' updates
    differ), and a replay block open on this thread does not serve the library's own reads of the OS's entropy."""
    from lightning_dp.replays.draws import DrawReads
    from lightning_dp.secure_random import secure_seed, secure_uniform

    reads = DrawReads()
    with reads.recording():
        mine, library = os.urandom(8), secure_seed()
        uniforms = secure_uniform(4)
    with reads.replayed():
        assert os.urandom(8) == mine  # the user's read: replayed
        assert secure_seed() != library and not torch.equal(secure_uniform(4), uniforms)  # the library's: fresh
    assert list(reads.values) == ["os.urandom"] and len(reads.values["os.urandom"]) == 1, "only the user's read kept"

    torch.manual_seed(0)
    model = NoiseOnly(DRAWS["numpy default_rng"], 1.0, data=False)  # (a hook replayed with draws at each epoch)
    weights = {0: torch.cat([p.detach().flatten() for p in model.parameters()])}  # step → the weights after it

    class Weights(pl.Callback):  # (its hook is replayed too: kept by step, the weights put back after a replay)
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            weights[trainer.global_step] = torch.cat([p.detach().flatten() for p in module.parameters()])

    quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=[Weights()]).fit(
        model, DataLoader(data(), batch_size=16))
    kept = [weights[k] for k in sorted(weights)]
    steps = [b - a for a, b in zip(kept, kept[1:])]  # each step: the noise alone (no gradient)
    assert len(steps) >= 6 and all(s.abs().sum() > 0 for s in steps)
    assert len({tuple(s.tolist()) for s in steps}) == len(steps), "the noise differs at every step"


class NoiseOnly(EpochHint):
    """A loss with no gradient: every update is the mechanism's noise alone."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self(batch[0]) * 0.0).sum()
