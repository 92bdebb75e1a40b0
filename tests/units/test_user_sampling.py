"""User-level DP's sampling pieces (issue #39): users, their sampler and physical batches that keep them whole."""

from __future__ import annotations

import pytest
import torch

from lightning_dp import PrivacyConfigurationError, Users
from lightning_dp.units import UserPoissonBatchSampler
from lightning_dp.units.physical import user_chunks

IDS = ["ann", "bob", "ann", "cy", "bob", "ann", "dee", "cy", "ann", "ann"]


def test_users_group_the_records_and_number_units_by_first_appearance():
    users = Users(IDS, users_per_batch=2)
    members = users.partition(None, range(len(IDS)))
    assert [m.tolist() for m in members] == [[0, 2, 5, 8, 9], [1, 4], [3, 7], [6]]
    assert users.groups_of([3, 7, 0, 2, 6]).tolist() == [0, 0, 1, 1, 2]


def test_user_ids_may_be_a_dataset_attribute_and_must_cover_every_record():
    class Data:
        user_ids = [0, 0, 1]

    assert len(Users("user_ids", users_per_batch=1).partition(Data(), range(3))) == 2
    with pytest.raises(PrivacyConfigurationError, match="has no attribute 'authors'"):
        Users("authors", users_per_batch=1).partition(Data(), range(3))
    with pytest.raises(PrivacyConfigurationError, match="record 3 of the training data has no user id"):
        Users([0, 0, 1], users_per_batch=1).partition(None, range(4))


def test_the_sampler_draws_whole_users_at_rate_q_and_at_most_the_limit_of_records_each():
    members = Users(IDS, users_per_batch=2).partition(None, range(len(IDS)))
    sampler = UserPoissonBatchSampler(members, sample_rate=0.5, steps_per_epoch=400, seed=0, max_examples_per_user=3)
    owner = {p: u for u, m in enumerate(members) for p in m.tolist()}
    joined = torch.zeros(len(members))
    seen_subsets = set()
    for batch in sampler:
        units = [owner[p] for p in batch]
        runs = [u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]
        assert len(runs) == len(set(runs)), "a user's records are together in the batch"
        for u in set(runs):
            mine = [p for p in batch if owner[p] == u]
            assert len(mine) == min(3, len(members[u]))
            joined[u] += 1
            if u == 0:
                seen_subsets.add(tuple(mine))
    assert torch.allclose(joined / 400, torch.full((4,), 0.5), atol=0.08)  # q per user, not per record
    assert len(seen_subsets) > 3  # ann's 5 records: a fresh draw of 3 each step


def test_ranks_shard_users_never_records():
    members = Users(IDS, users_per_batch=2).partition(None, range(len(IDS)))
    owner = {p: u for u, m in enumerate(members) for p in m.tolist()}
    for rank in (0, 1):
        sampler = UserPoissonBatchSampler(members, 1.0, 1, rank=rank, world_size=2, seed=0)
        assert sorted({owner[p] for p in next(iter(sampler))}) == [u for u in range(4) if u % 2 == rank]


def test_physical_batches_cut_between_users_only():
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3])
    indices = list(range(100, 111))
    chunks = user_chunks(indices, groups, limit=4)
    assert chunks == [[100, 101, 102, 103], [104, 105], [106, 107, 108, 109, 110]]  # the last user cannot be split
    assert sum(chunks, []) == indices
