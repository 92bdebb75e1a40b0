"""The ledger store (accounting/ledger_store.py): a fit's record of trained weights on disk, so that a new process
that loads the weights by other means than Lightning's loader (``torch.load`` then ``load_state_dict``), or derives
weights from a loaded checkpoint's (shrink and perturb), continues the fit's ledger. A fresh module does not; ``off``
turns it off; a damaged file is skipped with a warning; the store keeps the newest entries; rank 0 alone writes.
The multi-process test runs its second process as a subprocess; the others stand for a new process by clearing
this process' records (the store holds the same material)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402
from child_fits import ledgers as child_ledgers  # noqa: E402
from child_fits import run_child, write_model  # noqa: E402

from lightning_dp.accounting import data_store, ledger_epsilon, ledger_store, module_ledgers  # noqa: E402
from lightning_dp.accounting.epsilon import epsilon  # noqa: E402
from lightning_dp.accounting.ledger import PrivacyLedger  # noqa: E402

SIGMA, Q, DELTA = 1.0, 32 / 256, 1e-5

CHILD = '''
import json, os, torch
from tiny import Tiny, fit
from lightning_dp.accounting import data_ledgers, module_ledgers


def state_dict(store):
    os.environ["LIGHTNING_DP_LEDGER_STORE"] = store
    model = Tiny(seed=1)
    model.load_state_dict(torch.load("m.pt"))
    return model


def shrink_perturb(store):
    loaded = Tiny.load_from_checkpoint("full.ckpt")  # the checkpoint's record: digests only, no path sketches
    g = torch.Generator().manual_seed(4)
    model = Tiny(seed=2)
    model.load_state_dict({k: 0.5 * v + 1e-3 * torch.randn(v.shape, generator=g)
                           for k, v in loaded.state_dict().items()})
    return model


store = os.environ["LIGHTNING_DP_LEDGER_STORE"]
out = {}
for name, build in [("fresh", lambda: Tiny()), ("state_dict", lambda: state_dict(store)),
                    ("shrink_perturb", lambda: shrink_perturb(store)), ("off", lambda: state_dict("off"))]:
    out[name] = fit(build()).state_dict()
    module_ledgers._BY_CONTENT.clear(); module_ledgers._SKETCHES.clear()  # each scenario as if in its own process
    data_ledgers._clear()  # (the data's record too: every scenario trains on the same records)
print("LEDGERS " + json.dumps(out))
'''


def _new_process() -> None:
    """Forget this process' records of trained weights, as a new process would (the store keeps them)."""
    module_ledgers._BY_CONTENT.clear()
    module_ledgers._SKETCHES.clear()


def test_weights_loaded_in_a_new_process_continue_the_ledger_through_the_store(tmp_path, monkeypatch):
    """Process 1 (this one) fits 8 releases and saves ``model.state_dict()`` and a checkpoint. Process 2: the
    state dict loaded into a module seeded otherwise continues the ledger (16 releases, two runs, ε over both); a
    shrink-and-perturb copy of the checkpoint's weights continues it too (the fit's path sketches are in the store,
    not in the checkpoint); a fresh module seeded as the fit was starts afresh; with the store ``off``, 8."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    write_model(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tiny", None)
    import tiny

    model = tiny.Tiny()
    saving = ModelCheckpoint(dirpath=tmp_path / "saved", filename="full")
    assert tiny.fit(model, enable_checkpointing=True, callbacks=[saving]).steps == 8
    sys.modules.pop("tiny", None)
    (tmp_path / "saved" / "full.ckpt").rename(tmp_path / "full.ckpt")
    torch.save(model.state_dict(), tmp_path / "m.pt")
    assert list(Path(os.environ[ledger_store.ENV]).glob("*" + ledger_store.SUFFIX))  # the fit's entry
    data_store.remove(None)  # the weights' record alone: the child's fits read the same records (test_data_store.py)

    ledgers = child_ledgers(run_child(tmp_path, CHILD))
    assert ledgers["fresh"].steps == 8
    assert ledgers["off"].steps == 8
    for name in ("state_dict", "shrink_perturb"):
        assert ledgers[name].steps == 16, name
        assert len({e.run for e in ledgers[name].entries}) == 2, name  # the first fit's run, then the new one
        assert ledger_epsilon(ledgers[name], DELTA) == pytest.approx(epsilon(SIGMA, Q, 16, DELTA), rel=1e-9)
        assert ledger_epsilon(ledgers[name], DELTA) > ledger_epsilon(ledgers["fresh"], DELTA)


def _trained(steps: int = 3) -> tuple[dict, Classifier]:
    model = Classifier()
    start = copy.deepcopy(model.state_dict())
    assert fit(model, steps=steps).ledger.steps == steps
    return start, model


def _loaded(state: dict) -> Classifier:
    module = Classifier()
    module.load_state_dict(state)
    return module


@pytest.mark.parametrize("derive", [
    lambda start, end, g: end,
    lambda start, end, g: {k: v.to(torch.bfloat16).float() for k, v in end.items()},
    lambda start, end, g: {k: v * 1.0001 for k, v in end.items()},
    lambda start, end, g: {k: (start[k] + v) / 2 for k, v in end.items()},
    lambda start, end, g: {k: 0.5 * v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in end.items()},
], ids=["the same", "bfloat16", "near", "halfway", "shrink and perturb"])
def test_the_store_matches_as_this_process_does(derive):
    """The store's material matched by module_ledgers' own tests (digests, near sketches, path sketches), found
    only when this process' records say nothing; a fresh module seeded as the fit was is its start: not taken."""
    start, model = _trained()
    derived = derive(start, model.state_dict(), torch.Generator().manual_seed(4))
    _new_process()
    assert module_ledgers.record_of(Classifier()) is None
    assert module_ledgers.record_of(_loaded(derived)).steps == 3
    assert fit(_loaded(derived), steps=2).ledger.steps == 5


