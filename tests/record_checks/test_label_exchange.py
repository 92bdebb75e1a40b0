"""The integers of the judges that keep labels labels are exchanged within the values they hold, by a secret shift
(record_checks/label_exchange.py): no function of the labels but the one two classes force is left alike (zoo39)."""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.record_checks.outside_records import ExchangedRecords, exchange, exchanged_copy


def test_every_label_moves_to_another_label_and_comes_back() -> None:
    """Four classes: every element changes, stays one of the four, and the restore is exact (tensor, array, list)."""
    labels = torch.arange(64) % 4
    kept = labels.clone()
    restore = exchange(labels, fixed_integers=True)
    assert bool((labels != kept).all()) and set(labels.tolist()) <= {0, 1, 2, 3}
    restore()
    assert torch.equal(labels, kept)
    array, items = kept.numpy().copy(), kept.tolist()
    for value in (array, items):
        restore = exchange(value, fixed_integers=True)
        assert all(a != b for a, b in zip(list(value), kept.tolist())) and set(list(value)) <= {0, 1, 2, 3}
        restore()
        assert list(value) == kept.tolist()


def test_the_old_maps_invariants_of_the_labels_move() -> None:
    """What flipping bit 0 left alike — the coarse classes ``y // 2``, ``y >> 1``, ``y >= 2`` — moves in the
    exchanges (zoo39 L01: a coarse-class prior kept by an epoch hook passed every judge)."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (64,), generator=g)
    coarse = float((labels // 2).float().mean())
    moved = 0
    for _ in range(20):
        with ExchangedRecords([("labels", labels)], fixed_integers=True).exchanged():
            moved += float((labels // 2).float().mean()) != coarse
    assert labels.tolist() == torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    assert moved >= 18, moved


def test_two_classes_and_one_value_keep_the_public_map() -> None:
    """Two values: the swap (the only map that keeps them labels); one value: bit 0 as before. A batch's copy too."""
    binary = torch.tensor([0, 1, 1, 0])
    with ExchangedRecords([("labels", binary)], fixed_integers=True).exchanged():
        assert binary.tolist() == [1, 0, 0, 1]
    same = torch.tensor([3, 3, 3])
    with ExchangedRecords([("labels", same)], fixed_integers=True).exchanged():
        assert same.tolist() == [2, 2, 2]
    assert torch.equal(exchanged_copy((torch.randn(4), binary))[1], binary ^ 1)


def test_an_ignore_index_stays_a_value_the_loss_accepts() -> None:
    """Token labels with -100 (padding): every element takes another of the array's own values."""
    labels = np.array([-100, 5, 7, -100, 9, 5])
    restore = exchange(labels, fixed_integers=True)
    assert set(labels.tolist()) <= {-100, 5, 7, 9} and (labels != np.array([-100, 5, 7, -100, 9, 5])).all()
    restore()
    assert labels.tolist() == [-100, 5, 7, -100, 9, 5]
