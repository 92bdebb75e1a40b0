"""The training dataset's token (lightning_dp/fingerprints/dataset_tokens.py): state a step's hooks keep on the
dataset in a dict, list, set or deque (per-record losses for hard-example weights, zoo20 j1) shows and is refused as
kept state; an index-keyed cache the watched fetch fills (records/stateless.py) and configuration do not."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, at_freed_address, quiet_trainer
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_settings, dataset_token, put_back
from lightning_dp.records.identity import Same
from lightning_dp.records.stateless import FetchState

X = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class Indexed(TensorDataset):
    def __init__(self, kept):
        super().__init__(X, Y, torch.arange(len(X)))
        self.kept = kept


class HardExamples(TinyClassifier):
    """Remembers each example's un-noised loss on its dataset, after the step (the zoo20 j1 pattern)."""

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        return {"loss": losses.mean(), "idx": i, "losses": losses.detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        kept = self.trainer.train_dataloader.dataset.kept
        for k, v in zip(outputs["idx"].tolist(), outputs["losses"]):
            if isinstance(kept, dict):
                kept[k] = float(v)
            elif isinstance(kept, set):
                if v > 0.7:
                    kept.add(k)
            else:
                kept.append(v)


@pytest.mark.parametrize("kept", [dict, set, deque, list], ids=["dict", "set", "deque", "list of tensors"])
def test_per_record_state_a_step_hook_keeps_on_the_dataset_is_refused(kept):
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=4)
    with pytest.raises(PrivacyConfigurationError, match=r"Kept state written outside the release: dataset 0"):
        trainer.fit(HardExamples(), DataLoader(Indexed(kept()), batch_size=16))


class DecodeCache(Dataset):
    def __init__(self):
        self.cache, self.epoch, self.transforms = {}, 0, [torch.nn.Identity()]

    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        if i not in self.cache:
            self.cache[i] = (X[i] * 2).clone()  # "decoded" once
        return self.cache[i], Y[i]


@pytest.mark.parametrize("earlier", [0, 6000], ids=["hashed whole", "sampled"])
def test_the_fetchs_cache_entries_do_not_change_the_token_a_hooks_do(earlier):
    """What the watched fetch adds to an index-keyed cache is the fetch's (judged there); an entry written outside a
    fetch, or a fetched entry overwritten, changes the token. ``earlier``: entries filled before the fetch was watched
    (the checks before training read records), past the size where a sample is hashed."""
    ds = DecodeCache()
    ds.cache.update({-1 - i: 0.0 for i in range(earlier)})
    state = FetchState(ds, None).noted()
    for i in range(70):  # (a dict of up to 64 tensors is walked as the dataset's tensors: dataset_parts)
        ds[i]
        state.check()
    before = dataset_token(ds)
    for i in range(75, 95):
        ds[i]
        state.check()
    assert dataset_token(ds) == before
    ds.epoch, ds.transforms[0] = 1, torch.nn.Identity()  # set_epoch, a transform swapped: not records
    assert dataset_token(ds) == before
    ds.cache[76] = ds.cache[76] * 0 + 0.5  # a hook's write over a fetched entry (past 4,096: if sampled)
    assert (dataset_token(ds) != before) is (earlier == 0)
    ds.cache[76] = X[76] * 2
    again = dataset_token(ds)
    ds.cache[95] = 0.3  # a new entry no fetch added
    assert dataset_token(ds) != again


def test_a_dataset_with_a_decode_cache_and_set_epoch_trains():
    from pytorch_lightning.callbacks import Callback

    class EpochSetter(Callback):
        def on_train_epoch_start(self, trainer, module):
            trainer.train_dataloader.dataset.epoch = trainer.current_epoch

    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2,
                            callbacks=[EpochSetter()])
    ds = DecodeCache()
    trainer.fit(TinyClassifier(), DataLoader(ds, batch_size=16))
    assert trainer.strategy.ledger.steps >= 2 and ds.epoch == 1 and ds.cache


class EpochSettings(TensorDataset):
    """``set_epoch`` writes a dict of named settings (qa9 e2b: refused when the first step's replays ran the epoch
    hook at another epoch and left the dict changed)."""

    def __init__(self):
        super().__init__(X, Y)
        self.settings = {"epoch": 0, "strength": 0.0}

    def set_epoch(self, epoch):
        self.settings["epoch"], self.settings["strength"] = epoch, 0.05 * epoch


def test_a_dataset_whose_set_epoch_writes_a_settings_dict_trains():
    from pytorch_lightning.callbacks import Callback

    class SetEpoch(Callback):
        def on_train_epoch_start(self, trainer, module):
            trainer.train_dataloader.dataset.set_epoch(trainer.current_epoch)

    ds = EpochSettings()
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=3,
                            callbacks=[SetEpoch()])
    trainer.fit(TinyClassifier(), DataLoader(ds, batch_size=16))
    assert trainer.strategy.ledger.steps >= 3 and ds.settings["epoch"] == 2


