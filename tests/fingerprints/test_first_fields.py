"""What a step adds to a library's object is read, the library's own attributes are not
(fingerprints/first_fields.py, state_walker.added_attributes; validators/snapshot.py puts the additions back)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.fingerprints.checksums import Checksums
from lightning_dp.fingerprints.first_fields import FirstFields
from lightning_dp.fingerprints.state_walker import Walker, added_attributes
from lightning_dp.validators.snapshot import _contents


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)


def _token(value, first: FirstFields):
    return Walker(set(), set(), Checksums(), full=False, first=first).token(value)


def test_an_attribute_added_to_a_loader_or_its_sampler_is_read_by_value():
    first, dl = FirstFields(), _loader()
    base = _token(dl, first)
    dl.timeout = 5  # the library's own attribute (set at construction): not read
    dl._iterator = object()
    assert _token(dl, first) == base
    dl.center = torch.tensor([0.5, 1.0])
    with_center = _token(dl, first)
    assert with_center != base
    dl.center = torch.tensor([0.5, 2.0])  # another value, not only another name
    assert _token(dl, first) != with_center
    del dl.center
    assert _token(dl, first) == base
    dl.sampler.center = torch.tensor([1.0])  # on an object the loader holds
    assert _token(dl, first) != base


def test_the_libraries_lazily_set_private_numbers_are_theirs_but_a_tensor_is_not():
    first, dl = FirstFields(), _loader()
    assert added_attributes(dl, first) == []  # first seen: its names recorded
    dl._last_time = 3.0
    assert added_attributes(dl, first) == []
    dl._center = torch.ones(2)
    assert [k for k, _ in added_attributes(dl, first)] == ["_center"]


def test_without_a_record_a_library_object_is_compared_by_identity():
    dl = _loader()
    walker = Walker(set(), set(), Checksums(), full=False)
    base = walker.token(dl)
    dl.center = torch.ones(2)
    assert Walker(set(), set(), Checksums(), full=False).token(dl) == base


def test_a_snapshot_puts_back_what_was_added_to_a_seen_loader_only():
    from lightning_dp.fingerprints.first_fields import FIRST_SEEN

    dl = _loader()
    dl.seen = 1
    added_attributes(dl, FIRST_SEEN)  # first seen with `seen` (as a fingerprint of the fit would)
    dl.count = 2
    restore = _contents(dl, 0)
    dl.count, dl.fresh, dl.sampler.note = 7, "x", 1.0
    iterator = dl._iterator = object()  # the library's own: left as it is
    restore()
    assert dl.count == 2 and not hasattr(dl, "fresh") and dl._iterator is iterator and dl.seen == 1
