"""A fit's start against a filled ledger store (run by hand: ``python benchmarks/store_lookup.py [N ...]``).

When a module is attached for a private fit and no record of this process matches it, module_ledgers.record_of
matches it against every entry of the ledger store (accounting/ledger_store.py): digests, near sketches, and the
path sketches of accounting/lineage.py (a least-squares fit per stored parameter of the module's shapes). This fills
a temporary store (``LIGHTNING_DP_LEDGER_STORE``) with N = 0, 50, 250, 1000 entries written through the library's own
calls (module_ledgers.bind, releases recorded one at a time on weights moved between them so each entry holds up to
8 path sketches, module_ledgers.unbind: what a short private fit leaves), of a few module shapes (the store keeps
its newest 256: beyond that N only costs the writes), then, in a new Python process per N (the store's read is
cached per process), times:

- ``read``: the store's first read (every file loaded);
- ``fresh``: ``record_of`` of a fresh module of the stored shapes (a fit's start; nothing may be found);
- ``again``: the same for a second fresh module in that process (a second fit's start);
- ``derived``: ``record_of`` of a module halfway between one stored fit's start and end (must be found).

and prints cProfile's top entries of ``fresh`` at the largest N.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import cProfile, io, json, pstats, sys, time
import torch
from torch import nn
from lightning_dp.accounting import ledger_store, module_ledgers

def module(seed, width):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))

out = {}
t = time.perf_counter(); ledger_store.read(); out["read"] = time.perf_counter() - t
profile = cProfile.Profile()
t = time.perf_counter(); profile.enable(); found = module_ledgers.record_of(module(10**6, 16)); profile.disable()
out["fresh"] = time.perf_counter() - t
assert found is None, "a fresh module took a stored record"
t = time.perf_counter(); found = module_ledgers.record_of(module(10**6 + 1, 16)); out["again"] = time.perf_counter() - t
assert found is None, "a fresh module took a stored record"
start, end = json.loads(sys.argv[1])
if start is not None:
    half = module(start, 16)
    for p, a, b in zip(half.parameters(), module(start, 16).parameters(), torch.load(end).values()):
        p.data = (a.data + b) / 2
    t = time.perf_counter(); found = module_ledgers.record_of(half); out["derived"] = time.perf_counter() - t
    assert found is not None and found.steps == 12, "a module derived from a stored fit was not found"
text = io.StringIO(); pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(8)
out["profile"] = text.getvalue()
print("RESULT " + json.dumps(out))
'''

WIDTHS = (16, 16, 32, 4)
"""The stored fits' hidden widths, in turn (most alike the timed module's, as a user's repeated fits are)."""


def fill(n: int, keep: str) -> int:
    """Write ``n`` entries (short fits of 12 releases) to the store; the end of the last fit of the timed module's
    shapes saved to ``keep``; returns its seed."""
    import torch
    from torch import nn

    from lightning_dp.accounting import module_ledgers
    from lightning_dp.accounting.ledger import PrivacyLedger

    kept = -1
    for k in range(n):
        torch.manual_seed(k)
        module = nn.Sequential(nn.Linear(8, WIDTHS[k % len(WIDTHS)]), nn.ReLU(), nn.Linear(WIDTHS[k % len(WIDTHS)], 2))
        ledger = PrivacyLedger()
        module_ledgers.bind(module, ledger)
        with torch.no_grad():
            for _ in range(12):
                for p in module.parameters():
                    p.add_(0.05 * torch.randn(p.shape))
                ledger.record(1.0, 0.125, 1)
        module_ledgers.unbind(module, ledger)
        if WIDTHS[k % len(WIDTHS)] == 16:
            torch.save(module.state_dict(), keep)
            kept = k
        module_ledgers._BY_CONTENT.clear()
        module_ledgers._SKETCHES.clear()
    return kept


def main(counts: list[int]) -> None:
    rows = []
    for n in counts:
        with tempfile.TemporaryDirectory() as store:
            os.environ["LIGHTNING_DP_LEDGER_STORE"] = store
            keep = os.path.join(store, "first.pt")
            t = time.perf_counter()
            seed = fill(n, keep)
            filled = time.perf_counter() - t
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
            arg = json.dumps([seed, keep] if n else [None, None])
            done = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.split("RESULT ", 1)[1])
            stored = len([f for f in os.listdir(store) if f.endswith(".ledger")])
            rows.append((n, stored, filled, result))
            print(f"N={n:5d} (files kept {stored:3d}, filled in {filled:6.1f} s): read {result['read']:.3f} s, "
                  f"fresh fit's lookup {result['fresh']:.3f} s, again {result['again']:.3f} s"
                  + (f", derived {result['derived']:.3f} s" if "derived" in result else ""), flush=True)
    print("\ncProfile of the fresh lookup at N =", rows[-1][0])
    print(rows[-1][3]["profile"])


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [0, 50, 250, 1000])