def test_settings_are_left_out_and_per_record_state_is_not():
    ds = Indexed({})
    ds.settings = {"epoch": 0}
    before = dataset_token(ds)
    ds.settings["epoch"] = 1
    assert dataset_token(ds) == before
    ds.kept[3] = 0.25  # a record's loss, keyed by the record
    assert dataset_token(ds) != before
    ds.settings = {3: 0.25}  # keyed by records: not settings
    with_records = dataset_token(ds)
    ds.settings[3] = 0.5
    assert dataset_token(ds) != with_records


class Settings(TensorDataset):
    def __init__(self):
        super().__init__(X, Y)
        self.scale, self.name, self.settings = 1.0, "train", {"epoch": 0, "p": 0.5}
        self.order, self.seen, self.kept = list(range(len(X))), {}, deque()


def test_settings_are_named_by_attribute_and_type_and_compared_by_value():
    ds = Settings()
    before = dataset_settings(Subset(ds, range(10)))  # through the datasets it wraps
    assert set(before) == {"dataset setting Settings.scale (float)", "dataset setting Settings.name (str)",
                           "dataset setting Settings.settings (dict of settings)"}
    ds.scale = 1.7311
    now = dataset_settings(ds)
    assert now != before and not any("1.73" in name for name in now)
    ds.scale = 1.0
    ds.settings["p"] = 0.25
    assert dataset_settings(ds) != before


def test_put_back_rebinds_and_restores_containers_by_reference_only():
    ds = Settings()
    order, x = ds.order, ds.tensors[0]
    back = put_back(Subset(ds, range(10)))
    ds.scale, ds.settings["epoch"], ds.extra = 2.0, 3, "added"
    ds.order.reverse()
    ds.seen[1] = torch.tensor(0.4)
    ds.kept.append(0.3)
    ds.tensors[0].mul_(1.0)  # a record written in place: the fingerprint's to refuse, never copied back
    version = x._version
    back()
    assert ds.scale == 1.0 and ds.settings == {"epoch": 0, "p": 0.5} and not hasattr(ds, "extra")
    assert ds.order is order and order == list(range(len(X))) and ds.seen == {} and not ds.kept
    assert ds.tensors[0] is x and x._version == version


def test_a_small_tensor_a_hook_keeps_is_read_by_its_values():
    """Each replay of a hook makes another loss tensor: compared by value, the replays on the same batch agree."""
    ds = Indexed([torch.tensor(0.5)])
    before = dataset_token(ds)
    ds.kept[0] = torch.tensor(0.5)
    assert dataset_token(ds) == before
    ds.kept[0] = torch.tensor(0.25)
    assert dataset_token(ds) != before


def test_a_collate_object_of_the_users_has_settings_a_function_has_none():
    class Collate:
        def __init__(self):
            self.scale = 1.0

        def __call__(self, rows):
            return rows

    ds, collate = TensorDataset(X, Y), Collate()
    assert dataset_settings(ds, lambda rows: rows) == dataset_settings(ds) == {}
    assert list(dataset_settings(ds, collate)) == ["collate setting Collate.scale (float)"]
    back = put_back(ds, collate)
    collate.scale = 3.0
    back()
    assert collate.scale == 1.0


def test_settings_reach_transform_objects_two_levels_down_and_put_back_restores_them():
    class Jitter:
        def __init__(self) -> None:
            self.p, self.sizes = 0.5, (2, 3)

    class Chain:
        def __init__(self, steps: list) -> None:
            self.steps = steps

    class DS(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.transform = {"train": Chain([Jitter()])}

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int):
            return torch.zeros(1)

    ds = DS()
    settings = dataset_settings(ds)
    assert settings["transform setting Jitter.p (float)"] == ("float", 0.5)
    assert not any("sizes" in k or "Chain" in k for k in settings)  # a tuple, a list: no plain setting
    restore = put_back(ds)
    jitter = ds.transform["train"].steps[0]
    jitter.p, jitter.added = 0.9, 1
    restore()
    assert jitter.p == 0.5 and not hasattr(jitter, "added")


def test_a_dataset_tensor_at_a_freed_ones_address_is_a_change():
    """The dataset's token holds the tensors it compares by identity, version and shape: one rebound to a new
    tensor of the same shape after the old one is freed (a statistic kept by the step) is not taken for it."""
    from torch.utils.data import TensorDataset

    from lightning_dp.fingerprints.dataset_tokens import dataset_token

    dataset = TensorDataset(torch.zeros(8, 64))
    before = []

    def tokened_and_freed() -> int:
        dataset.kept = torch.zeros(64)
        before[:] = [dataset_token(dataset)]
        freed = id(dataset.kept)
        dataset.kept = None
        return freed

    dataset.kept, _ = at_freed_address(tokened_and_freed, lambda: torch.zeros(64), tries=30, count=100)
    assert dataset_token(dataset) != before[0]


