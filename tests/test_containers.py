"""Containers put back in place (lightning_dp/containers.py): by their own methods, so a subclass keeps its meaning."""

from __future__ import annotations

import collections

import pytest

from lightning_dp.containers import held_items, put_back


@pytest.mark.parametrize("make", [
    lambda: collections.Counter(alpha=5, beta=2),
    lambda: collections.OrderedDict(b=1, a=2),
    lambda: collections.defaultdict(list, a=[1]),
    lambda: [3, 1, 2],
    lambda: collections.deque([1, 2], maxlen=3),
    lambda: {1, 2},
])
def test_each_kind_comes_back_as_it_was_in_the_same_object(make):
    container, reference = make(), make()
    items = held_items(container)
    container.clear()
    (container.update if isinstance(container, (dict, set)) else container.extend)(
        {"zzz": 9} if isinstance(container, dict) else [7])
    put_back(container, items)
    assert type(container) is type(reference) and container == reference
    if not isinstance(container, set):
        assert list(container.items() if isinstance(container, dict) else container) == \
            list(reference.items() if isinstance(reference, dict) else reference)
