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


class _BatchesOnly(torch.utils.data.Dataset):
    """Reads through ``__getitems__`` only, in another layout than ``__getitem__`` would (a dict per record)."""

    def __init__(self) -> None:
        self.x = torch.randn(4, 3)

    def __len__(self) -> int:
        return 4

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
