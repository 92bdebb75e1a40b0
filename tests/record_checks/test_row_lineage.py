"""Which records a row of numbers is (record_checks/row_lineage.py): its values under casts and column orders, and
the rows the library's transforms computed it from."""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.record_checks import row_lineage
from lightning_dp.record_checks.row_lineage import note_derived, own_rows, value_rows


def test_a_cast_keeps_the_value_digest_and_a_column_order_the_sorted_one():
    x = torch.randn(50, 5, dtype=torch.float64)
    values, ordered = own_rows(x)
    assert np.array_equal(own_rows(x.float())[0], values) and np.array_equal(own_rows(x.numpy())[0], values)
    assert np.array_equal(own_rows(x[:, [4, 2, 0, 1, 3]])[1], ordered)
    assert not np.isin(own_rows(x[:, [4, 2, 0, 1, 3]])[0], values).any()
    assert own_rows(np.array(["a", "b"])) is None
    assert not own_rows(torch.randint(0, 2, (50, 5)).float())[1].any()  # binary rows: no sorted digest


def test_a_noted_transform_reads_back_to_its_input_rows_through_chains(monkeypatch):
    monkeypatch.setattr(row_lineage, "_NOTED", [])
    monkeypatch.setattr(row_lineage, "_MERGED", {"for": None})
    x = torch.randn(40, 3)
    first, second = x * 2 + 1, (x * 2 + 1).tanh()
    note_derived(x, first)
    note_derived(first, second)  # a chain: the second's rows read back to x's
    roots, ordered = value_rows(second.double())
    assert np.array_equal(roots, own_rows(x)[0]) and np.array_equal(ordered, own_rows(x)[1])
    assert not np.isin(value_rows(torch.randn(40, 3))[0], own_rows(x)[0]).any()


def test_the_notes_are_bounded_oldest_dropped(monkeypatch):
    monkeypatch.setattr(row_lineage, "_NOTED", [])
    monkeypatch.setattr(row_lineage, "_MERGED", {"for": None})
    monkeypatch.setattr(row_lineage, "MAX_NOTED", 60)
    old, new = torch.randn(40, 3), torch.randn(40, 3)
    note_derived(old, old + 1)
    note_derived(new, new + 1)
    assert np.array_equal(value_rows(new + 1)[0], own_rows(new)[0])
    assert np.array_equal(value_rows(old + 1)[0], own_rows(old + 1)[0])  # forgotten: its own rows again


def test_rows_are_digested_in_chunks_alike(monkeypatch):
    x = torch.randn(101, 5)
    whole = own_rows(x)
    monkeypatch.setattr(row_lineage, "_CHUNK", 16)  # 3 rows a chunk
    assert all(np.array_equal(a, b) for a, b in zip(own_rows(x), whole))


class _Settings(torch.utils.data.Dataset):
    """Rows stored beside 0-d settings (a scale tensor, a NumPy scalar array) and a label column."""

    def __init__(self, x):
        self.x, self.scale, self.offset, self.y = x, torch.tensor(2.0), np.array(0.5), torch.arange(len(x))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * self.scale + self.offset, self.y[i]


def test_only_the_rows_identify_the_records_a_0_d_item_is_passed_over():
    from lightning_dp.record_checks.stored_sources import identifying_rows

    x = torch.randn(30, 4)
    found = row_lineage.dataset_rows(_Settings(x))
    assert sorted(k for k in found if k[0] != "coarse") == [("sorted", (4,)), ("values", (4,))]
    assert np.array_equal(found[("values", (4,))], own_rows(x)[0])
    assert list(identifying_rows(_Settings(x))) == [("float32", (4,))]
    assert row_lineage.dataset_rows(_Settings(torch.randn(0, 4))) == {}


# ---- near-copies: the coarse digests


def test_a_near_copy_keeps_its_coarse_digests_on_one_grid_or_the_other():
    from lightning_dp.record_checks.row_lineage import coarse_rows

    x = torch.randn(1000, 20, generator=torch.Generator().manual_seed(0))
    level, on, off = coarse_rows(x)
    for copy in (x + 1e-7 * torch.randn(x.shape), x.half().float(), x.round(decimals=3), x.double()):
        found = coarse_rows(copy)
        assert found[0] == level
        either = np.isin(found[1], on) | np.isin(found[2], off)
        assert either.mean() > 0.95 and max(np.isin(found[1], on).mean(), np.isin(found[2], off).mean()) > 0.5
    assert not np.isin(coarse_rows(torch.randn(1000, 20))[1], on).any()  # another draw: no cell shared


