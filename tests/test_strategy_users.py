"""DPStrategy with privacy_unit=Users(...) (issue #39): the release against an explicit per-user loop, a user's
influence bounded by C, accounting and reports per user, physical batches, refusals, and the probe's check of the
engines' per-user norms."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, quiet_trainer
from ddp_helpers import ZeroNoise
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PerLayerClipping, PrivacyBudget, PrivacyConfigurationError, Users
from lightning_dp.cli import privacy_summary
from lightning_dp.grad_sample import ghost_units


def _data(n_users: int = 6, heavy: int = 0, seed: int = 0) -> tuple[TensorDataset, list[int]]:
    """Users 0…n−1 with 1 to 4 records each; user 0 also gets ``heavy`` copies of one far-out record."""
    g = torch.Generator().manual_seed(seed)
    ids = [u for u in range(n_users) for _ in range(1 + u % 4)]
    x = torch.randn(len(ids), 4, generator=g)
    y = (x[:, 0] > 0).long()
    if heavy:
        ids = [0] * heavy + ids
        x = torch.cat([torch.full((heavy, 4), 30.0), x])
        y = torch.cat([torch.zeros(heavy, dtype=torch.long), y])
    return TensorDataset(x, y), ids


def _step(dataset, ids, C=0.05, engine="auto", limit=None, clipping=None, seed=0):
    """One step with every user sampled (q = 1), zero noise, SGD(lr = 1): returns Δθ·k = Σ_u clip_C(g_u)."""
    torch.manual_seed(seed)
    model = TinyClassifier(lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    k = len(set(ids))
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=None if clipping else C, clipping=clipping,
                          privacy_unit=Users(ids, users_per_batch=k), noise=ZeroNoise(), sampler_seed=0,
                          per_sample=engine, max_physical_batch_size=limit)
    quiet_trainer(strategy=strategy, max_steps=1).fit(model, DataLoader(dataset, batch_size=len(ids)))
    return [(b - p.detach()) * k for b, p in zip(before, model.parameters())], before, strategy


def _per_user_loop(before, dataset, ids, C):
    """Σ_u clip_C(mean of u's per-example gradients), each example differentiated alone."""
    model = TinyClassifier()
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    x, y = dataset.tensors
    total = [torch.zeros_like(b) for b in before]
    for u in sorted(set(ids)):
        rows = [i for i, v in enumerate(ids) if v == u]
        grads = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
                 for i in rows]
        mean = [sum(g[k] for g in grads) / len(rows) for k in range(len(before))]
        norm = math.sqrt(sum(float(m.pow(2).sum()) for m in mean))
        for k, m in enumerate(mean):
            total[k] += m * min(1.0, C / (norm + 1e-6))
    return total


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
def test_the_release_is_the_per_user_loop(engine):
    dataset, ids = _data()
    got, before, strategy = _step(dataset, ids, engine=engine)
    want = _per_user_loop(before, dataset, ids, 0.05)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    assert strategy.expected_batch_size == 6 and strategy.num_samples == 6 and strategy.sample_rate == 1.0
    assert strategy.privacy_unit == "user" and strategy.ledger.unit == "user"


def test_removing_all_records_of_one_user_moves_the_release_by_at_most_c():
    C = 0.05
    with_user, _, _ = _step(*_data(heavy=12), C=C)  # user 0 with 13 records, 12 of them far out
    dataset, ids = _data(heavy=12)
    keep = [i for i, u in enumerate(ids) if u != 0]
    without, _, _ = _step(TensorDataset(*(t[keep] for t in dataset.tensors)), [ids[i] for i in keep], C=C)
    moved = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(with_user, without)))
    assert 0.5 * C < moved <= C * (1 + 1e-6)


def test_physical_batches_keep_users_whole_and_release_the_same():
    dataset, ids = _data()
    whole, _, _ = _step(dataset, ids)
    for limit in (1, 3):
        split, _, strategy = _step(dataset, ids, limit=limit)
        assert not strategy.private_step.examples_alone
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(whole, split))


