"""The ledger store's key (accounting/store_key.py): the data records' row digests are written keyed, so whoever reads
the store's files without the key cannot test a candidate row's membership (zoo34 L27: the unkeyed digests found
200 of 200 members and rebuilt every two-column row of integers by enumeration); the key file is created once, mode
0600, and reused, so fits on the same records still continue one ledger; records of an earlier version (unkeyed) are
read, matched and written again keyed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.accounting import data_ledgers, data_store, ledger_store
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.record_checks.row_lineage import dataset_rows
from lightning_dp.record_checks.stored_records import row_digests
from lightning_dp.record_checks.stored_sources import identifying_rows


def _people(n: int = 300) -> torch.Tensor:
    """Rows of two integer columns (an age, an income): few enough values to enumerate."""
    g = torch.Generator().manual_seed(4)
    return torch.stack([torch.randint(18, 91, (n,), generator=g), torch.randint(10, 201, (n,), generator=g)], 1).float()


def _public_digests(rows: torch.Tensor) -> dict:
    """Every per-row digest anyone can compute of candidate ``rows`` with the library's public functions (the kinds
    that do not depend on the other rows)."""
    found = {**identifying_rows(TensorDataset(rows)), **dataset_rows(TensorDataset(rows))}
    found["row_digests"] = row_digests(rows)
    return {kind: np.asarray(d, dtype=np.uint64) for kind, d in found.items()}


def _stored_values(store: Path) -> set[int]:
    """Every digest the store's data records hold, read as an attacker does: the files, without the key."""
    values: set[int] = set()
    for path in store.glob("*" + data_store.SUFFIX):
        for _, digests in torch.load(path, weights_only=True)["digests"]:
            values |= set(digests.numpy().view(np.uint64).tolist())
    return values


def _found(rows: torch.Tensor, stored: set[int], transform=lambda d: d) -> int:
    """How many of ``rows`` have a digest (of any kind) among ``stored``."""
    hit = np.zeros(len(rows), dtype=bool)
    for d in _public_digests(rows).values():
        hit |= np.isin(transform(d), np.fromiter(stored, dtype=np.uint64, count=len(stored)))
    return int(hit.sum())


def test_without_the_key_the_stored_digests_test_no_members_and_with_it_they_still_identify_the_records():
    """zoo34 L27: a fit on 200 of 300 rows; the store's files and the library's public code, without the key, find
    none of the members (unkeyed: all 200). With the key the same digests identify them (the ledger's matching)."""
    x = _people()
    members, outsiders = x[:200], x[200:]
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=strategy, max_steps=3).fit(
        TinyClassifier(d_in=2), DataLoader(TensorDataset(members, (members[:, 1] > 80).long()), batch_size=20))
    store = ledger_store.directory()
    stored = _stored_values(store)
    assert stored, "the fit wrote its data record"
    assert _found(members, stored) == 0
    assert _found(outsiders, stored) == 0

    from lightning_dp.accounting import store_key

    secret = (store / store_key.FILE).read_bytes()
    ordered = members.sort(1).values  # an outsider equal to a member, or to one in another column order
    duplicates = sum(bool((ordered == row.sort().values).all(1).any()) for row in outsiders)
    assert _found(members, stored, lambda d: store_key.keyed(d, secret)) == 200
    assert _found(outsiders, stored, lambda d: store_key.keyed(d, secret)) == duplicates


def test_the_key_file_is_created_once_with_mode_0600_and_read_by_another_process():
    from lightning_dp.accounting import store_key

    where = store_key.path()
    assert where == ledger_store.directory() / store_key.FILE and not where.exists()
    first = store_key.key()
    assert len(first) == store_key.SIZE and stat.S_IMODE(where.stat().st_mode) == 0o600
    assert store_key.key() == first
    digests = np.arange(1, 1000, dtype=np.uint64)
    again = subprocess.run([sys.executable, "-c", "import numpy as np, sys\n"
                            "from lightning_dp.accounting import store_key\n"
                            "sys.stdout.write(store_key.keyed(np.arange(1, 1000, dtype=np.uint64), store_key.key())"
                            ".tobytes().hex())"], capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert again.returncode == 0, again.stderr
    assert np.array_equal(np.frombuffer(bytes.fromhex(again.stdout), dtype=np.uint64),
                          store_key.keyed(digests, first))
    other = store_key.keyed(digests, bytes(32))
    assert not np.isin(other, store_key.keyed(digests, first)).any()  # another key: unrelated values


def test_processes_racing_to_create_the_key_agree_and_a_key_being_written_is_waited_for(monkeypatch, tmp_path):
    from lightning_dp.accounting import store_key

    monkeypatch.setenv(store_key.ENV, str(tmp_path / "race" / "key"))
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(store_key.key())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    slow = tmp_path / "slow.key"
    slow.touch(mode=0o600)  # created by another process that has not written it yet
    monkeypatch.setenv(store_key.ENV, str(slow))
    writer = threading.Timer(0.2, lambda: slow.write_bytes(b"k" * store_key.SIZE))
    writer.start()
    try:
        assert store_key.key() == b"k" * store_key.SIZE
    finally:
        writer.join()


def _registered(rows: torch.Tensor, run: str, steps: int = 5) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.run = run
    ledger.record(1.0, 0.1, steps)
    data_ledgers.register(data_ledgers.data_use(TensorDataset(rows)), ledger)
    data_ledgers.persist(ledger)
    return ledger


def test_a_key_named_by_the_environment_is_used_and_the_records_still_match(monkeypatch, tmp_path):
    """``LIGHTNING_DP_LEDGER_KEY``: a store others can read, the key kept elsewhere; a new process's fit on the same
    rows continues the ledger (compose)."""
    from lightning_dp.accounting import store_key

    monkeypatch.setenv(data_store.ENV, "compose")
    monkeypatch.setenv(store_key.ENV, str(tmp_path / "private" / "mine.key"))
    x = torch.randn(120, 5, generator=torch.Generator().manual_seed(1))
    _registered(x, "first", 7)
    assert (tmp_path / "private" / "mine.key").exists() and not (ledger_store.directory() / store_key.FILE).exists()
    data_ledgers._RELEASES.clear()  # a new process: the store alone holds the fit
    ledger = PrivacyLedger()
    data_ledgers.continue_on_data(ledger, data_ledgers.data_use(TensorDataset(x.clone())))
    assert ledger.steps == 7
    monkeypatch.setenv(store_key.ENV, str(tmp_path / "another.key"))  # the key replaced: the record is not found
    with pytest.warns(RuntimeWarning, match="keyed with another key"):
        assert data_ledgers.stored_uses() == []


def test_an_unreadable_key_stops_the_data_records_with_a_warning_and_never_the_fit(monkeypatch, tmp_path):
    from lightning_dp.accounting import store_key

    monkeypatch.setattr(store_key, "_WAIT", 0.05)
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"too short")
    monkeypatch.setenv(store_key.ENV, str(bad))
    with pytest.warns(RuntimeWarning, match="key .* cannot be read or created"):
        _registered(torch.randn(50, 3), "bad")
    store = ledger_store.directory()
    assert not store.exists() or not list(store.glob("*" + data_store.SUFFIX))  # nothing written, nothing raised


