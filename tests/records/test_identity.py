"""Objects told apart by identity, not by id alone (lightning_dp/records/identity.py)."""

from __future__ import annotations

from conftest import at_freed_address

from lightning_dp.records.identity import IdentityMap, Same


class Thing:
    pass


def test_a_freed_objects_entry_is_not_found_for_a_new_one_at_its_address():
    seen: IdentityMap[str] = IdentityMap()
    first = Thing()
    seen[first] = "first"
    assert first in seen and seen.get(first) == "first"
    freed = id(first)
    del first
    second, _ = at_freed_address(freed, Thing)
    assert second not in seen
    assert seen.get(second, "none") == "none"
    assert seen.setdefault(second, "second") == "second" and seen.get(second) == "second"


def test_an_object_without_weak_references_is_held():
    seen: IdentityMap[int] = IdentityMap()
    cache = {0: 1}  # a dict takes no weak reference
    seen[cache] = 1
    freed = id(cache)
    del cache
    made = [{0: 1} for _ in range(1000)]
    assert all(id(d) != freed for d in made)  # held by the map: its address is not handed out
    assert not any(d in seen for d in made)


def test_same_holds_its_object_and_compares_by_identity():
    token = Same(Thing())
    freed = id(token.obj)
    second, _ = at_freed_address(freed, Thing)
    assert second is not token.obj and Same(second) != token
    assert Same(token.obj) == token and hash(Same(token.obj)) == hash(token)
