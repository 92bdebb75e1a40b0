"""A fetch is stateless (lightning_dp/records/stateless.py): warm-up statistics refused, caches and handles not."""

import os
import random
import tempfile

import numpy as np
import pytest
import torch
from conftest import at_freed_address
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.collate import EmptySafeCollate, loader_like
from lightning_dp.records.fetch import fetch, read_examples

X = torch.randn(64, 4) * 3 + 1
Y = (X[:, 0] > 1).long()
BATCHES = [list(range(i, i + 8)) for i in range(0, 64, 8)] * 2


def drain(dataset, collate_fn=None, workers=0, reads=(), hook=None, persistent=None):
    """Build the strategy's loader as private_step does and run every batch (``reads``: indices read before, as the
    checks read them; ``hook(epoch, batch)``: the user's code between passes (batch -1) and batches)."""
    dl = DataLoader(dataset, batch_size=8, collate_fn=collate_fn, num_workers=workers,
                    persistent_workers=workers > 0 if persistent is None else persistent)
    from lightning_dp.records.stateless import FetchState
    state = FetchState(dataset, collate_fn).noted()
    for i in reads:  # the checks before training read records too, through the library's read path
        fetch(dataset, [i])
    loader = loader_like(dl, BATCHES, EmptySafeCollate(dataset, collate_fn), state)
    try:
        for epoch in range(2):  # two passes (persistent workers)
            if hook is not None:
                hook(epoch, -1)
            for b, _ in enumerate(loader):
                if hook is not None:
                    hook(epoch, b)
    finally:  # workers shut down here: left to a later collection (a refusal's traceback holds the iterator), their
        if getattr(loader, "_iterator", None) is not None:  # pipes were closed during the next test's worker fork
            loader._iterator._shutdown_workers()  # (flaky "OSError: Bad file descriptor" in popen_fork)


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


@pytest.fixture(scope="module", autouse=True)
def _remove_the_lazy_file():
    """LazyFileDS writes PATH; leave nothing behind in the shared temporary directory."""
    yield
    if os.path.exists(PATH):
        os.remove(PATH)


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


# ------------------------------------------------- the user's own writes between fetches are not the fetches'
class EpochDS(Dataset):  # set_epoch from a callback (public: the epoch number), an augmentation strength from it
    def __init__(self):
        self.epoch, self.strength = 0, 0.0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i + 1000 * self.epoch)
        return X[i] + self.strength * torch.randn(4, generator=g), Y[i]


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True), (2, False)])
def test_set_epoch_between_passes_and_batches_trains(workers, persistent):
    ds = EpochDS()

    def hook(epoch, batch):
        ds.set_epoch(epoch + 1 if batch < 0 else epoch * 100 + batch)
        ds.strength = 0.1 * (epoch + 1)
    drain(ds, workers=workers, reads=range(0, 64, 5), hook=hook, persistent=persistent)


class SetEpoch(__import__("pytorch_lightning").Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        ds = trainer.train_dataloader.dataset
        ds.set_epoch(trainer.current_epoch)
        ds.strength = 0.05 * (1 + trainer.current_epoch)  # an augmentation strength from the epoch number


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True), (2, False)])
def test_a_callback_calling_set_epoch_at_epoch_start_trains(workers, persistent):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
    from cases import Classifier, strategy
    from conftest import quiet_trainer
    ds = EpochDS()
    dl = DataLoader(ds, batch_size=16, num_workers=workers, persistent_workers=persistent)
    quiet_trainer(strategy=strategy(), max_epochs=3, callbacks=[SetEpoch()]).fit(Classifier(), dl)
    assert ds.epoch == 2 and ds.strength == pytest.approx(0.15)


def test_a_warmup_completed_by_the_library_reads_after_a_hook_write_is_refused():
    ds = WarmupDS()
    with pytest.raises(PrivacyConfigurationError, match="dataset.stats|dataset.seen"):
        drain(ds, reads=range(16), hook=lambda e, b: setattr(ds, "epoch", e))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_warmup_completed_by_the_probes_reads_during_training_is_refused(workers):
    """A library read during training (the probe's examples, read_examples) is compared around itself."""
    ds = WarmupDS()
    dl = DataLoader(ds, batch_size=8, num_workers=workers, persistent_workers=workers > 0)
    from lightning_dp.records.stateless import FetchState
    loader = loader_like(dl, BATCHES[:1], EmptySafeCollate(ds), FetchState(ds, None).noted())
    with pytest.raises(PrivacyConfigurationError, match="dataset.stats|dataset.seen"):
        for _ in range(3):
            for _ in loader:
                read_examples(ds, EmptySafeCollate(ds), list(range(8)))


