"""Records outside the step's batch (record_checks/outside_records.py): the exchange is exact and leaves no version
mark; the training data's copies are found where users keep them (and nothing else is taken for one); a step whose
gradients read other training records — from the dataset's tensors, a copy on the model, the datamodule or a global,
behind a warm-up — is refused before any release, and ordinary steps that merely hold the data are not."""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.data import DistinctRecords  # noqa: E402
from lightning_dp.record_checks.outside_records import (  # noqa: E402
    ExchangedRecords,
    exchange,
    exchangeable,
    training_copies,
)

# ---------------------------------------------------------------------------- the exchange


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_a_tensor_is_exchanged_everywhere_and_restored_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(50, 3, generator=g) * 5).to(dtype) if dtype.is_floating_point or dtype == torch.bool \
        else torch.randint(0, 200, (50, 3), generator=g).to(dtype)
    t[0, 0] = 0
    before, version = t.clone(), t._version
    restore = exchange(t)
    changed = t != before if dtype.is_floating_point else t.ne(before)
    assert bool(changed.all()), "every element takes another value (zero included)"
    if dtype.is_floating_point:  # every magnitude moves; the signs by a secret coin per element (some, not all)
        assert bool((t.abs() != before.abs()).all()), "every magnitude moves"
        flipped = (t.float() * before.float() < 0)[before != 0]
        assert bool(flipped.any()) and not bool(flipped.all()), "signs flipped by a coin per element"
    restore()
    assert torch.equal(t.view(torch.uint8) if dtype != torch.bool else t, before.view(torch.uint8)
                       if dtype != torch.bool else before)
    assert t._version == version  # the release boundary reads the training tensors' version counters


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint8", "bool"])
def test_a_numpy_array_is_exchanged_and_restored(dtype: str) -> None:
    a = (np.random.default_rng(0).normal(size=(20, 4)) * 50).astype(dtype)
    before = a.copy()
    restore = exchange(a)
    assert (a != before).all()
    restore()
    assert a.tobytes() == before.tobytes()


def test_lists_of_records_are_replaced_and_restored() -> None:
    labels, texts = [0, 1, 1, 3], ["a b", "c", "dd"]
    for records in (labels, texts):
        before = list(records)
        restore = exchange(records)
        assert all(x != y for x, y in zip(records, before))
        restore()
        assert records == before


def test_a_lists_restore_keeps_what_a_hook_did_with_it_meanwhile() -> None:
    """An epoch hook run again on exchanged data shuffles a dataset's order with an epoch-seeded RNG and appends the
    epoch to a log: the restore gives each exchanged item back where the hook moved it, and keeps the hook's own
    values, so that run ends as the run on the data does (qa9 e2: the whole list put back undid the shuffle)."""
    import random

    for order, log in (([0, 1, 2, 3, 4, 5], [0]), (["a", "b", "c"], ["x"]), ([0.5, 1.5, 2.5], [1.0])):
        plain_order, plain_log = list(order), list(log)
        random.Random(3).shuffle(plain_order)
        plain_log.append(7)
        restores = [exchange(order), exchange(log)]
        assert order != plain_order
        random.Random(3).shuffle(order)
        log.append(7)
        for restore in reversed(restores):
            restore()
        assert order == plain_order and log == plain_log
        assert all(type(v) in (int, str, float) for v in order + log)


def test_the_exchange_is_undone_when_the_pass_fails() -> None:
    t = torch.randn(8, 2)
    before = t.clone()
    with pytest.raises(RuntimeError, match="boom"):
        with ExchangedRecords([("x", t)]).exchanged():
            assert not torch.equal(t, before)
            raise RuntimeError("boom")
    assert torch.equal(t, before)