def test_per_layer_clipping_of_users():
    dataset, ids = _data()
    got, before, _ = _step(dataset, ids, clipping=PerLayerClipping(0.05), engine="ghost")
    vmap, _, _ = _step(dataset, ids, clipping=PerLayerClipping(0.05), engine="vmap")
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(got, vmap))
    assert all(float(t.norm()) <= 6 * 0.05 / 2 for t in got)  # 6 users, each ≤ C/√P = C/2 per tensor


def test_the_accounting_the_logs_and_the_summary_are_per_user(tmp_path, caplog):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=g)
    dataset = TensorDataset(x, (x[:, 0] > 0).long())
    ids = [i // 4 for i in range(400)]  # 100 users of 4 records
    strategy = DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=10, max_examples_per_user=2),
                          sampler_seed=0)
    logger = CSVLogger(tmp_path, name="users")
    with caplog.at_level("INFO"):
        quiet_trainer(strategy=strategy, max_steps=20, logger=logger, log_every_n_steps=5,
                      callbacks=[PrivacyBudget(delta=1e-5)]).fit(TinyClassifier(), DataLoader(dataset, batch_size=7))
    assert (strategy.num_samples, strategy.expected_batch_size, strategy.sample_rate) == (100, 10.0, 0.1)
    assert strategy.steps_per_epoch == 10
    assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in strategy.ledger] == [(1.0, 0.1, 20)]
    assert "per user" in repr(strategy.ledger) and "ε per user" in caplog.text
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("privacy/epsilon_per_user")]
    assert rows and rows[-1]["privacy/epsilon_per_user"] == rows[-1]["privacy/epsilon"]
    summary = privacy_summary(strategy, 1e-5)
    assert "per user" in summary and "N = 100 users" in summary


def test_refusals_name_the_fix():
    dataset, ids = _data()
    with pytest.raises(PrivacyConfigurationError, match="exceeds the 6 users"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=7)),
                      max_steps=1).fit(TinyClassifier(), DataLoader(dataset, batch_size=4))
    banded = DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=2), noise="banded", bands=2)
    with pytest.raises(PrivacyConfigurationError, match="use noise='gaussian'"):
        quiet_trainer(strategy=banded, max_steps=1).fit(TinyClassifier(), DataLoader(dataset, batch_size=4))
    example_level = DPStrategy(noise_multiplier=1.0).private_step.state_dict()
    users = DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=2))
    with pytest.raises(PrivacyConfigurationError, match="per example, this run per user"):
        users.private_step.load_state_dict(example_level)


def test_the_probe_checks_the_engines_norms_of_a_users_records(monkeypatch):
    """A ghost engine that forgets the cross terms between a user's records (the sum of their squared norms
    instead of the squared norm of their sum) is refused by the first step's probe before any release."""
    def forgetful(reps, groups, units, rows):
        out = None
        for r in reps:
            own = ghost_units.cross_term(r, r, rows)
            part = torch.zeros(units, dtype=own.dtype).index_add_(0, groups, own)
            out = part if out is None else out + part
        return out

    monkeypatch.setattr("lightning_dp.grad_sample.ghost.unit_sq_norms", forgetful)
    dataset, ids = _data()
    with pytest.raises(PrivacyConfigurationError, match="clipped the first step's examples wrongly"):
        _step(dataset, ids, engine="ghost")