@pytest.mark.parametrize("workers", [0, 2])
def test_warmup_attacks_with_a_hook_writing_between_batches_are_refused(workers):
    def make_hook(ds):
        return lambda e, b: setattr(ds, "epoch", e * 100 + b)
    for make, collate in [(WarmupDS, None), (lambda: TensorDataset(X, Y), WarmupCollate())]:
        ds = make()
        hook = make_hook(ds) if isinstance(ds, WarmupDS) else None
        with pytest.raises(PrivacyConfigurationError, match="stateless|seen|stats|buf"):
            drain(ds, collate_fn=collate, workers=workers, hook=hook)
    if workers:
        ds = PerWorkerDS()
        with pytest.raises(PrivacyConfigurationError, match="stateless|seen|stats"):
            drain(ds, workers=workers, hook=make_hook(ds))


class LazyArraysDS(Dataset):
    """Arrays opened on the first read (``np.load(path, mmap_mode="r")``, or loaded whole): the files' contents, the
    same whichever record triggered the load."""

    def __init__(self, directory, mmap_mode):
        self.directory, self.mmap_mode, self._x, self._y = directory, mmap_mode, None, None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self._x is None:
            self._x = np.load(f"{self.directory}/x.npy", mmap_mode=self.mmap_mode)
            self._y = np.load(f"{self.directory}/y.npy", mmap_mode=self.mmap_mode)
        return torch.from_numpy(np.array(self._x[i])), int(self._y[i])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mmap_mode", ["r", None])
def test_arrays_loaded_on_the_first_read_train(tmp_path, workers, mmap_mode):
    np.save(tmp_path / "x.npy", X.numpy())
    np.save(tmp_path / "y.npy", Y.numpy())
    drain(LazyArraysDS(tmp_path, mmap_mode), workers=workers, reads=range(0, 64, 5))


class WarmupMeanDS(Dataset):
    """A mean of the first 16 records read, kept as one tensor set from None: not the same whichever record."""

    def __init__(self):
        self.seen, self.mean = [], None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.mean is None:
            self.seen.append(X[i])
            if len(self.seen) >= 16:
                self.mean = torch.stack(self.seen).mean(0)
            return X[i], Y[i]
        return X[i] - self.mean, Y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_statistic_set_from_none_is_not_taken_for_a_load(workers):
    with pytest.raises(Exception, match="Reading records writes state"):
        drain(WarmupMeanDS(), workers=workers)


class WorkerIdDS(Dataset):
    """The worker's id kept on the first read (to shard a stream by worker): the same whichever record."""

    def __init__(self):
        self.worker = None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.worker is None:
            info = get_worker_info()
            self.worker = -1 if info is None else info.id
        return X[i], Y[i]


class FirstLabelDS(WorkerIdDS):
    """The first record's label kept as an int set from None: not the same whichever record."""

    def __getitem__(self, i):
        if self.worker is None:
            self.worker = int(Y[i]) * 1000 + int(i)
        return X[i], Y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_value_set_on_the_first_read_trains_when_every_record_sets_it_alike(workers):
    drain(WorkerIdDS(), workers=workers)
    with pytest.raises(Exception, match="Reading records writes state"):
        drain(FirstLabelDS(), workers=workers)


class RunningMeanDS(Dataset):
    """A running mean of the records read, a new tensor at every read: its address alternates between two (CPython
    hands a freed object's memory to the next of its size), so after an even number of reads the tensor is at its
    baseline's address again, of the same shape."""

    def __init__(self):
        self.mean = torch.zeros(4)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.mean = self.mean * 0.9 + X[i] * 0.1
        return X[i] - self.mean, Y[i]


def test_a_running_mean_rebound_at_every_read_is_refused_whatever_its_address():
    """The digest holds what it compares by identity: a tensor at a freed one's address is not taken for it (four
    reads per comparison brought the mean back to its baseline's address, and every batch was let through)."""
    from lightning_dp.records.stateless import FetchState

    dataset = RunningMeanDS()
    state = FetchState(dataset, None).noted()
    with pytest.raises(PrivacyConfigurationError, match="dataset.mean"):
        for batch in range(4):
            for i in range(4 * batch, 4 * batch + 4):
                dataset[i]
            state.check()


def test_a_dict_at_a_freed_caches_address_holds_none_of_its_entries():
    """The entries a fetch added to an index-keyed cache (left out of the kept-state token) are told by the cache
    itself, not by its id: a dict a step writes later, at the address of a cache freed since, is judged whole."""
    from lightning_dp.records.stateless import FetchState, fetch_filled

    class CacheDS(Dataset):
        def __init__(self):
            self.cache = {}

        def __len__(self):
            return 64

        def __getitem__(self, i):
            self.cache.setdefault(i, int(Y[i]))  # small ints: one object per value, the same in any dict
            return X[i], Y[i]

    dataset = CacheDS()
    state = FetchState(dataset, None).noted()
    for i in range(4):
        dataset[i]
    state.check()
    filled = dict(dataset.cache)
    assert fetch_filled(dataset.cache) == filled
    freed = id(dataset.cache)
    dataset.cache = None  # the dataset drops its cache
    other, _ = at_freed_address(freed, dict, count=2000)  # else the digest (or the fix) holds the cache
    other.update(filled)  # a step's per-record state, alike by chance
    assert fetch_filled(other) == {}
