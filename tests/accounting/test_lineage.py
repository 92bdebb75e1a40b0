"""Weights derived from a private fit continue its record (accounting/lineage.py, module_ledgers.derived; zoo17 l1,
zoo14 t4): an EMA or ``AveragedModel`` kept by a callback, a snapshot saved mid-fit by the user's code, a point
between start and end, a shrink-and-perturb warm start, a task vector, loaded into a fresh module and trained again
privately on the same data, and a soup of two private fits (both records, composed). Judged on the weights a module
holds when it is attached: a fresh module seeded alike or otherwise, weights moved by public data the other way or
their own way, and unrelated fits in one process start their own record."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, data, fit  # noqa: E402

from lightning_dp.accounting import lineage  # noqa: E402


def _fresh(state: dict[str, torch.Tensor]) -> Classifier:
    module = Classifier()
    module.load_state_dict(state)
    return module


class Averaging(pl.Callback):
    """An ``AveragedModel`` of the weights, updated at every batch's end (an EMA when ``decay`` is given)."""

    def __init__(self, decay=None) -> None:
        self.decay, self.average = decay, None

    def on_fit_start(self, trainer, module) -> None:
        self.average = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(self.decay) if self.decay else None)

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.average.update_parameters(module)


class Snapshot(pl.Callback):
    """The user's code keeping a copy of the weights at one step (a state_dict copy, 'the best one so far')."""

    def __init__(self, at: int) -> None:
        self.at, self.state = at, None

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.at:
            self.state = copy.deepcopy(module.state_dict())


@pytest.mark.parametrize("decay", [0.9, None], ids=["EMA", "AveragedModel"])
def test_an_average_kept_along_the_fit_continues_the_record(decay):
    keeper = Averaging(decay)
    assert fit(Classifier(), steps=6, callbacks=[keeper]).ledger.steps == 6
    assert fit(_fresh(keeper.average.module.state_dict()), steps=2).ledger.steps == 8


def test_a_snapshot_saved_mid_fit_by_user_code_continues_the_whole_fit():
    snapshot = Snapshot(at=3)  # the released weights after step 3: declared public for the boundary's rule on state
    assert fit(Classifier(), steps=12, callbacks=[snapshot], public_state=["Snapshot.state"]).ledger.steps == 12
    assert fit(_fresh(snapshot.state), steps=2).ledger.steps == 14


def _trained(steps: int = 4) -> tuple[dict, dict]:
    """(the start, the end) of a private fit of ``steps`` releases."""
    model = Classifier()
    start = copy.deepcopy(model.state_dict())
    assert fit(model, steps=steps).ledger.steps == steps
    return start, model.state_dict()


@pytest.mark.parametrize("derive", [
    lambda start, end, g: {k: (start[k] + v) / 2 for k, v in end.items()},
    lambda start, end, g: {k: 0.5 * v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in end.items()},
    lambda start, end, g: {k: start[k] + 2.0 * (v - start[k]) for k, v in end.items()},
    lambda start, end, g: {k: start[k] + 0.7 * (v - start[k]) for k, v in end.items()},
], ids=["halfway", "shrink and perturb", "task vector twice", "task vector scaled 0.7"])
def test_weights_derived_from_the_trained_ones_continue_the_record(derive):
    start, end = _trained()
    derived = derive(start, end, torch.Generator().manual_seed(4))
    assert fit(_fresh(derived), steps=2).ledger.steps == 6


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_soup_of_two_private_fits_composes_both_records():
    """Two fits with equal σ, q and steps: two runs, both counted (equal entries are not one history)."""
    from lightning_dp.privacy.noise import GaussianNoise

    first, second = Classifier(), Classifier()  # seeded noise: a soup of two noise-dominated moves is found in most
    assert fit(first, steps=3, noise=GaussianNoise(seed=0)).ledger.steps == 3  # draws, not all (≈ 1 in 20 missed)
    assert fit(second, steps=3, sampler_seed=1, noise=GaussianNoise(seed=1)).ledger.steps == 3  # its own record
    soup = {k: (v + second.state_dict()[k]) / 2 for k, v in first.state_dict().items()}
    again = fit(_fresh(soup), steps=2)
    assert again.ledger.steps == 8
    assert len({entry.run for entry in again.ledger.entries}) == 3


def _other_seed() -> Classifier:
    module = Classifier()
    torch.manual_seed(5)
    module.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return module


def _public(rule: int = 0, maximize: bool = False) -> Classifier:
    """A fresh module trained publicly (full-batch SGD on another population; ``rule``: the feature the labels
    follow) before the private fit; ``maximize``: moved the other way."""
    module = Classifier()
    x = data(128, seed=7).tensors[0]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5, maximize=maximize)
    for _ in range(5):
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), (x[:, rule] > 0).long()).backward()
        optimizer.step()
    return module


@pytest.mark.parametrize("fresh", [Classifier, _other_seed, lambda: _public(maximize=True), lambda: _public(rule=2)],
                         ids=["seeded alike", "seeded otherwise", "public, the other way", "public, another task"])
@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_fresh_or_unrelated_module_starts_its_own_record(fresh):
    keeper = Averaging(0.9)
    assert fit(Classifier(), steps=6, callbacks=[keeper]).ledger.steps == 6
    assert fit(fresh(), steps=2).ledger.steps == 2


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_unrelated_fits_in_one_process_each_start_afresh():
    for build in (Classifier, _other_seed, Classifier, _other_seed):
        assert fit(build(), steps=3).ledger.steps == 3
    assert fit(_public(), steps=2).ledger.steps == 2  # the public warm start of the suite's hook tests


def test_follows_the_cone_of_the_fit_only():
    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, generator=g, dtype=torch.float64)
    drift = 0.05 * torch.randn(64, generator=g, dtype=torch.float64)
    states = (start + drift + 0.02 * torch.randn(64, generator=g, dtype=torch.float64)).unsqueeze(0).repeat(4, 1)
    for i in range(1, 4):  # a walk: each state the last plus the drift and noise of its own
        states[i] = states[i - 1] + drift + 0.02 * torch.randn(64, generator=g, dtype=torch.float64)
    path = tuple(states)
    end = path[-1]
    noise = torch.randn(64, generator=g, dtype=torch.float64)
    assert lineage.follows(0.4 * states[1] + 0.6 * states[2], start, path)  # an average along the way
    assert lineage.follows(0.5 * end + 1e-3 * noise, start, path)  # shrink and perturb
    assert lineage.follows(start + 2 * (end - start), start, path)  # a task vector, twice
    assert not lineage.follows(start.clone(), start, path)  # a fresh module seeded alike
    assert not lineage.follows(start - 0.5 * (end - start), start, path)  # the other way
    assert not lineage.follows(start + 10 * (end - start), start, path)  # much farther than the fit went
    assert not lineage.follows(noise, start, path)  # seeded otherwise
    assert not lineage.follows(start + 0.3 * noise * float((end - start).norm()) / 8, start, path)  # its own way


def test_path_sketches_keep_a_few_states_spread_over_the_fit():
    p = torch.zeros(16)
    path = lineage.PathSketches([p], lambda ps: [x.clone().double() for x in ps])
    for step in range(100):
        p.fill_(step)
        path(1)
    kept = [int(s[0]) for s in path.of(p)]
    assert len(kept) <= lineage.KEPT_STATES and kept == sorted(kept) and kept[0] < 30 and kept[-1] > 60


def test_one_thread_sets_torch_to_one_thread_and_restores_it():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with lineage.one_thread():
            assert torch.get_num_threads() == 1
            with lineage.one_thread():  # nested: the outer restores
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