def test_memory_others_may_be_reading_is_never_written(tmp_path: Path) -> None:
    shared = torch.randn(4, 2).share_memory_()  # a DataLoader worker may read it concurrently
    path = tmp_path / "x.npy"
    np.save(path, np.ones((4, 2), np.float32))
    mapped = np.load(path, mmap_mode="r+")  # written back to the file
    frozen = np.ones((4, 2))
    frozen.flags.writeable = False
    assert not any(exchangeable(v) for v in (shared, mapped, frozen, torch.zeros(0), [object()]))
    assert all(exchangeable(v) for v in (torch.randn(4, 2), np.ones((4, 2)), [1, 2], ["a"]))


# ---------------------------------------------------------------------------- what is exchanged


class Holder:
    pass


def test_copies_are_found_where_users_keep_them_and_nothing_else() -> None:
    ds = data(64)
    x, y = ds.tensors
    model = nn.Linear(4, 2)
    model.register_buffer("anchors", x[:16].clone())  # rows of the data, released with the model
    model.register_buffer("queue", torch.zeros(16, 4))  # an empty queue: constant rows say nothing
    # same row shape, other values (a generator of its own: the global one may be seeded as data() seeds its rows)
    model.unrelated = torch.randn(32, 4, generator=torch.Generator().manual_seed(1234))
    model.alias = x  # the dataset's own memory: exchanged with it, not listed twice
    dm = Holder()
    dm.x_train = x.double().numpy().copy()  # a float64 NumPy original of the float32 tensor
    dm.y_train = y.numpy().copy()
    dm.y_other = (1 - y).numpy()
    globals_ = types.ModuleType("user_code")
    globals_.REFERENCE = x[10:40].numpy().copy()
    found = dict(training_copies(ds, [("model", model), ("DataModule", dm), ("user_code", globals_)]))
    names = sorted(found)
    assert "the training data.tensors[0]" in names and "the training data.tensors[1]" in names
    assert "the model's buffer anchors" in names
    assert "DataModule.x_train" in names and "DataModule.y_train" in names
    assert "the global user_code.REFERENCE" in names
    for absent in ("queue", "unrelated", "alias", "y_other"):
        assert not any(absent in n for n in names), absent


# ---------------------------------------------------------------------------- steps that read other records

DATASET = data(64)
X, Y = DATASET.tensors
REFERENCE = X.numpy().copy()  # a global copy of the training features, as a notebook keeps them


class NeighbourTargets(Classifier):
    """Soft targets from the three nearest training records (a kNN smoothing over the dataset's tensors)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        xs, ys = self.trainer.train_dataloader.dataset.tensors
        soft = F.one_hot(ys[torch.cdist(x, xs).topk(3, largest=False).indices], 2).float().mean(1)
        return -(soft * F.log_softmax(self(x), 1)).sum(1).mean()


class GlobalReference(Classifier):
    """Weights each example by its distance to the second nearest record of a global copy."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        w = torch.cdist(x, torch.from_numpy(REFERENCE)).topk(2, largest=False).values[:, 1].detach()
        return (w * F.cross_entropy(self(x), y, reduction="none")).mean()


class AfterWarmup(Classifier):
    """Centres the batch on the training set's mean, from step 3 on."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step >= 3:
            x = x - self.trainer.train_dataloader.dataset.tensors[0].mean(0)
        return F.cross_entropy(self(x), y)


class Copies(pl.LightningDataModule):
    """Keeps the float64 NumPy originals and builds float32 tensors from them (other memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.x_train, self.y_train = X.double().numpy().copy(), Y.numpy().copy()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.tensor(self.x_train, dtype=torch.float32),
                                        torch.from_numpy(self.y_train.copy())), batch_size=16)


