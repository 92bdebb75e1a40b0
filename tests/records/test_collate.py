import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.records.collate import EmptySafeCollate, batch_size_of


def test_empty_batch_keeps_structure():
    ds = TensorDataset(torch.randn(5, 3, 2), torch.arange(5))
    collate = EmptySafeCollate(ds)
    x, y = collate([])
    assert x.shape == (0, 3, 2) and y.shape == (0,) and y.dtype == torch.long
    x, y = collate([ds[0], ds[1]])
    assert x.shape == (2, 3, 2)


def test_dict_batches_and_custom_collate():
    data = [{"a": torch.ones(2), "b": torch.zeros(())} for _ in range(3)]

    def collate(items):
        return {"a": torch.stack([i["a"] for i in items]), "b": torch.stack([i["b"] for i in items])}

    out = EmptySafeCollate(data, collate)([])
    assert out["a"].shape == (0, 2) and out["b"].shape == (0,)
    assert batch_size_of(out) == 0
    assert batch_size_of(collate(data)) == 3


def test_works_in_a_dataloader_with_empty_index_lists():
    ds = TensorDataset(torch.randn(4, 2))
    loader = DataLoader(ds, batch_sampler=[[], [0, 1], []], collate_fn=EmptySafeCollate(ds))
    assert [batch_size_of(b) for b in loader] == [0, 2, 0]


class _Rows(torch.utils.data.Dataset):
    """``n`` random records of ``width`` features (``x``); how they are read is each subclass's."""

    def __init__(self, n: int, width: int) -> None:
        self.x = torch.randn(n, width)

    def __len__(self) -> int:
        return len(self.x)


class _BatchesOnly(_Rows):
    """Reads through ``__getitems__`` only, in another layout than ``__getitem__`` would (a dict per record)."""

    def __init__(self) -> None:
        super().__init__(4, 3)

    def __getitem__(self, i):
        raise RuntimeError("read through __getitems__")

    def __getitems__(self, indices):
        return [{"x": self.x[i], "i": i} for i in indices]


def test_the_empty_batch_of_a_dataset_read_in_batches_is_read_as_the_loader_reads():
    ds = _BatchesOnly()
    loader = DataLoader(ds, batch_sampler=[[], [0, 1], []], collate_fn=EmptySafeCollate(ds))
    batches = list(loader)
    assert [batch_size_of(b) for b in batches] == [0, 2, 0]
    assert batches[0]["x"].shape == (0, 3) and batches[0]["i"].shape == (0,)


class _Unreadable(_Rows):
    """Records 0, 3, 6, … unreadable: ``None``, which the Kaggle collate drops (zoo28 d02)."""

    def __init__(self) -> None:
        super().__init__(9, 2)

    def __getitem__(self, i):
        return None if i % 3 == 0 else (self.x[i], i)


def _drop_none(items):
    return torch.utils.data.default_collate([b for b in items if b is not None])


def test_a_batch_of_only_unreadable_records_is_an_empty_batch_shaped_by_one_that_holds_data():
    """The user's collate fails on what is left ([]), and record 0 (the usual template) is None too."""
    ds = _Unreadable()
    collate = EmptySafeCollate(ds, _drop_none)
    for items in ([], [None], [None, None]):
        x, i = collate(items)
        assert x.shape == (0, 2) and i.shape == (0,)
    x, i = collate([ds[1], None, ds[2]])
    assert i.tolist() == [1, 2]


def test_rows_held_names_the_records_the_collate_kept():
    from lightning_dp.records.collate import held_records, rows_held

    ds = _Unreadable()
    indices = [0, 1, 2, 3, 4]
    batch = _drop_none([ds[i] for i in indices])
    assert rows_held(ds, indices, batch) == [1, 2, 4] == held_records(ds, indices)
    full = TensorDataset(torch.randn(5, 2))
    assert rows_held(full, [0, 1, 2], full[0:3]) == [0, 1, 2]  # as many rows as indices: nothing read
    assert rows_held(ds, [0, 1, 2], torch.zeros(1, 2)) == [0, 1, 2]  # one row for two records holding data: as was
