"""A fetch is stateless (lightning_dp/records/stateless.py): warm-up statistics refused, caches and handles not."""

import os
import random
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.collate import EmptySafeCollate, loader_like

X = torch.randn(64, 4) * 3 + 1
Y = (X[:, 0] > 1).long()
BATCHES = [list(range(i, i + 8)) for i in range(0, 64, 8)] * 2


def drain(dataset, collate_fn=None, workers=0, reads=()):
    """Build the strategy's loader as private_step does and run every batch (``reads``: indices read before)."""
    dl = DataLoader(dataset, batch_size=8, collate_fn=collate_fn, num_workers=workers,
                    persistent_workers=workers > 0)
    from lightning_dp.records.stateless import FetchState
    state = FetchState(dataset, collate_fn).noted()
    for i in reads:  # the checks before training read records too
        dataset[i]
    loader = loader_like(dl, BATCHES, EmptySafeCollate(dataset, collate_fn), state)
    for _ in range(2):  # two passes (persistent workers)
        for _ in loader:
            pass


class WarmupDS(Dataset):  # stats from the first 16 records read, then frozen
    def __init__(self):
        self.seen, self.stats = [], None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        r = X[i]
        if self.stats is None:
            self.seen.append(r)
            if len(self.seen) >= 16:
                s = torch.stack(self.seen)
                self.stats, self.seen = (s.mean(0), s.std(0)), []
            return r / 3, Y[i]
        return (r - self.stats[0]) / self.stats[1], Y[i]


class PerWorkerDS(WarmupDS):  # the same only inside a DataLoader worker
    def __getitem__(self, i):
        if get_worker_info() is None:
            return X[i] / 3, Y[i]
        return super().__getitem__(i)


class WarmupCollate:  # normaliser estimated on the first 2 batches
    def __init__(self):
        self.buf, self.stats = [], None

    def __call__(self, batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        if self.stats is None:
            self.buf.append(x)
            if len(self.buf) >= 2:
                a = torch.cat(self.buf)
                self.stats, self.buf = (a.mean(0), a.std(0)), []
            return x / 3, y
        return (x - self.stats[0]) / self.stats[1], y


class StatsInCacheDS(Dataset):  # an index-keyed cache abused: entry 0 holds a statistic of the records read
    def __init__(self):
        self.cache = {}

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i not in self.cache:
            self.cache[i] = X[i].clone()
        if i != 0:
            self.cache[0] = self.cache.get(0, X[0]) * 0.5 + X[i] * 0.5
        return self.cache[i] - self.cache.get(0, X[0]), Y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_warmup_statistics_in_the_dataset_are_refused(workers):
    with pytest.raises(PrivacyConfigurationError, match="stateless|seen|stats"):
        drain(WarmupDS(), workers=workers)


def test_warmup_filled_by_the_checks_reads_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="dataset.stats|dataset.seen"):
        drain(WarmupDS(), reads=range(16))


@pytest.mark.parametrize("workers", [0, 2])
def test_warmup_statistics_in_a_collate_object_are_refused(workers):
    with pytest.raises(PrivacyConfigurationError, match="collate_fn.buf|collate_fn.stats|stateless"):
        drain(TensorDataset(X, Y), collate_fn=WarmupCollate(), workers=workers)


def test_statistics_kept_only_inside_workers_are_refused():
    drain(PerWorkerDS(), workers=0)  # the main process sees a fixed scale
    with pytest.raises(PrivacyConfigurationError, match="stateless|seen|stats"):
        drain(PerWorkerDS(), workers=2)


def test_a_statistic_hidden_in_an_index_keyed_cache_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="cache"):
        drain(StatsInCacheDS())


# ----------------------------------------------------------------------------------------- false positives
class DecodeCacheDS(Dataset):
    def __init__(self):
        self.cache = {}

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i not in self.cache:
            self.cache[i] = (X[i] * 2).clone()  # "decoded" once
        return self.cache[i] + 0.01 * torch.randn(4), Y[i]  # random augmentation on top


PATH = os.path.join(tempfile.gettempdir(), f"lightning_dp_stateless_{os.getpid()}.bin")


class LazyFileDS(Dataset):  # a handle opened on first fetch (per process)
    def __init__(self):
        with open(PATH, "wb") as f:
            f.write(X.numpy().tobytes())
        self.handle = None
        self.text = None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.handle is None:
            self.handle = open(PATH, "rb")
            self.text = open(PATH, "r", errors="ignore")
        self.handle.seek(i * 16)
        return torch.frombuffer(bytearray(self.handle.read(16)), dtype=torch.float32), Y[i]


class AugmentDS(Dataset):  # per-record random transforms, from a generator it holds and the global ones
    def __init__(self):
        self.rng = random.Random(0)
        self.gen = torch.Generator().manual_seed(0)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        noise = torch.randn(4, generator=self.gen) * self.rng.gauss(0, 1) + torch.rand(4)
        return X[i] + noise, Y[i]


class Stateless:  # a collate object with configuration only
    def __init__(self):
        self.scale = 3.0

    def __call__(self, batch):
        return torch.stack([b[0] for b in batch]) / self.scale, torch.stack([b[1] for b in batch])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make", [lambda: TensorDataset(X, Y), lambda: [(X[i], Y[i]) for i in range(64)],
                                  DecodeCacheDS, LazyFileDS, AugmentDS],
                         ids=["tensors", "list", "decode-cache", "lazy-file", "augment"])
def test_stateless_datasets_train(make, workers):
    drain(make(), workers=workers, reads=range(0, 64, 5))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_object_with_configuration_only_trains(workers):
    drain(TensorDataset(X, Y), collate_fn=Stateless(), workers=workers)


def test_digits_dataset_trains():
    from lightning_dp.data.digits import DigitsDataModule
    dm = DigitsDataModule()
    dm.setup("fit")
    dl = dm.train_dataloader()
    ds = dl.dataset
    BATCH = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    loader = loader_like(DataLoader(ds, batch_size=8, collate_fn=dl.collate_fn), BATCH,
                         EmptySafeCollate(ds, dl.collate_fn))
    for _ in loader:
        pass
