import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.mechanism.collate import EmptySafeCollate, batch_size_of


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
