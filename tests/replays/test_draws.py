"""replays/draws.py on its own: what a recorded run read of the OS's entropy is served again in order to a replayed
one, for the user's code on the block's thread only (the library's own reads, another thread's, and every read
outside a block read the real source), and a generator made inside pickles as a plain ``torch.Generator``."""

from __future__ import annotations

import os
import pickle
import random
import sys
import threading
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draw_helpers  # noqa: E402

from lightning_dp.replays.draws import DrawReads  # noqa: E402
from lightning_dp.secure_random import secure_seed  # noqa: E402


def _draws() -> tuple:
    g = torch.Generator()
    return (np.random.default_rng().normal(size=3).tolist(), random.Random().random(), os.urandom(4),
            random.SystemRandom().random(), g.seed(), torch.seed(), draw_helpers.token(),
            draw_helpers.seeded_generator())


def test_a_replayed_run_reads_what_the_recorded_run_read() -> None:
    reads = DrawReads()
    with reads.recording():
        first = _draws()
    with reads.replayed():
        again = _draws()
    with reads.replayed():
        third = _draws()
    assert first == again == third
    assert _draws() != first, "outside a block the sources read the OS afresh"


def test_reads_past_the_recorded_ones_or_with_other_arguments_read_the_source() -> None:
    reads = DrawReads()
    with reads.recording():
        kept = os.urandom(16)
    with reads.replayed():
        assert os.urandom(8) != kept[:8]  # other arguments: the real source
        assert os.urandom(16) != kept  # (the second read of the source: past the one recorded)


def test_the_librarys_reads_and_another_threads_are_never_replayed() -> None:
    reads = DrawReads()
    theirs: list[bytes] = []
    with reads.recording():
        library = secure_seed()
        thread = threading.Thread(target=lambda: theirs.append(os.urandom(8)))
        thread.start()
        thread.join()
    with reads.replayed():
        assert secure_seed() != library
        thread = threading.Thread(target=lambda: theirs.append(os.urandom(8)))
        thread.start()
        thread.join()
    assert theirs[0] != theirs[1]
    assert not reads.values, "nothing the library or another thread read was recorded"


def test_the_sources_are_put_back_and_a_generator_made_inside_is_a_plain_one() -> None:
    real = (os.urandom, random.seed, torch.seed, torch.Generator, random.Random.__dict__["seed"], draw_helpers.urandom)
    reads = DrawReads()
    with reads.recording():
        g = torch.Generator()
        g.seed()
        drawn = torch.randn(3, generator=g)
    assert (os.urandom, random.seed, torch.seed, torch.Generator, random.Random.__dict__["seed"],
            draw_helpers.urandom) == real
    assert isinstance(g, torch.Generator)
    copy = pickle.loads(pickle.dumps(g))
    assert type(copy) is torch.Generator and torch.equal(torch.randn(3, generator=copy), torch.randn(3, generator=g))
    assert drawn.shape == (3,)


def test_every_family_of_runs_again_that_replays_the_clocks_replays_the_draws() -> None:
    """Wherever a run again reads the clocks the first run read, it reads its draws too (a new family of runs again
    wired with one and not the other would excuse a draw beside the data again)."""
    package = Path(__file__).resolve().parents[2] / "lightning_dp"
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "replays":
            continue
        text = path.read_text()
        assert text.count("ClockReads(") == text.count("DrawReads("), path.name
        assert text.count("clock.next_run()") == text.count("draws.next_run()"), path.name
