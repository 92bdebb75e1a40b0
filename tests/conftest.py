"""Shared fixtures: tiny LightningModules written the way a user would write them."""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Callable, TypeVar, Union

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
torch.set_num_threads(1)
os.environ["LIGHTNING_DP_LEDGER_STORE"] = os.path.join(tempfile.gettempdir(), f"lightning_dp_ledgers_{os.getpid()}")
atexit.register(shutil.rmtree, os.environ["LIGHTNING_DP_LEDGER_STORE"], True)  # this process's store goes with it


def _shuffle(items: list, seed: str) -> None:
    """Run the suite in a random order (``LIGHTNING_DP_SHUFFLE=<seed>``): the files shuffled, then the tests inside
    each file, so state one test leaves behind for another (a registry, a patched class, a global) shows."""
    import random

    rng = random.Random(seed)
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(files)
    rng.shuffle(order)
    items[:] = []
    for name in order:
        rng.shuffle(files[name])
        items.extend(files[name])


_MODULE_GENERATORS: dict[str, list[tuple[object, object]]] = {}


def _state(generator: object) -> object:
    """A random generator's state (NumPy's, Python's, torch's), or None for anything else."""
    import random

    import numpy as np

    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, (np.random.RandomState, random.Random)):
        return generator.getstate() if isinstance(generator, random.Random) else generator.get_state()
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    return None


def _restore(generator: object, state: object) -> None:
    import random

    import numpy as np

    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.set_state(state)