class OtherClassMargin(Classifier):
    """A margin from the nearest training record of another class, read from the datamodule's copy."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        dm = self.trainer.datamodule
        ref, ref_y = torch.from_numpy(dm.x_train).float(), torch.from_numpy(dm.y_train)
        w = (torch.cdist(x, ref) + 1e6 * (y[:, None] == ref_y[None]).float()).min(1).values.detach()
        return (w * F.cross_entropy(self(x), y, reduction="none")).mean()


class NoisyMean(Classifier):
    """Draws random numbers of its own (the replacement test's path) and subtracts the training set's mean."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + 0.1 * torch.randn_like(x) - self.trainer.train_dataloader.dataset.tensors[0].mean(0)
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("model", [NeighbourTargets, GlobalReference, AfterWarmup, NoisyMean])
def test_a_step_reading_other_training_records_is_refused_before_any_release(model: type) -> None:
    m = model()
    before = parameters(m)
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="outside its sampled batch"):
        quiet_trainer(strategy=dp, max_steps=6).fit(m, DataLoader(DATASET, batch_size=16))
    assert unchanged(before, m)
    assert dp.ledger.steps == 0


def test_a_copy_in_the_datamodule_read_by_the_step_is_refused() -> None:
    m = OtherClassMargin()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match="outside its sampled batch.*x_train"):
        quiet_trainer(strategy=strategy(), max_steps=4).fit(m, datamodule=Copies())
    assert unchanged(before, m)


class ReportsOnTheData(Classifier):
    """Holds the training tensor (for a training-set accuracy at epoch end) and an empty queue buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.full = X
        self.register_buffer("queue", torch.zeros(16, 4))

    def on_train_epoch_end(self) -> None:
        with torch.no_grad():
            self.accuracy = float((self(self.full).argmax(1) == Y).float().mean())


def test_holding_the_data_without_reading_it_in_the_step_trains() -> None:
    m = ReportsOnTheData()
    dp = strategy(public_state=["accuracy"])
    quiet_trainer(strategy=dp, max_steps=8).fit(m, DataLoader(DATASET, batch_size=16))
    assert dp.ledger.steps == 8 and 0.0 <= m.accuracy <= 1.0
    quiet_trainer(strategy=strategy(), max_steps=4).fit(Classifier(), datamodule=Copies())


# ---------------------------------------------------------------------------- records in the model's weights


class Prototypes(Classifier):
    """An RBF-style layer whose centres are initialised from training examples."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.centres = nn.Parameter(init.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + 0.0 * torch.cdist(x, self.centres).sum(1, keepdim=True)


@pytest.mark.parametrize("where", ["parameter", "buffer", "labels"])
def test_training_records_in_the_models_weights_are_refused_before_any_release(where: str) -> None:
    if where == "parameter":
        m = Prototypes(X[10:18])
    else:
        m = Classifier()
        m.register_buffer("kept", X[:8].clone() if where == "buffer" else Y.clone())
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="holds records of the training"):
        quiet_trainer(strategy=dp, max_steps=2).fit(m, DataLoader(DATASET, batch_size=16))
    assert dp.ledger.steps == 0


def test_weights_like_rows_many_records_share_are_not_records() -> None:
    """One-hot features: an identity-initialised weight has rows every record of a category has (nobody's)."""
    g = torch.Generator().manual_seed(1)
    category = torch.randint(0, 4, (64,), generator=g)
    onehot = DistinctRecords(TensorDataset(F.one_hot(category, 4).float(), (category > 1).long()))
    m = Prototypes(torch.eye(4))
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(m, DataLoader(onehot, batch_size=16))
    assert dp.ledger.steps == 2


# ---------------------------------------------------------------------------- records in checkpoints


