"""A container of the user's put back in place as it was (the replays' runs, a fetch's reruns, a transform's
release note read again).

The items are kept as :func:`held_items` gives them and put back through the container's own ``clear`` and item
assignment, so a subclass keeps its meaning: ``Counter.update`` would *count* ``(key, value)`` pairs (newcomer30: a
vocabulary Counter that no hook touched came back as counts of its pairs and read as written), and an
``OrderedDict`` keeps its order.
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["held_items", "put_back"]


def held_items(container: Any) -> list[Any]:
    """``container``'s items as :func:`put_back` takes them: a dict's ``(key, value)`` pairs, or its elements, in
    order."""
    return list(container.items()) if isinstance(container, dict) else list(container)


def put_back(container: Any, items: list[Any]) -> None:
    """``container`` (a dict, list, set or deque, or a subclass) holds ``items`` again, in place and in order."""
    if isinstance(container, dict):
        container.clear()
        for key, value in items:
            container[key] = value
    elif isinstance(container, list):
        container[:] = items
    else:
        container.clear()
        container.extend(items) if isinstance(container, collections.deque) else container.update(items)