def test_a_modules_ledger_is_not_continued_in_another_unit():
    dataset, ids = _data()
    model = TinyClassifier()
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(model, DataLoader(dataset, batch_size=4))
    users = DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=2))
    with pytest.raises(PrivacyConfigurationError, match="accounted per example; a run per user cannot continue it"):
        quiet_trainer(strategy=users, max_steps=1).fit(model, DataLoader(dataset, batch_size=4))
    other, (dataset, ids) = TinyClassifier(), _data(seed=1)  # other records: the module's ledger alone, not the data's
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, privacy_unit=Users(ids, users_per_batch=2)),
                  max_steps=1).fit(other, DataLoader(dataset, batch_size=4))
    with pytest.raises(PrivacyConfigurationError, match="accounted per user; a run per example cannot continue it"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(other,
                                                                                 DataLoader(dataset, batch_size=4))


def test_the_datas_record_is_continued_per_user_after_per_user():
    """A fresh module on records earlier fits trained on continues their releases (accounting/data_ledgers.py): per
    user after per user (the fresh ledger takes the unit it continues)."""
    dataset, ids = _data()
    _, _, first = _step(dataset, ids)
    _, _, second = _step(dataset, ids, seed=1)
    assert second.ledger.unit == "user" and second.ledger.steps == first.ledger.steps + 1 == 2


def _epsilon(entries):
    from lightning_dp.accounting import ledger_epsilon
    from lightning_dp.accounting.ledger import PrivacyLedger

    ledger = PrivacyLedger()
    for sigma, q in entries:
        ledger.record(sigma, q)
    return ledger_epsilon(ledger, 1e-5)


@pytest.mark.parametrize("one_record_each", [False, True])
def test_a_fit_per_user_after_fits_per_example_on_its_records_charges_them_with_the_group_size(one_record_each):
    """Examples, then users: the per-example releases count per user as a group of the most records one user holds
    (σ / m at the chance 1 − (1 − q)^m that the user takes part): ε per user is not the plain sum unless each user
    has one record. Was refused."""
    dataset, ids = _data()  # users with 1 to 4 records: m = 4
    if one_record_each:
        ids = list(range(len(ids)))
    n, m = len(ids), 1 if one_record_each else 4
    example = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0)
    quiet_trainer(strategy=example, max_steps=1).fit(TinyClassifier(), DataLoader(dataset, batch_size=4))
    assert example.ledger.unit == "example" and example.sample_rate == pytest.approx(4 / n)
    _, _, users = _step(dataset, ids, C=1.0)  # q = 1, σ = 1
    q = 1 - (1 - 4 / n) ** m
    assert users.ledger.unit == "user" and users.ledger.steps == 2
    assert [(e.noise_multiplier, e.sample_rate) for e in users.ledger.entries] == [
        (pytest.approx(2.0 / m), pytest.approx(q)), (1.0, 1.0)]
    from lightning_dp.accounting import ledger_epsilon

    charged, plain = ledger_epsilon(users.ledger, 1e-5), _epsilon([(2.0, 4 / n), (1.0, 1.0)])
    assert charged == pytest.approx(_epsilon([(2.0 / m, q), (1.0, 1.0)]))
    assert charged == pytest.approx(plain) if one_record_each else charged > 1.2 * plain


def test_a_fit_per_example_after_fits_per_user_on_its_records_is_refused():
    """Users, then examples: refused with the fixes named, for a fresh module and for one whose own ledger already
    holds releases per example (whose ledger was marked "example" holding the per-user releases, silently)."""
    dataset, ids = _data()
    _step(dataset, ids)
    with pytest.raises(PrivacyConfigurationError, match=r"trained per user .* Train this fit per user as well"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(TinyClassifier(),
                                                                                 DataLoader(dataset, batch_size=4))
    model, (other, _) = TinyClassifier(), _data(seed=3)
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(model, DataLoader(other, batch_size=4))
    assert model_ledger_unit(model) == "example"
    with pytest.raises(PrivacyConfigurationError, match="forget_data_releases"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(model,
                                                                                 DataLoader(dataset, batch_size=4))


def model_ledger_unit(model):
    from lightning_dp.accounting import module_ledgers

    return module_ledgers.record_of(model).unit


def test_a_plain_pytorch_loop_trains_per_user():
    """PrivateStep without Lightning: begin() takes the sampled records and their users from the sampler."""
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    dataset, ids = _data(n_users=20)
    torch.manual_seed(0)
    model = TinyClassifier().net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(1.0, 0.5, GaussianNoise(seed=0), sampler_seed=0, privacy_unit=Users(ids, users_per_batch=4))
    step.attach(model, optimizer)
    loader = step.poisson_loader(DataLoader(dataset, batch_size=8))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    for x, y in loader:
        step.begin()
        F.cross_entropy(model(x), y).backward()
        step.release()
        optimizer.step()
        optimizer.zero_grad()
    assert step.ledger.steps == step.plan.steps_per_epoch == 5 and step.ledger.unit == "user"
    assert (step.plan.num_samples, step.plan.expected_batch_size, step.plan.sample_rate) == (20, 4.0, 0.2)
    with pytest.raises(RuntimeError, match="needs the batch's records"):
        step.begin(3)
    step.detach()
