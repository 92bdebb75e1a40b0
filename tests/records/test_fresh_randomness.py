"""Randomness starts each step, and each record's fetch, afresh (lightning_dp/records/fresh_randomness.py).

Neighbouring datasets D and D' differ in one record that the sampler draws at step 0 and not at step 1; the learning
rate is 0 at step 0 and σ is tiny, so the weights after step 1 may differ by the noise only. Code that draws a
data-dependent number of random values (a batch-end hook showing a few misclassified examples, a crop retried until it
fits the record) would otherwise shift the dropout masks and augmentation of step 1 (red-team zoo13 rng1, rng2)."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.records.fresh_randomness import FreshIndices, FreshRandomness

torch.set_num_threads(1)

N, B, SIGMA = 64, 16, 1e-6


def _data(d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, d, generator=g)
    return x, (x[:, 0] > 0).long()


class _Rows(pl.Callback):
    """The rows of x each real step trained on."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].detach().clone())


def _optimizers(module: nn.Module):
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s == 0 else 1.0)  # step 0 moves nothing
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


class _ShowsErrors(pl.LightningModule):
    """Dropout in the model; at each batch's end a few misclassified examples are picked to show:
    ``torch.randperm(n_wrong)`` (or NumPy's) draws as many numbers as the batch has errors."""

    def __init__(self, numpy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.numpy = numpy
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.numpy:  # augmentation from NumPy's global generator
            x = x + 0.3 * torch.from_numpy(np.random.randn(*x.shape).astype("float32"))
        logits = self(x)
        return {"loss": F.cross_entropy(logits, y), "wrong": (logits.argmax(1) != y).detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        n_wrong = int(outputs["wrong"].sum())
        shown = np.random.permutation(n_wrong)[:4] if self.numpy else torch.randperm(n_wrong)[:4]
        assert len(shown) <= 4  # shown in the logs by a user; nothing kept

    def configure_optimizers(self):
        return _optimizers(self)


class _RetriedCrop(Dataset):
    """A RandomResizedCrop-style retry loop: the number of draws depends on the record (its feature 3)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        s = 1.0
        for _ in range(10):
            s = torch.rand(1).item() * 2.0
            if s * x[3].abs().item() < 1.0:
                break
        return x[:3] * (0.9 + 0.1 * min(s, 1.0)), self.y[i]


class _Dropout3(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return _optimizers(self)


def _fit(module: pl.LightningModule, dataset: Dataset, steps: int = 2, seed: int = 123) -> tuple[torch.Tensor, _Rows]:
    pl.seed_everything(seed, verbose=False)
    rows = _Rows()
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=SIGMA, max_grad_norm=1.0, sampler_seed=0,
                                                    public_state=["_Rows.batches"]),
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_steps=steps, callbacks=[rows])
    trainer.fit(module, DataLoader(dataset, batch_size=B))
    return torch.cat([p.detach().flatten() for p in module.parameters()]), rows


def _in(rows: torch.Tensor, record: torch.Tensor) -> bool:
    return bool((rows == record).all(1).any())


def _only_at_step_0(rows: _Rows, record: torch.Tensor) -> None:
    assert len(rows.batches) == 2 and _in(rows.batches[0], record) and not _in(rows.batches[1], record)


def test_a_data_dependent_draw_count_at_a_batch_end_does_not_reach_the_next_step():
    x, y = _data()
    y2 = y.clone()
    y2[12] = 1 - y[12]  # record 12: drawn at step 0, not at step 1 (sampler_seed=0)
    w, rows = _fit(_ShowsErrors(), TensorDataset(x, y))
    w2, rows2 = _fit(_ShowsErrors(), TensorDataset(x, y2))
    _only_at_step_0(rows, x[12])
    _only_at_step_0(rows2, x[12])
    assert (w - w2).norm() < 1e-4  # the noise alone (~1e-6); 0.22 when the hook's draws shift step 1's masks


def test_a_data_dependent_numpy_draw_count_does_not_reach_the_next_step():
    x, y = _data()
    y2 = y.clone()
    y2[12] = 1 - y[12]
    w, _ = _fit(_ShowsErrors(numpy=True), TensorDataset(x, y))
    w2, _ = _fit(_ShowsErrors(numpy=True), TensorDataset(x, y2))
    assert (w - w2).norm() < 1e-4  # 0.10 without the reseed


def test_a_fetch_that_draws_as_often_as_its_record_needs_does_not_shift_other_records_or_steps():
    x, y = _data()
    x2 = x.clone()
    x2[12, 3] = 100.0  # its "aspect": the crop is retried 10 times (once in D)
    w, rows = _fit(_Dropout3(), _RetriedCrop(x, y))
    w2, _ = _fit(_Dropout3(), _RetriedCrop(x2, y))
    assert len(rows.batches) == 2
    assert (w - w2).norm() < 1e-4  # 0.25 without the reseed


def test_runs_seeded_alike_are_reproducible_and_the_seed_still_matters():
    x, y = _data()
    w, _ = _fit(_ShowsErrors(), TensorDataset(x, y), steps=3, seed=7)
    again, _ = _fit(_ShowsErrors(), TensorDataset(x, y), steps=3, seed=7)
    other, _ = _fit(_ShowsErrors(), TensorDataset(x, y), steps=3, seed=8)
    assert (w - again).norm() < 1e-4
    assert (w - other).norm() > 1e-2  # other dropout masks: the base seed follows pl.seed_everything


# ------------------------------------------------------------------ a plain loop: PrivateStep.begin()
def _plain(labels: torch.Tensor, x: torch.Tensor, workers: int = 0, late: bool = False):
    """Two steps of a plain loop; after each, a few errors are picked to show (``late``: as the next batch arrives,
    after its fetch and before ``begin()``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = PrivateStep(SIGMA, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    try:
        step.attach(model, opt)
        torch.manual_seed(123)
        loader = step.poisson_loader(DataLoader(TensorDataset(x, labels), batch_size=B, num_workers=workers))
        step.verify(lambda b: F.cross_entropy(model(b[0]), b[1]))
        seen, n_wrong = [], 0
        for k, (xb, yb) in enumerate(loader):
            if k >= 2:
                break
            seen.append(xb)
            if late:
                torch.randperm(n_wrong)
            step.begin()
            logits = model(xb)
            F.cross_entropy(logits, yb).backward()
            step.release(optimizer=opt)
            if k > 0:  # lr 0 at step 0
                opt.step()
            opt.zero_grad()
            n_wrong = int((logits.argmax(1) != yb).sum())
            if not late:
                torch.randperm(n_wrong)  # a few errors to show: a data-dependent count of draws
        return torch.cat([p.detach().flatten() for p in model.parameters()]), seen
    finally:
        step.detach()


@pytest.mark.parametrize("workers, late", [(0, False), (1, False), (0, True)])
def test_a_plain_loops_data_dependent_draw_count_does_not_reach_the_next_step(workers, late):
    x, y = _data()
    _, seen = _plain(y, x)
    record = next(i for i in range(N) if _in(seen[0], x[i]) and not _in(seen[1], x[i]))
    y2 = y.clone()
    y2[record] = 1 - y[record]
    w, _ = _plain(y, x, workers, late)
    w2, _ = _plain(y2, x, workers, late)
    assert (w - w2).norm() < 1e-4


# ------------------------------------------------------------------ the pieces
def test_a_batch_of_indices_reseeds_before_each_record_and_survives_pickling():
    fresh = FreshRandomness()
    fresh.start()
    batch = fresh.batch([5, 9, 2])
    assert isinstance(batch, FreshIndices) and list(batch) == [5, 9, 2]
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is FreshIndices and again.seed == batch.seed and list(again) == [5, 9, 2]

    def draws(indices, extra):  # record at position 0 draws `extra` more numbers than the others
        out = []
        for j, _ in enumerate(indices):
            if j == 0:
                torch.rand(extra)
                np.random.rand(extra)
                [random.random() for _ in range(extra)]
            out.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
        return out

    a, b = draws(batch, 1), draws(batch, 7)
    assert a[1:] == b[1:] and a[0] != b[0]  # later records do not see how much the first one drew
    assert fresh.batch([5, 9, 2]).seed != batch.seed  # the next fetch: other numbers


def test_a_step_reseeds_once_per_index():
    fresh = FreshRandomness()
    fresh.step(0)  # no base yet (no private loader built): nothing happens
    fresh.start()
    fresh.step(3)
    first = torch.rand(2)
    fresh.step(3)  # a second physical batch of step 3: the stream goes on
    assert not torch.equal(torch.rand(2), first)
    fresh.step(4)
    fourth = torch.rand(2)
    fresh._last_step = None
    fresh.step(4)
    assert torch.equal(torch.rand(2), fourth)


class _IndexedCrop(_RetriedCrop):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y, i


def _fetched(x: torch.Tensor, y: torch.Tensor, batches: int = 3) -> dict[int, torch.Tensor]:
    """Each record's augmented row, as the private loader fetched it in its first ``batches`` batches."""
    step = PrivateStep(SIGMA, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    try:
        step.attach(nn.Linear(3, 2), None)
        torch.manual_seed(123)
        rows: dict[int, torch.Tensor] = {}
        for k, (xb, _, ib) in enumerate(step.poisson_loader(DataLoader(_IndexedCrop(x, y), batch_size=B))):
            if k >= batches:
                break
            rows.update({int(i): row for i, row in zip(ib, xb)})
        return rows
    finally:
        step.detach()


def test_a_records_draw_count_does_not_shift_the_augmentation_of_the_records_fetched_after_it():
    x, y = _data()
    x2 = x.clone()
    x2[12, 3] = 100.0  # its crop is retried 10 times (once in D)
    rows, rows2 = _fetched(x, y), _fetched(x2, y)
    assert 12 in rows and rows.keys() == rows2.keys() and len(rows) > 20
    assert all(torch.equal(rows[i], rows2[i]) for i in rows if i != 12)


def test_only_a_plain_tensor_dataset_is_read_without_a_seeding_per_record():
    """A TensorDataset (or a Subset of one) is pure indexing: seeded once per batch. Any other dataset, a subclass of
    TensorDataset included (its __getitem__ may draw), is seeded before each record."""
    from torch.utils.data import Subset

    from lightning_dp.records.fresh_randomness import FreshIndices, FreshRandomness, reads_draw

    plain = TensorDataset(torch.zeros(4, 2))

    class Augmented(TensorDataset):
        def __getitem__(self, i):
            return (super().__getitem__(i)[0] + torch.randn(2),)

    assert not reads_draw(plain) and not reads_draw(Subset(Subset(plain, [0, 1]), [0]))
    assert reads_draw(Augmented(torch.zeros(4, 2))) and reads_draw(_RetriedCrop(torch.zeros(4, 4), torch.zeros(4)))
    fresh = FreshRandomness()
    fresh.start()
    assert type(fresh.batch([0, 1], per_record=False)) is list and isinstance(fresh.batch([0, 1]), FreshIndices)