def test_off_turns_the_store_off(monkeypatch):
    monkeypatch.setenv(ledger_store.ENV, "off")
    assert ledger_store.directory() is None
    _, model = _trained()
    _new_process()
    assert module_ledgers.record_of(_loaded(model.state_dict())) is None


def test_the_default_directory_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(ledger_store.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ledger_store.directory() == tmp_path / "lightning_dp" / "ledgers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ledger_store.directory() == tmp_path / ".cache" / "lightning_dp" / "ledgers"


def _bound_and_trained(ledger_steps: int = 4, seed: int = 0, width: int = 8, dtype=torch.float32) -> nn.Module:
    """A module bound to a ledger, moved by its releases, then released (module_ledgers' own calls, no Trainer)."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 2)).to(dtype)
    ledger = PrivacyLedger()
    module_ledgers.bind(module, ledger)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    ledger.record(SIGMA, Q, ledger_steps)
    module_ledgers.unbind(module, ledger)
    return module


def test_a_damaged_file_is_skipped_with_a_warning():
    module = _bound_and_trained()
    where = ledger_store.directory()
    (good,) = where.glob("*" + ledger_store.SUFFIX)
    (where / ("truncated" + ledger_store.SUFFIX)).write_bytes(good.read_bytes()[:100])
    (where / ("garbage" + ledger_store.SUFFIX)).write_bytes(b"not a ledger")
    torch.save({"version": 1, "ledger": {"entries": []}}, where / ("partial" + ledger_store.SUFFIX))
    _new_process()
    copy_ = copy.deepcopy(module)
    with pytest.warns(RuntimeWarning, match="Skipped the ledger store's file") as caught:
        assert module_ledgers.record_of(copy_).steps == 4  # the good entry still found
    assert len([w for w in caught if "Skipped" in str(w.message)]) == 3


def test_an_unwritable_store_warns_and_the_fit_goes_on(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(ledger_store.ENV, str(tmp_path / "a_file" / "store"))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        _bound_and_trained()


def test_the_store_keeps_the_newest_entries_and_no_partial_files(monkeypatch):
    monkeypatch.setattr(ledger_store, "KEPT", 3)
    modules = [_bound_and_trained(seed=seed) for seed in range(5)]
    where = ledger_store.directory()
    assert len(list(where.glob("*" + ledger_store.SUFFIX))) == 3
    assert not [p for p in where.iterdir() if not p.name.endswith(ledger_store.SUFFIX)]  # written by a rename
    _new_process()
    assert module_ledgers.record_of(copy.deepcopy(modules[0])) is None  # the oldest went
    assert module_ledgers.record_of(copy.deepcopy(modules[4])).steps == 4


@pytest.mark.parametrize("known_by", ["process group", "RANK"])
def test_only_rank_zero_writes_and_every_rank_reads(monkeypatch, known_by):
    module = _bound_and_trained()
    with monkeypatch.context() as patched:
        if known_by == "RANK":
            patched.setenv("RANK", "1")
        else:
            patched.setattr(torch.distributed, "is_initialized", lambda: True)
            patched.setattr(torch.distributed, "get_rank", lambda *args: 1)
        other = _bound_and_trained(seed=1)
        assert len(list(ledger_store.directory().glob("*" + ledger_store.SUFFIX))) == 1
        _new_process()
        assert module_ledgers.record_of(copy.deepcopy(module)).steps == 4  # rank 1 reads rank 0's entry
        assert module_ledgers.record_of(copy.deepcopy(other)) is None


def test_the_store_holds_digests_sketches_and_the_ledger_only():
    """No training data: digests, 64 sampled weight values per sketch (released state), the ledger, the names."""
    _bound_and_trained()
    (entry,) = ledger_store.directory().glob("*" + ledger_store.SUFFIX)
    state = torch.load(entry, weights_only=True)
    assert set(state) == {"version", "created", "ledger", "trained", "digests", "sketches"}
    assert state["trained"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(start.numel() <= 64 and path.shape[1] <= 64 for _, start, _, path in state["sketches"])


def test_sketches_are_copies_of_64_values_also_of_float64_weights():
    """A sketch of weights held in float64 on the CPU is a copy (it was a view: the start's sketch followed the
    weights as they trained, and the file would have held the whole parameter)."""
    _bound_and_trained(width=64, dtype=torch.float64)
    (entry,) = ledger_store.directory().glob("*" + ledger_store.SUFFIX)
    sketches = torch.load(entry, weights_only=True)["sketches"]
    assert sketches
    for _, start, end, path in sketches:
        assert start.untyped_storage().nbytes() == end.untyped_storage().nbytes() == 64 * 8
        assert not torch.equal(start, end)  # where the fit started, not where it ended


def _short_fit(seed: int, width: int) -> tuple[dict, nn.Module]:
    """A short fit through module_ledgers' own calls (no Trainer): 12 releases one at a time, the weights moved
    between them (so the store's entry holds its path sketches); its start's weights and the trained module."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 2))
    start = copy.deepcopy(module.state_dict())
    ledger = PrivacyLedger()
    module_ledgers.bind(module, ledger)
    with torch.no_grad():
        for _ in range(12):
            for p in module.parameters():
                p.add_(0.05 * torch.randn(p.shape))
            ledger.record(SIGMA, Q, 1)
    module_ledgers.unbind(module, ledger)
    _new_process()
    return start, module


def _probes(start: dict, end: dict) -> dict[str, nn.Module]:
    """Modules of the related fit's shapes: its weights, weights derived from them, fresh ones."""
    g = torch.Generator().manual_seed(4)
    states = {"the same": end, "halfway": {k: (start[k] + v) / 2 for k, v in end.items()},
              "shrink and perturb": {k: 0.5 * v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in end.items()},
              "seeded alike": start, "seeded otherwise": None}
    out = {}
    for name, state in states.items():
        torch.manual_seed(99)
        out[name] = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
        if state is not None:
            out[name].load_state_dict(state)
    return out


def _lineages(probes: dict[str, nn.Module]) -> dict[str, object]:
    _new_process()
    found = {name: module_ledgers.record_of(module) for name, module in probes.items()}
    return {name: None if record is None else record.state_dict() for name, record in found.items()}


def test_a_store_of_many_unrelated_fits_finds_what_a_store_of_the_related_one_finds(monkeypatch, tmp_path):
    """200 unrelated fits (of the probes' shapes and of others) around the related one: each probe's lineage is the
    one it has in a store holding the related fit alone (the related fit still found: its weights, halfway, shrink
    and perturb; fresh modules take nothing); the lookup's pseudo-inverses run in one thread (lineage.one_thread:
    several threads on a loaded machine made a fit's start against a full store take seconds)."""
    full = ledger_store.directory()
    for seed in range(100):
        _short_fit(1000 + seed, (16, 4, 32)[seed % 3])
    before = set(full.glob("*" + ledger_store.SUFFIX))
    start, related = _short_fit(0, 16)
    (entry,) = set(full.glob("*" + ledger_store.SUFFIX)) - before
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / entry.name).write_bytes(entry.read_bytes())
    for seed in range(100, 200):
        _short_fit(1000 + seed, (16, 4, 32)[seed % 3])
    assert len(list(full.glob("*" + ledger_store.SUFFIX))) == 201
    probes = _probes(start, related.state_dict())

    monkeypatch.setenv(ledger_store.ENV, str(alone))
    expected = _lineages(probes)
    assert {name for name, found in expected.items() if found is not None} == {
        "the same", "halfway", "shrink and perturb"}
    assert all(found is None or sum(e[2] for e in found["entries"]) == 12 for found in expected.values())

    monkeypatch.setenv(ledger_store.ENV, str(full))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    calls = []
    pinv = torch.linalg.pinv
    monkeypatch.setattr(torch.linalg, "pinv", lambda a, *args, **kw: calls.append(torch.get_num_threads()) or pinv(
        a, *args, **kw))
    try:
        assert _lineages(probes) == expected
        assert len(calls) > 100 and set(calls) == {1}  # a least-squares fit per stored parameter, in one thread
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
