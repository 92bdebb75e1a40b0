"""A fetch's write judged by fetching again (lightning_dp/records/fetch_reruns.py): state every fetch writes alike
whatever the records (a count of calls, a cache keyed by a shape all records share, the last random draw's
parameters) trains; state that is a function of the records (a count of the records of a label, a running mean, a
copy of the last record, a size cache over records of different sizes) is refused as before."""

import collections

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.collate import EmptySafeCollate, loader_like
from lightning_dp.records.fetch import fetch
from lightning_dp.records.fetch_reruns import Kept, alike, fetch_written, frozen, other_indices, reached
from lightning_dp.records.stateless import FetchState
from lightning_dp.record_checks.outside_records import records_exchanged

G = torch.Generator().manual_seed(0)
X = torch.rand(64, 1, 4, 4, generator=G)
Y = torch.randint(0, 2, (64,), generator=G)
BATCHES = [list(range(i, i + 8)) for i in range(0, 64, 8)] * 2


def drain(dataset, collate_fn=None, workers=0, exchange=records_exchanged, reads=(0, 5)):
    """The strategy's loader built as private_step builds it (the fetch state with the exchange), every batch run
    twice over, after the checks' reads of ``reads``."""
    dl = DataLoader(dataset, batch_size=8, collate_fn=collate_fn, num_workers=workers,
                    persistent_workers=workers > 0)
    state = FetchState(dataset, dl.collate_fn, exchange).noted()
    for i in reads:
        fetch(dataset, [i])
    loader = loader_like(dl, BATCHES, EmptySafeCollate(dataset, dl.collate_fn), state)
    try:
        for _ in range(2):
            for _ in loader:
                pass
    finally:
        if getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()


class Transformed(Dataset):
    def __init__(self, transform, x=X):
        self.x, self.y, self.transform = x, Y, transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


# ------------------------------------------------------------------------------ alike whatever the records: trains
class CountsCalls:
    """torchvision-like RandomApply keeping debugging counters: calls, and how many draws applied noise."""

    def __init__(self):
        self.calls, self.applied = 0, 0

    def __call__(self, x):
        self.calls += 1
        if torch.rand(()) < 0.5:
            self.applied += 1
            return x + 0.05 * torch.randn_like(x)
        return x


class CachesSize:
    """Caches the last input size and a grid built for it (every record has the same size)."""

    def __init__(self):
        self.last_size, self.grid = None, None

    def __call__(self, x):
        if x.shape != self.last_size:
            self.last_size, self.grid = x.shape, torch.linspace(0, 1, x.shape[-1])
        return x * self.grid


class KeepsParams:
    """albumentations-like: the parameters of its last random draw kept on the transform (replay information)."""

    def __init__(self):
        self.params = {}

    def __call__(self, x):
        if torch.rand(()) < 0.5:
            self.params = {"shift": float(torch.randn(()) * 0.05), "scale": float(1 + torch.randn(()) * 0.05)}
            return x * self.params["scale"] + self.params["shift"]
        return x


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make", [CountsCalls, CachesSize, KeepsParams])
def test_state_every_fetch_writes_alike_trains(make, workers):
    dataset = Transformed(Compose([make(), make()]))
    drain(dataset, workers=workers)
    if workers == 0 and make is CountsCalls:
        assert dataset.transform.transforms[0].calls == 2 + 2 * 128  # the reruns' reads were put back


def test_without_the_exchange_the_other_records_still_judge():
    drain(Transformed(CountsCalls()), exchange=None)
    with pytest.raises(PrivacyConfigurationError, match="transform.mean"):
        drain(Transformed(RunningMean()), exchange=None)


# ------------------------------------------------------------------------------ a function of the records: refused
class CountsOnes(Dataset):
    """Counts the records whose label is 1 (a predicate of the values) — with a counter of calls beside it."""

    def __init__(self):
        self.calls, self.ones = 0, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.calls += 1
        self.ones += int(Y[i] == 1)
        return X[i], Y[i]


class RunningMean:
    """A running mean of the pixels, subtracted from every later record."""

    def __init__(self):
        self.mean = torch.zeros(())

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean()
        return x - self.mean


class KeepsLast:
    """The last record kept (a view of the training tensor, not a copy) and mixed into the next."""

    def __init__(self):
        self.last = None

    def __call__(self, x):
        out = x if self.last is None else 0.5 * (x + self.last)
        self.last = x
        return out


class SnapshotsAtRandom:
    """A copy of a record kept at a random draw (one read in eight): the reruns draw as the fetch drew."""

    def __init__(self):
        self.calls, self.snap = 0, None

    def __call__(self, x):
        self.calls += 1
        if torch.rand(()) < 0.125:
            self.snap = x.clone()
        return x


@pytest.mark.parametrize("workers", [0, 2])
def test_a_copy_kept_at_a_random_draw_is_refused(workers):
    with pytest.raises(PrivacyConfigurationError, match="transform.snap"):
        drain(Transformed(SnapshotsAtRandom()), workers=workers)


READS = [0]  # a module's global the main process's digest does not walk, nor the reruns put back


class SnapshotsOnce(SnapshotsAtRandom):
    """A copy of the second record read, as the count of a global says: the reruns, which do not put the global
    back, do not repeat the fetch's write — so it cannot be judged."""

    def __call__(self, x):
        self.calls += 1
        READS[0] += 1
        if READS[0] == 2:
            self.snap = x.clone()
        return x


def test_a_write_the_reruns_do_not_repeat_is_refused():
    READS[0] = 0
    with pytest.raises(PrivacyConfigurationError, match="transform.snap"):
        drain(Transformed(SnapshotsOnce()), reads=())