def test_integer_rows_keep_their_cells_on_the_offset_grid_and_nan_is_kept():
    """Integers lie on the first grid's edges (a jitter moves them across); the offset grid's edges are a third of a
    cell off, so every row keeps its digest there. A column of zeros keeps the item's scale (no cell of 1e-7)."""
    from lightning_dp.record_checks.row_lineage import coarse_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 17, (600, 64), generator=g).float()
    x[:, 0] = 0.0
    x[::7, 3] = float("nan")
    _, on, off = coarse_rows(x)
    jittered = coarse_rows(x + 1e-7 * torch.randn(x.shape, generator=g))
    assert np.isin(jittered[2], off).all() and not np.isin(jittered[1], on).all()


def test_rows_of_few_distinct_cells_keep_no_coarse_digest_and_chunks_digest_alike(monkeypatch):
    from lightning_dp.record_checks.row_lineage import coarse_rows

    g = torch.Generator().manual_seed(0)
    assert coarse_rows(torch.randn(1000, 2, generator=g)) is None  # 2 columns: rows share cells
    few = torch.randn(50, 2, generator=g)  # distinct by their cells, but 50 rows bound little: wider cells are shared
    assert coarse_rows(few) is None
    monkeypatch.setattr(row_lineage, "COARSE_ROWS", 0)
    assert coarse_rows(few) is not None
    monkeypatch.setattr(row_lineage, "COARSE_ROWS", 500)
    assert coarse_rows(torch.randint(0, 3, (1000, 4), generator=g).float()) is None
    assert coarse_rows(np.array(["a", "b"])) is None
    x = torch.randn(101, 300, generator=g)  # wider than COARSE_COLUMNS: evenly spaced columns
    whole = coarse_rows(x)
    monkeypatch.setattr(row_lineage, "_CHUNK", 200)  # 3 rows a chunk
    assert all(np.array_equal(a, b) for a, b in zip(coarse_rows(x)[1:], whole[1:]))


def _with_copies(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """zoo30 r05's class: a near-copy of ``x`` with a few of its rows in twice (exactly, or under a jitter of
    their own), or a constant row added ten times."""
    g = torch.Generator().manual_seed(4)
    near = x + 1e-4 * torch.randn(x.shape, generator=g)
    return {"5 rows twice": torch.cat([near, near[:5]]), "2 % of rows twice": torch.cat([near, near[:20]]),
            "a zero row 10 times": torch.cat([near, torch.zeros(10, x.shape[1])]),
            "5 rows twice, jittered": torch.cat([near, near[:5] + 1e-6 * torch.randn(5, x.shape[1], generator=g)]),
            "none": near}


def test_a_few_copies_within_the_rows_keep_the_coarse_and_sorted_digests():
    """Copies of rows within an item are one record each: they do not make its rows look indistinct, so the coarse
    digests (and the sorted ones) stay, at the level of the data without them, and match the data's."""
    from lightning_dp.record_checks.row_lineage import coarse_rows

    x = torch.randn(1000, 20, generator=torch.Generator().manual_seed(0))
    level, on, off = coarse_rows(x)
    for what, copy in _with_copies(x).items():
        found = coarse_rows(copy)
        assert found is not None and found[0] == level, what
        assert (np.isin(found[1], on) | np.isin(found[2], off))[:1000].mean() > 0.95, what
        assert own_rows(copy[:, torch.randperm(20)])[1].any(), what  # sorted digests kept too
    assert coarse_rows(torch.randint(0, 3, (1000, 4)).float()) is None  # copies by chance: under 90 % distinct


def test_sorted_rows_are_torch_sorts_bit_for_bit():
    """The sorted digest (np.sort) equals torch.sort's, NaN last and repeated values included: data records stored
    with either read alike."""
    from lightning_dp.record_checks.row_lineage import _sorted
    from lightning_dp.record_checks.stored_records import row_digests

    g = torch.Generator().manual_seed(0)
    t = torch.randn(200, 3 * 8 * 8, generator=g).round(decimals=1) + 0.0
    t[torch.rand(t.shape, generator=g) < 0.05] = float("nan")
    assert (row_digests(_sorted(t)) == row_digests(t.sort(dim=1).values)).all()