@pytest.mark.parametrize("version", [1, 2])
def test_a_record_of_an_earlier_version_is_matched_and_written_again_keyed(monkeypatch, version):
    """A store written before the key (versions 1 and 2: the digests as computed) is read as it was: a fit on the
    same rows continues its ledger; the file is written again as version 3, its digests keyed, its time kept."""
    from lightning_dp.accounting import store_key

    monkeypatch.setenv(data_store.ENV, "compose")
    x = torch.randn(150, 6, generator=torch.Generator().manual_seed(2))
    digests = data_ledgers.data_use(TensorDataset(x)).digests
    where = ledger_store.directory()
    where.mkdir(parents=True, exist_ok=True)
    old = PrivacyLedger()
    old.run = "old"
    old.record(1.0, 0.1, 9)
    state = {"version": version, "created": time.time() - 60, "ledger": old.state_dict(), "limit": -1,
             "digests": [[repr(kind), torch.from_numpy(d.view(np.int64))] for kind, d in digests.items()]}
    if version == 2:
        state["partition"] = None
    path = where / f"data-old{data_store.SUFFIX}"
    torch.save(state, path)
    os.utime(path, ns=(time.time_ns(), time.time_ns() - 60 * 10**9))
    written = path.stat().st_mtime_ns
    assert _found(x, _stored_values(where)) == 150  # the weakness of the old format

    ledger = PrivacyLedger()
    data_ledgers.continue_on_data(ledger, data_ledgers.data_use(TensorDataset(x.clone())))
    assert ledger.steps == 9
    now = torch.load(path, weights_only=True)
    assert now["version"] == 3 and now["key"] == store_key.key_id(store_key.key())
    assert path.stat().st_mtime_ns == written
    assert _found(x, _stored_values(where)) == 0
    data_store._CACHE.update(where=None, loaded={})  # a new process reads the file written again
    data_ledgers._RELEASES.clear()
    again = PrivacyLedger()
    data_ledgers.continue_on_data(again, data_ledgers.data_use(TensorDataset(x.clone())))
    assert again.steps == 9


def test_an_earlier_versions_partition_into_users_is_keyed_when_read_and_still_covers_the_same_users(monkeypatch):
    """A version 2 record of a fit per user holds its partition's digests unkeyed: read, they are keyed, and the same
    users in a new fit are still one earlier user each (k = 1)."""
    from lightning_dp.accounting.unit_partitions import UserGroups, covering
    from lightning_dp.units import Users

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    groups = UserGroups(Users([r // 4 for r in range(64)], users_per_batch=1), TensorDataset(x))
    partition = groups.partition()
    where = ledger_store.directory()
    where.mkdir(parents=True, exist_ok=True)
    old = PrivacyLedger()
    old.run, old.unit = "old", "user"
    old.record(1.0, 0.05, 8)
    digests = data_ledgers.data_use(TensorDataset(x)).digests
    torch.save({"version": 2, "created": time.time(), "ledger": old.state_dict(), "limit": -1,
                "partition": [[repr(kind), torch.from_numpy(d.view(np.int64)), torch.from_numpy(u.astype(np.int32))]
                              for kind, (d, u) in partition.digests.items()],
                "digests": [[repr(kind), torch.from_numpy(d.view(np.int64))] for kind, d in digests.items()]},
               where / f"data-old{data_store.SUFFIX}")
    [(_, _, _, _, stored)] = data_store.read()
    assert stored.keyed and stored.digests.keys() == partition.digests.keys()
    assert not any(np.isin(stored.digests[k][0], partition.digests[k][0]).any() for k in partition.digests)
    again = UserGroups(Users([r // 4 for r in range(64)], users_per_batch=1), TensorDataset(x.clone()))
    assert covering(stored, again.partition()) == 1
    regrouped = UserGroups(Users([(r + 2) // 4 for r in range(64)], users_per_batch=1), TensorDataset(x.clone()))
    assert covering(stored, regrouped.partition()) == 4