def test_a_count_of_the_records_of_a_label_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="dataset.ones") as refused:
        drain(CountsOnes())
    assert "dataset.calls" not in str(refused.value)  # the counter of calls beside it is not named


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make, path", [(RunningMean, "transform.mean"), (KeepsLast, "transform.last")])
def test_a_statistic_or_a_copy_of_the_records_is_refused(make, path, workers):
    with pytest.raises(PrivacyConfigurationError, match=path):
        drain(Transformed(make()), workers=workers)


def test_a_size_cache_over_records_of_different_sizes_is_refused():
    """The exchange keeps every record's shape; the other records' sizes differ: the cache is the records'."""
    sizes = [torch.rand(1, 2 + i % 3, 4, generator=G) for i in range(64)]
    with pytest.raises(PrivacyConfigurationError, match="transform.last_size|transform.grid"):
        drain(Transformed(CachesSize(), x=sizes), collate_fn=list)
    drain(Transformed(CachesSize(), x=[s[:, :2] for s in sizes]), collate_fn=list)  # one size: trains


def test_the_library_reads_are_judged_too():
    """A running mean the checks' reads alone would set is refused at their read, the counter beside it is not."""
    dataset = Transformed(RunningMean())
    state = FetchState(dataset, None, records_exchanged).noted()  # noqa: F841 — watched while it lives
    with pytest.raises(PrivacyConfigurationError, match="transform.mean"):
        fetch(dataset, [3, 4])
    counted = Transformed(CountsCalls())
    state = FetchState(counted, None, records_exchanged).noted()  # noqa: F841
    fetch(counted, [3, 4])
    assert counted.transform.calls == 2


# ------------------------------------------------------------------------------ the pieces
def test_kept_state_is_put_back_in_place():
    holder = CountsCalls()
    items, table = [1, 2], {"a": 1}
    holder.items, holder.table = items, table
    kept = Kept({"h": holder, "h.items": items, "h.table": table})
    holder.calls, holder.new = 5, 1
    items.append(3)
    table["b"] = 2
    kept.restore()
    assert vars(holder) == {"calls": 0, "applied": 0, "items": [1, 2], "table": {"a": 1}}
    assert holder.items is items and holder.table is table
    seen = []
    holder.transform = lambda x: seen.append(x)  # a closure's list, and a bound method's object, reached too
    holder.method = CountsCalls().__call__
    deep = reached([holder])
    items.append(9)
    holder.transform(1)
    holder.method(torch.zeros(1))
    deep.restore()
    assert items == [1, 2] and seen == [] and holder.method.__self__.calls == 0


def test_a_counter_and_an_ordered_dict_are_put_back_as_they_were():
    """newcomer30: a vocabulary Counter was put back as counts of its (word, count) pairs, so an untouched global
    read as written (and held other values after the fit)."""
    counts, ordered = collections.Counter(alpha=5, beta=2), collections.OrderedDict(b=1, a=2)
    kept = Kept({"counts": counts, "ordered": ordered})
    counts["gamma"] += 1
    ordered.move_to_end("b")
    kept.restore()
    assert counts == collections.Counter(alpha=5, beta=2) and list(counts.items()) == [("alpha", 5), ("beta", 2)]
    assert list(ordered.items()) == [("b", 1), ("a", 2)]


def test_frozen_values_compare_by_value_and_copy_tensors():
    t = torch.ones(3)
    before = frozen({"t": t, "n": [1, 2.0]})
    t.add_(1)
    assert not alike(before, frozen({"t": t, "n": [1, 2.0]}))
    assert alike(frozen({"t": torch.ones(3), "n": [1, 2.0]}), before)
    assert alike(frozen(float("nan")), frozen(float("nan")))
    assert other_indices([0, 1, 63], 64) == [32, 33, 31]


def test_the_fingerprint_leaves_only_the_values_the_fetch_wrote():
    dataset = Transformed(CountsCalls())
    state = FetchState(dataset, None, records_exchanged).noted()  # noqa: F841
    fetch(dataset, [1])
    transform = dataset.transform
    assert fetch_written(transform, "calls", 1)
    assert not fetch_written(transform, "calls", 7)  # another value (a hook's) is the fingerprint's to judge
    assert not fetch_written(transform, "other", 1)


# ------------------------------------------------------------------------------ under the strategy
class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dataset, callbacks=()):
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    quiet_trainer(strategy=dp, max_steps=4, callbacks=list(callbacks)).fit(
        Classifier(), DataLoader(dataset, batch_size=16))
    return dp


@pytest.mark.parametrize("make", [CountsCalls, CachesSize, KeepsParams])
def test_transforms_keeping_harmless_state_train_under_the_strategy(make):
    assert _fit(Transformed(Compose([make(), make()]))).ledger.steps == 4


class SetsCallsFromTheLoss(pl.Callback):
    """A hook that writes the transform's counter from the batch's loss: not the fetch's write."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.train_dataloader.dataset.transform.calls = int(outputs["loss"].item() * 1e6)


def test_a_hook_writing_the_counter_from_the_loss_is_still_refused():
    with pytest.raises(PrivacyConfigurationError, match="calls"):
        _fit(Transformed(CountsCalls()), [SetsCallsFromTheLoss()])


class CountsOnesLater(CountsCalls):
    """Counts the records whose pixels sum above 8 beside its calls (to use the count later: the records stay fixed
    meanwhile, so the records check passes)."""

    def __init__(self):
        super().__init__()
        self.ones = 0

    def __call__(self, x):
        self.ones += int(x.sum() > 8)
        return super().__call__(x)


def test_a_count_of_the_records_is_refused_under_the_strategy():
    with pytest.raises(PrivacyConfigurationError, match="Reading records writes state.*transform.ones"):
        _fit(Transformed(CountsOnesLater()))