class _Factor:
    def __init__(self, factor) -> None:
        self.factor = factor


class _Wrap:
    def __init__(self, inner) -> None:
        self.inner = inner


class _Holding(torch.utils.data.Dataset):
    def __init__(self, transform) -> None:
        self.transform, self.x = transform, torch.zeros(4, 2)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return self.x[i]


def _scaled(x, st):
    return x * st.factor


def _closure(cell: list, offset: float):
    def shifted(x):
        return x * cell[0] + offset
    return shifted


@pytest.mark.parametrize("how", ["partial", "bound method", "three wrappers", "four wrappers"])
def test_settings_reach_a_transform_through_callables_and_wrappers(how):
    """zoo25 t1: a partial's arguments, a bound method's object, ``Wrap(Wrap(obj))`` (and one more level)."""
    import functools

    st = _Factor(1.0)
    transform = {"partial": functools.partial(_scaled, st=st), "bound method": st.__init__,
                 "three wrappers": _Wrap(_Wrap(st)), "four wrappers": _Wrap(_Wrap(_Wrap(st)))}[how]
    ds = _Holding(transform)
    assert dataset_settings(ds)["transform setting _Factor.factor (float)"] == ("float", 1.0)
    restore = put_back(ds)
    st.factor = 2.0
    restore()
    assert st.factor == 1.0


def test_a_closures_cells_are_settings_and_put_back_restores_them():
    cell = [1.0]
    ds = _Holding(_closure(cell, 0.5))
    settings = dataset_settings(ds)
    assert settings["transform setting shifted.cell (list of settings)"] == ("list of settings", (("float", 1.0),))
    assert settings["transform setting shifted.offset (float)"] == ("float", 0.5)
    restore = put_back(ds)
    cell[0] = 3.0
    ds.transform.__closure__[1].cell_contents = 9.0  # a `nonlocal offset` rebound
    assert dataset_settings(ds) != settings
    restore()
    assert cell == [1.0] and dataset_settings(ds) == settings


def test_a_transforms_tensors_and_arrays_are_settings_by_value_or_identity_and_digest_the_datasets_are_not():
    """zoo25 t2: small ones by value (one rebound to equal values is alike; an in-place write shows), larger ones by
    identity, version and digest; the dataset's own tensor ``x`` is a record (:func:`dataset_token`)."""
    small, big, arr = _Factor(torch.ones(())), _Factor(torch.ones(64)), _Factor(np.ones(2))
    ds = _Holding([small, big, arr])
    settings = dataset_settings(ds)
    assert not any(".x " in k for k in settings)
    assert settings["transform setting _Factor.factor (Tensor)"] == ("Tensor", (), "torch.float32", (1.0,))
    assert settings["transform setting _Factor.factor (Tensor) #2"][1] == Same(big.factor)  # one entry each
    small.factor = torch.ones(())
    assert dataset_settings(ds) == settings  # rebound to equal values
    small.factor.fill_(2.0)
    assert dataset_settings(ds) != settings
    small.factor.fill_(1.0)
    big.factor.numpy()[3] = 5.0  # a write through a NumPy view moves no version: the digest shows it
    assert dataset_settings(ds) != settings
    big.factor.numpy()[3] = 1.0
    arr.factor[1] = 7.0
    assert dataset_settings(ds) != settings


def test_an_nn_module_transforms_buffers_are_settings_and_put_back_restores_small_ones_in_place():
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("factor", torch.ones(()))

    tf, arr = Scale(), _Factor(np.ones(2))
    ds = _Holding([tf, arr])
    settings = dataset_settings(ds)
    assert settings["transform setting Scale.factor (Tensor)"] == ("Tensor", (), "torch.float32", (1.0,))
    restore = put_back(ds)
    old = tf.factor
    tf.factor.fill_(3.0)
    arr.factor[0] = 4.0
    restore()
    assert tf.factor is old and float(old) == 1.0 and arr.factor.tolist() == [1.0, 1.0]
    tf.factor = torch.tensor(5.0)  # rebound: the old buffer is put back
    restore()
    assert tf.factor is old and dataset_settings(ds) == settings


def test_library_objects_and_the_lightning_module_are_no_transforms():
    import pytorch_lightning as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 1.0

    ds = _Holding([torch.nn.Linear(2, 2), Model(), torch.nn.functional.relu])
    assert dataset_settings(ds) == {}
