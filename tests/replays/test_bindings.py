"""Names bound in a namespace replaced for a block and put back (lightning_dp/replays/bindings.py)."""

from __future__ import annotations

import pytest

from lightning_dp.replays.bindings import rebound


def real() -> str:
    return "real"


def test_bound_names_are_replaced_for_the_block_and_put_back_however_it_ends():
    names = {"clock": real, "other": 3}
    replacement = lambda: "replayed"  # noqa: E731
    seen = []
    with rebound([(names, "tag"), (names, "again")], lambda v, tag: seen.append(tag) or (replacement if v is real
                                                                                         else None)):
        assert names == {"clock": replacement, "other": 3}
    assert names == {"clock": real, "other": 3} and seen == ["tag", "tag"]  # one namespace read once
    with pytest.raises(KeyError):
        with rebound([(names, None)], lambda v, _: replacement if v is real else None):
            raise KeyError
    assert names["clock"] is real


def test_a_name_bound_again_inside_the_block_is_kept():
    names = {"clock": real}
    with rebound([(names, None)], lambda v, _: (lambda: 0) if v is real else None):
        names["clock"] = print
    assert names["clock"] is print


def test_the_module_index_scans_each_module_once_and_follows_new_ones(monkeypatch):
    import sys
    import types

    from lightning_dp.replays.bindings import ModuleIndex

    calls = []

    def select(name, names, filename):
        calls.append(name)
        return names if names.get("marker") is real else None

    index = ModuleIndex(select)
    assert all(e.get("marker") is not real for e in index.entries())
    scanned = len(calls)
    assert index.entries() == index.entries() and len(calls) == scanned  # nothing new: no scan
    module = types.ModuleType("lightning_dp_test_bound")
    module.marker = real
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert vars(module) in index.entries() and calls[scanned:] == [module.__name__]