@pytest.fixture(autouse=True)
def _same_randomness_in_any_order(request):
    """Every test starts from the same random state whatever ran before it in its process: pytest-xdist hands a
    file's tests to either worker in any order, so a test drawing from its module's generator (``RNG =
    np.random.default_rng(0)`` at the top of the file) or from torch's global one saw data that depended on which
    tests ran before it — statistical assertions then failed by chance (test_imputed_cells, 2026-11-30). Module-level
    generators are put back to their state as the module's first test began; torch's, NumPy's and Python's global
    generators are seeded from the test's id."""
    import random
    import zlib

    import numpy as np

    module = request.module
    if module is not None:
        saved = _MODULE_GENERATORS.get(module.__name__)
        if saved is None:
            saved = _MODULE_GENERATORS[module.__name__] = [
                (g, state) for g in list(vars(module).values()) for state in [_state(g)] if state is not None]
        for generator, state in saved:
            _restore(generator, state)
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LIGHTNING_DP_SHUFFLE"):
        _shuffle(items, os.environ["LIGHTNING_DP_SHUFFLE"])
    if os.environ.get("LIGHTNING_DP_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set LIGHTNING_DP_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


class TinyClassifier(pl.LightningModule):
    """A plain user module: mean cross-entropy, SGD."""

    def __init__(self, d_in: int = 4, n_classes: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, n_classes))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_loader(n: int = 200, d_in: int = 4, batch_size: int = 20, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def quiet_trainer(**kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


T = TypeVar("T")


def at_freed_address(freed: Union[int, Callable[[], int]], make: Callable[[], T], *, tries: int = 1,
                     count: int = 1000) -> tuple[T, bool]:
    """A new object of ``make`` at a freed object's address, for the tests of what is told apart by identity, not by
    ``id`` alone: CPython hands a freed object's memory to the next one of its size, so ``count`` objects are made
    (all held while looking) until one has the freed id. ``freed``: that id (its object dropped already), or a
    function that makes, uses and drops the object and returns its id, called again for each of ``tries`` tries.

    Returns the object at the freed address and True; else (the address never came back: the code under test holds
    the freed object, or the allocator placed it elsewhere) the first object made in the last try, and False."""
    for _ in range(tries):
        address = freed if isinstance(freed, int) else freed()
        gc.collect(1)  # one held only by a young reference cycle (a recursive closure's locals) is freed now
        made = [make() for _ in range(count)]
        again = next((obj for obj in made if id(obj) == address), None)
        if again is not None:
            return again, True
    return made[0], False


@pytest.fixture(autouse=True)
def _exchange_masks_seeded(request):
    """The exchange's secret masks (record_checks/outside_records.py: drawn in production from a generator seeded from
    the operating system) drawn from the test's id, through the test hook ``SECRET.reseed``: a judge's catch of a
    statistic that only most exchanges set apart is then the same at every run of the suite, never a flake."""
    import zlib

    from lightning_dp.record_checks.outside_records import SECRET

    SECRET.reseed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _no_broadcast_site_mode_left_behind():
    """The broadcast sites' TorchFunctionMode (grad_sample/capture/broadcast_sites.py) must end with its step: one left
    active would intercept every later torch call of the process. Fails the test that leaked it."""
    yield
    from torch.overrides import _get_current_function_mode_stack

    from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites

    left = [m for m in _get_current_function_mode_stack() if isinstance(m, BroadcastSites)]
    for mode in reversed(left):
        mode.close()
    assert not left, "a step left the broadcast-site mode active"


@pytest.fixture
def console_lines(caplog):
    """caplog holding the INFO lines of Lightning's rank-zero console (its logger does not propagate to the root)."""
    console = logging.getLogger("pytorch_lightning")
    console.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO"):
            yield caplog
    finally:
        console.removeHandler(caplog.handler)


@pytest.fixture
def without_data_ledger(monkeypatch):
    """Opt out of the record the data carry (accounting/data_ledgers.py), which every other test keeps, as users get
    it: a fit on records an earlier fit of the test trained on starts its ledger without their releases. Only for a
    test that must see a fit's own releases alone and cannot give its fits disjoint data (say why at its use)."""
    from lightning_dp.accounting import data_ledgers

    monkeypatch.setattr(data_ledgers, "continue_on_data", lambda ledger, use, *_: None)
    yield


@pytest.fixture(autouse=True)
def _data_record_per_test():
    """The record of the releases made on each dataset (accounting/data_ledgers.py) is on in every test, as for users
    (``without_data_ledger`` opts out), and cleared after each test: a test stands for a process of its own, and the
    suite's tests fit the same seeded data, which the data's record would compose across tests."""
    yield
    from lightning_dp.accounting import data_ledgers

    data_ledgers._clear()
    from lightning_dp.record_checks.released_transforms import forget_transforms

    forget_transforms()  # the DP preprocessors' transforms noted (record_checks/released_transforms.py)


@pytest.fixture(autouse=True)
def _each_test_its_own_process_history():
    """The module ledgers' process-wide records of trained weights (accounting/module_ledgers.py: contents, near
    sketches, the sketches along each fit) are cleared after each test: a test stands for a process of its own, and
    the suite's many fits of one seeded model on one task would otherwise be taken for each other's lineage
    (weights moved from a fit's start along its move continue its record, by design)."""
    yield
    import sys

    ledgers = sys.modules.get("lightning_dp.accounting.module_ledgers")
    if ledgers is not None:
        ledgers._BY_CONTENT.clear()
        ledgers._SKETCHES.clear()


_STORES = itertools.count()


@pytest.fixture(autouse=True)
def _each_test_its_own_ledger_store(tmp_path_factory, monkeypatch):
    """The ledger store (accounting/ledger_store.py, on disk) is a directory of each test's own (made when a fit
    writes to it; the processes a test starts inherit it): never the real home's, and never an earlier test's, whose
    fits of the same seeded models would otherwise continue into this test's ledgers."""
    store = tmp_path_factory.getbasetemp() / "ledgers" / str(next(_STORES))
    monkeypatch.setenv("LIGHTNING_DP_LEDGER_STORE", str(store))


# One child process per import order, shared by the tests of that order (tests/test_registry.py and
# tests/examples/test_main_job.py): each case prints one line, "<case> <result...>", and each test asserts its own.
STRATEGY_CHILD = """
{imports}
for _name, _devices in {cases!r}:
    try:
        _s = {trainer}(strategy=_name, accelerator="cpu", devices=_devices, logger=False,
                       enable_progress_bar=False).strategy
        print(_name, type(_s).__module__, type(_s).__name__, _s.noise_multiplier, _s.max_grad_norm)
    except Exception as _err:  # the case's own line says what broke; the others still run
        print(_name, "ERROR", repr(_err).replace(chr(10), " "))
{after}
"""


def strategies_built_in_a_fresh_process(imports: str, trainer: str, cases: tuple[tuple[str, int], ...],
                                        after: str = "") -> tuple[dict[str, list[str]], subprocess.CompletedProcess]:
    """``trainer(strategy=name, devices=devices)`` for each case, in one fresh interpreter that ran ``imports``
    first, then ``after``: {name: [strategy module, class, σ, C]} (or [\"ERROR\", ...]) and the finished process.
    One process per distinct call in the session (import orders need a fresh interpreter; their cases share it)."""
    key = (imports, trainer, cases, after)
    if key not in _STRATEGY_CHILDREN:
        code = STRATEGY_CHILD.format(imports=imports, trainer=trainer, cases=cases, after=after)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        names = {name for name, _ in cases}
        lines = [line.split() for line in proc.stdout.splitlines()]
        _STRATEGY_CHILDREN[key] = ({words[0]: words[1:] for words in lines if words and words[0] in names}, proc)
    return _STRATEGY_CHILDREN[key]


_STRATEGY_CHILDREN: dict = {}


@pytest.fixture(scope="session")
def pytorch_lightning_imported_first():
    """``import pytorch_lightning`` then ``import lightning_dp`` in a fresh process (a user's script): the "dp"
    strategy built, then Lightning's LeafSpec deprecation provoked and a warning of our own issued."""
    return strategies_built_in_a_fresh_process(
        "import warnings\nimport pytorch_lightning as pl\nimport lightning_dp", "pl.Trainer", (("dp", 1),),
        after="from pytorch_lightning.utilities._pytree import _tree_flatten\n_tree_flatten([1, 2])\n"
              "warnings.warn('a warning of our own', UserWarning)")


@pytest.fixture(scope="session")
def strategies_built():
    """:func:`strategies_built_in_a_fresh_process`, for the tests of import orders."""
    return strategies_built_in_a_fresh_process