class ExamplesInCheckpoint(Classifier):
    """Adds a few training examples to every checkpoint (for a visualisation later)."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["examples"] = {"x": self.trainer.train_dataloader.dataset.tensors[0][:8].clone()}


class DataInHyperparameters(Classifier):
    """Keeps its reference data through save_hyperparameters (written into every checkpoint)."""

    def __init__(self, reference: torch.Tensor) -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.parametrize("make", [ExamplesInCheckpoint, lambda: DataInHyperparameters(X[:20].clone())],
                         ids=["on_save_checkpoint", "save_hyperparameters"])
def test_a_checkpoint_holding_training_records_is_not_written(make: Any, tmp_path: Path) -> None:
    trainer = quiet_trainer(strategy=strategy(), max_steps=4, enable_checkpointing=True, default_root_dir=tmp_path)
    with pytest.raises(PrivacyConfigurationError, match="holds training records: checkpoint"):
        trainer.fit(make(), DataLoader(DATASET, batch_size=16))
    assert not list(tmp_path.rglob("*.ckpt"))


def test_an_ordinary_checkpoint_is_written(tmp_path: Path) -> None:
    trainer = quiet_trainer(strategy=strategy(), max_steps=4, enable_checkpointing=True, default_root_dir=tmp_path)
    public = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))  # not the training records
    trainer.fit(DataInHyperparameters(public), DataLoader(DATASET, batch_size=16))
    assert list(tmp_path.rglob("*.ckpt"))


def test_a_rescaled_copy_is_a_copy() -> None:
    """The datamodule keeps the raw values, the dataset the rescaled ones (x / 16, as the digits are): the raw
    array is the same records under one affine map."""
    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 17, (64, 8), generator=g).numpy()
    ds = TensorDataset(torch.tensor(raw / 16.0, dtype=torch.float32), torch.zeros(64, dtype=torch.long))
    holder = Holder()
    holder.raw, holder.shifted, holder.unrelated = raw, raw * 2.0 - 3.0, np.random.default_rng(0).random((64, 8))
    names = [n for n, _ in training_copies(ds, [("DataModule", holder)])]
    assert "DataModule.raw" in names and "DataModule.shifted" in names and "DataModule.unrelated" not in names


# ---------------------------------------------------------------------------- copies kept deeper, rounded or widened


class Index:
    """A helper object holding the training set (a nearest-neighbour index of the user's own)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x.clone()


def knn_targets(x: torch.Tensor, bank_x: torch.Tensor, bank_y: torch.Tensor, k: int = 3) -> torch.Tensor:
    """Soft targets from the ``k`` nearest rows of a bank (itself excluded)."""
    d = torch.cdist(x.float(), bank_x.float())
    d[d < 1e-3] = 1e9
    return F.one_hot(bank_y[d.topk(k, largest=False).indices].long(), 2).float().mean(1)


def closure_over(bank: torch.Tensor) -> Any:
    return lambda q: torch.cdist(q, bank)


def test_copies_nested_in_containers_objects_callables_and_outside_modules_are_found() -> None:
    x, y = DATASET.tensors
    holder = Holder()
    holder.memory = {"train": {"x": x.clone(), "other": [torch.randn(64, 4)]}}  # two levels down
    holder.index = Index(x)  # a plain object's attribute
    holder.targets = functools.partial(knn_targets, bank_x=x.clone().double(), bank_y=y.clone())
    holder.scaled = lambda q, bank=x * 2.0 + 1.0: q  # an affine copy as a default argument
    holder.distances = closure_over(x.clone())  # a closure cell
    holder.table = nn.Embedding.from_pretrained(x.clone())  # a module outside the model: its weight
    holder.unrelated = {"a": {"b": torch.randn(64, 4)}, "f": functools.partial(knn_targets, bank_x=torch.randn(64, 4))}
    names = sorted(n for n, _ in training_copies(DATASET, [("Bank", holder)]))
    for where in ("Bank.memory['train']['x']", "Bank.index.x", "Bank.targets.keywords['bank_x']",
                  "Bank.scaled.__defaults__[0]", "Bank.distances.<closure bank>", "Bank.table.weight"):
        assert where in names, (where, names)
    assert not any("unrelated" in n or "other" in n for n in names), names


def test_a_fitted_estimator_s_copy_is_found() -> None:
    """scikit-learn's NearestNeighbors keeps the training rows in its tree (a compiled type's buffer)."""
    neighbors = pytest.importorskip("sklearn.neighbors")
    holder = Holder()
    holder.nn = neighbors.NearestNeighbors(n_neighbors=3).fit(X.numpy().copy())
    found = dict(training_copies(DATASET, [("Module", holder)]))
    assert "Module.nn._fit_X" in found and "Module.nn._tree.data" in found


def test_records_held_one_per_item_are_exchanged_item_by_item() -> None:
    x, y = DATASET.tensors
    holder = Holder()
    holder.cache = {i: (x[i].clone(), int(y[i])) for i in range(64)}  # a dict keyed by index
    holder.rows = [(x[i].clone(), F.one_hot(y[i], 2)) for i in range(64)]  # a list of per-row tuples
    holder.views = [x[i] for i in range(64)]  # the training memory itself: exchanged with it, not again
    holder.noise = [torch.randn(4) for _ in range(64)]
    found = dict(training_copies(DATASET, [("Bank", holder)]))
    assert "Bank.cache[…][0]" in found and "Bank.rows[…][0]" in found, sorted(found)
    assert not any("views" in n or "noise" in n for n in found), sorted(found)
    before = [v[0].clone() for v in holder.cache.values()] + [r[0].clone() for r in holder.rows]
    with ExchangedRecords(list(found.items())).exchanged():
        during = [v[0] for v in holder.cache.values()] + [r[0] for r in holder.rows]
        assert all(bool((a != b).all()) for a, b in zip(during, before)), "every item exchanged"
        assert all(bool((v * x[i] > 0).all()) for i, v in enumerate(holder.views)), "views flipped once"
    assert all(torch.equal(a, b) for a, b in zip(during, before))


def test_rounded_and_widened_copies_are_copies() -> None:
    x, y = DATASET.tensors
    onehot = F.one_hot(y, 2).float()
    holder = Holder()
    holder.half, holder.bf16 = x.half(), x[5:30].to(torch.bfloat16)  # rounded: no byte of them is the data's
    holder.half_np = x.numpy().astype(np.float16)
    holder.table = torch.cat([x, onehot], 1)  # features and one-hot labels in one table
    holder.table_np = torch.cat([onehot, x], 1).numpy()  # the features as the last columns
    holder.noise_half = torch.randn(64, 4).half()
    holder.noise_table = torch.cat([torch.randn(64, 4), onehot], 1)
    names = [n for n, _ in training_copies(DATASET, [("DataModule", holder)])]
    for where in ("half", "bf16", "half_np", "table", "table_np"):
        assert f"DataModule.{where}" in names, (where, names)
    assert not any("noise" in n for n in names), names


def test_a_view_of_the_training_memory_is_exchanged_once() -> None:
    x, _ = DATASET.tensors
    holder = Holder()
    holder.array = x.numpy()  # the training tensor's own memory, as NumPy
    holder.copy = x.clone()
    holder.copy_rows = holder.copy[:32]  # a view of a copy listed already
    found = dict(training_copies(DATASET, [("Holder", holder)]))
    assert "Holder.copy" in found and "Holder.array" not in found and "Holder.copy_rows" not in found
    before, copy = x.clone(), holder.copy.clone()
    magnitude, family = 0x00400000 | 0x00200000, -0x80000000 | 0x00400000 | 0x00200000  # float32's exchanged bits
    with ExchangedRecords(list(found.items())).exchanged():
        for now, was in ((torch.from_numpy(holder.array), before), (holder.copy_rows, copy[:32])):
            moved = now.view(torch.int32) ^ was.view(torch.int32)
            # one mask each: only the exchange's bits, a magnitude bit in every element (a second mask would undo
            # the first one's wherever the two drew alike)
            assert not bool((moved & ~family).any()) and bool((moved & magnitude != 0).all())
    assert torch.equal(x, before) and torch.equal(holder.copy, copy)


def test_the_walk_is_bounded() -> None:
    """A copy past the walk's depth, or past its budget of objects, is not looked for: a huge object graph costs a
    bounded walk (it runs at every batch check)."""
    deep = Holder()
    node = deep
    for _ in range(12):
        node.next = Holder()
        node = node.next
    node.x = X.clone()
    wide = Holder()
    for i in range(400):
        child = Holder()
        setattr(wide, f"a{i}", child)
        for j in range(60):
            setattr(child, f"k{j}", object())
    last = Holder()
    last.x = X.clone()
    child.k59 = X.clone()
    names = [n for n, _ in training_copies(DATASET, [("Deep", deep), ("Wide", wide), ("Last", last)])]
    assert "Last.x" in names and not any(n.startswith(("Deep.", "Wide.")) for n in names), names


BANK_X, BANK_Y = X.clone(), Y.clone()


class PerRowCache(Classifier):
    """Soft targets from a dict of per-record (features, label) pairs built from the training set."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = {i: (BANK_X[i].clone(), int(BANK_Y[i])) for i in range(len(BANK_X))}

    def bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([v[0] for v in self.cache.values()]), torch.tensor([v[1] for v in self.cache.values()])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        bx, by = self.bank()
        return F.cross_entropy(self(x), y) + F.cross_entropy(self(x), knn_targets(x, bx, by))


class HalfInPartial(PerRowCache):
    """A float16 copy bound in a functools.partial."""

    def __init__(self) -> None:
        super().__init__()
        self.targets = functools.partial(knn_targets, bank_x=BANK_X.half(), bank_y=BANK_Y)

    def bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.targets.keywords["bank_x"], BANK_Y


class TableBank(pl.Callback):
    """Holds the training rows and their labels as one frozen embedding table."""

    def __init__(self) -> None:
        self.table = nn.Embedding.from_pretrained(torch.cat([BANK_X, BANK_Y[:, None].float()], 1))


class FromCallbackTable(PerRowCache):
    def bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        table = next(cb for cb in self.trainer.callbacks if isinstance(cb, TableBank)).table.weight
        return table[:, :4], table[:, 4]


@pytest.mark.parametrize("model", [PerRowCache, HalfInPartial, FromCallbackTable])
def test_a_step_reading_a_deeper_rounded_or_widened_copy_is_refused(model: type) -> None:
    m = model()
    before = parameters(m)
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="outside its sampled batch"):
        quiet_trainer(strategy=dp, max_steps=4, callbacks=[TableBank()]).fit(m, DataLoader(DATASET, batch_size=16))
    assert unchanged(before, m)
    assert dp.ledger.steps == 0


class HoldsCopiesReadsBatch(Classifier):
    """Holds a per-record cache and a float16 copy, and reads only its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = {i: (BANK_X[i].clone(), int(BANK_Y[i])) for i in range(len(BANK_X))}
        self.half = functools.partial(knn_targets, bank_x=BANK_X.half(), bank_y=BANK_Y)


def test_holding_deeper_copies_without_reading_them_trains() -> None:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=4, callbacks=[TableBank()]).fit(HoldsCopiesReadsBatch(),
                                                                          DataLoader(DATASET, batch_size=16))
    assert dp.ledger.steps == 4


def test_the_records_a_fetch_is_read_again_on_are_exchanged_and_put_back(monkeypatch) -> None:
    """records_exchanged: the dataset's tensors flipped inside, restored after; none beyond the size bound."""
    from lightning_dp.record_checks import outside_records

    ds = data(16)
    x, y = (t.clone() for t in ds.tensors)
    with outside_records.records_exchanged(ds):
        assert not torch.equal(ds.tensors[0], x) and not torch.equal(ds.tensors[1], y)
    assert torch.equal(ds.tensors[0], x) and torch.equal(ds.tensors[1], y)
    monkeypatch.setattr(outside_records, "MAX_REREAD_EXCHANGE", 8)
    assert outside_records.records_exchanged(ds) is None
