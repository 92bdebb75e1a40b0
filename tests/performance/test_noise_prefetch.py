"""Noise drawn ahead (issue 38): the same distribution and stream, each draw used at most once, unused draws dropped."""

import copy
import math
import pickle
import threading

import pytest
import torch
from scipy import stats
from torch import nn

from lightning_dp.privacy.noise import GaussianNoise

from lightning_dp.privacy.privatizer import Privatizer

from lightning_dp.privacy.release import MechanismRequest
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.privacy.csprng import SecureGaussianNoise
from lightning_dp.grad_sample import ClippedBatch
from lightning_dp.performance.noise_prefetch import NoisePrefetcher

SENTINEL = 1.0e6


def _release(priv, params, value=0.0, request=MechanismRequest(), sigma=1.0, C=1.0, B=1.0):
    sums = {p: torch.full(p.shape, value, dtype=p.dtype) for p in params}
    squares = {p: torch.zeros(p.shape) for p in params} if request.second_moment else None
    return priv.privatize(ClippedBatch(sums, squares, torch.zeros(0), 0), params, request, sigma, C, B)


def _grads(params):
    return torch.cat([p.grad.flatten() for p in params]).clone()


def _sentinel_draws(noise, monkeypatch):
    """Every draw made ahead is SENTINEL (a draw at the call stays Gaussian): where it shows, a prefetched draw was
    used."""
    made = []

    def draw(self, key):
        made.append(key)
        return [torch.full((d.size,), SENTINEL, dtype=d.dtype) for d in key[2]]

    _scripted(noise, draw, monkeypatch)
    return made


def _scripted(noise, draw, monkeypatch):
    """``noise`` made an instance of a subclass drawing ahead with ``draw`` (a scripted mechanism is the test's own:
    a method set on a library mechanism's instance is refused, lightning_dp/sealed_noise.py)."""
    monkeypatch.setattr(noise, "__class__", type("Scripted", (type(noise),), {"_draw_key": draw}))


# ----------------------------------------------------------------------------- the same stream and distribution
@pytest.mark.parametrize("second_moment", [False, True])
@pytest.mark.parametrize("shapes", [[(300, 400)], [(3, 5)] * 40 + [(70000,)], [(7,)]], ids=["one", "many", "tiny"])
def test_seeded_stream_is_the_same_with_and_without_prefetch(shapes, second_moment):
    request = MechanismRequest(second_moment=second_moment)

    def run(prefetch):
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        priv = Privatizer(GaussianNoise(seed=5, prefetch=prefetch))
        out = []
        for t in range(4):
            rel = _release(priv, params, float(t), request, B=8.0)
            out.append(_grads(params))
            if second_moment:
                out.append(torch.cat([v.flatten() for v in rel.second_moment.values()]))
        priv.noise.close()
        return out

    ahead, now = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(ahead, now))


def test_releases_take_the_draws_made_ahead(monkeypatch):
    """The positive control of the sentinel tests below: from the second release on, the noise is the draw made
    during the previous step (here SENTINEL), and it is used exactly once per release."""
    params = [nn.Parameter(torch.zeros(1000))]
    noise = GaussianNoise(seed=0, prefetch=True)
    made = _sentinel_draws(noise, monkeypatch)
    priv = Privatizer(noise)
    _release(priv, params)
    noise._prefetcher._job.done.wait()
    assert not (_grads(params) == SENTINEL).any() and noise._prefetcher.pending == 1 and len(made) == 1
    _release(priv, params)
    noise._prefetcher._job.done.wait()
    assert (_grads(params) == SENTINEL).all() and len(made) == 2  # the draw made ahead, then the next one drawn
    noise.close()


def test_prefetched_noise_has_unit_variance_per_coordinate_and_fresh_draws_each_step():
    """Per coordinate over 600 releases: variance σ²C²/B² within a chi-square bound (Bonferroni over coordinates),
    and consecutive draws uncorrelated (lag-1 correlation of every coordinate, pooled)."""
    params = [nn.Parameter(torch.zeros(64))]
    priv = Privatizer(GaussianNoise(prefetch=True))
    steps, sigma, C, B = 600, 0.8, 1.5, 4.0
    z = torch.stack([(_release(priv, params, sigma=sigma, C=C, B=B), _grads(params))[1] for _ in range(steps)])
    priv.noise.close()
    z = z.double() / (sigma * C / B)
    assert priv.noise._prefetcher is not None  # prefetched from the second release on
    lo, hi = stats.chi2.ppf([1e-4 / 128, 1 - 1e-4 / 128], steps)
    per_coordinate = z.pow(2).sum(0)
    assert ((lo < per_coordinate) & (per_coordinate < hi)).all()
    lag1 = (z[1:] * z[:-1]).mean()  # ≈ N(0, 1/((steps-1)·64)) when consecutive draws are independent
    assert abs(lag1.item()) < 4.5 / math.sqrt((steps - 1) * 64)
    assert not torch.equal(z[1], z[2])


def test_secure_prefetched_noise_has_unit_variance_and_is_fresh():
    params = [nn.Parameter(torch.zeros(20000))]
    noise = SecureGaussianNoise(prefetch=True)
    priv = Privatizer(noise)
    draws = []
    for _ in range(3):
        _release(priv, params, B=2.0)
        draws.append(_grads(params).double() * 2.0)
    assert noise._prefetcher.pending == 1  # the last two releases took draws made ahead
    noise.close()
    lo, hi = stats.chi2.ppf([1e-4 / 2, 1 - 1e-4 / 2], 20000)
    for z in draws[1:]:
        assert lo < z.pow(2).sum().item() < hi
    r = torch.corrcoef(torch.stack(draws))
    assert (r - torch.eye(3, dtype=r.dtype)).abs().max() < 4.5 / math.sqrt(20000)


def test_secure_releases_take_the_draws_made_ahead(monkeypatch):
    noise = SecureGaussianNoise(prefetch=True)
    _scripted(noise, lambda self, key: [torch.full((size,), SENTINEL, dtype=dtype) for dtype, size in key[1]],
              monkeypatch)
    params = [nn.Parameter(torch.zeros(100))]
    priv = Privatizer(noise)
    _release(priv, params)
    assert not (_grads(params) == SENTINEL).any()
    _release(priv, params)
    assert (_grads(params) == SENTINEL).all()
    noise.close()


def test_banded_stream_is_the_same_with_and_without_prefetch():
    def run(prefetch):
        noise = BandedToeplitzNoise(bands=3, seed=11, prefetch=prefetch)
        params = [nn.Parameter(torch.zeros(50, 20)), nn.Parameter(torch.zeros(9))]
        priv = Privatizer(noise)
        out = [(_release(priv, params), _grads(params))[1] for _ in range(5)]
        noise.close()
        return out

    ahead, now = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(ahead, now))


# ----------------------------------------------------------------------------- draws never reused
@pytest.mark.parametrize("change", ["shape", "dtype", "count", "std"])
def test_a_release_of_other_tensors_or_std_drops_the_draws_made_ahead(change, monkeypatch):
    params = [nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(10))]
    noise = GaussianNoise(seed=0, prefetch=True)
    _sentinel_draws(noise, monkeypatch)
    priv = Privatizer(noise)
    _release(priv, params)
    sigma = 1.0
    if change == "shape":
        params = [nn.Parameter(torch.zeros(101)), params[1]]
    elif change == "dtype":
        params = [nn.Parameter(torch.zeros(100, dtype=torch.float64)), params[1]]
    elif change == "count":
        params = params[:1]
    else:
        sigma = 2.0
    _release(priv, params, sigma=sigma)
    assert not (_grads(params) == SENTINEL).any()
    noise.close()


def test_an_exception_inside_a_release_drops_the_draws(monkeypatch):
    params = [nn.Parameter(torch.zeros(100))]
    noise = GaussianNoise(seed=0, prefetch=True)
    _sentinel_draws(noise, monkeypatch)
    _release(Privatizer(noise), params)
    assert noise._prefetcher.pending == 1
    with pytest.raises(KeyError):
        with noise.step():
            noise.add_noise_([torch.zeros(100)], 1.0)  # takes the draw made ahead
            raise KeyError("the release failed")
    assert noise._prefetcher.pending == 0
    _release(Privatizer(noise), params)  # drawn at the call: nothing was left to reuse
    assert not (_grads(params) == SENTINEL).any()
    noise.close()


def test_a_draw_is_handed_out_once():
    noise = GaussianNoise(seed=0, prefetch=True)
    with noise.step():
        noise.add_noise_([torch.zeros(10)], 1.0)
    prefetcher = noise._prefetcher
    key = prefetcher._job.keys[0]
    assert prefetcher.take(key) is not None
    assert prefetcher.take(key) is None and prefetcher.pending == 0
    noise.close()


def test_a_draw_at_the_call_outside_a_release_drops_the_draws_made_ahead(monkeypatch):
    """sample()/add_noise_() outside step(): drawn at the call, after the worker's job is dropped (the generators
    are never shared with the worker, and a draw made ahead is for a release only)."""
    noise = GaussianNoise(seed=0, prefetch=True)
    _sentinel_draws(noise, monkeypatch)
    with noise.step():
        noise.add_noise_([torch.zeros(100)], 1.0)
    t = torch.zeros(100)
    noise.add_noise_([t], 1.0)
    assert not (t == SENTINEL).any() and noise._prefetcher.pending == 0
    noise.close()


def test_copies_and_pickles_hold_no_draws():
    noise = GaussianNoise(seed=0, prefetch=True)
    with noise.step():
        noise.add_noise_([torch.zeros(100)], 1.0)
    assert noise._prefetcher.pending == 1
    for other in (copy.deepcopy(noise), pickle.loads(pickle.dumps(noise))):
        assert other._prefetcher.pending == 0 and other._prefetcher._worker is None
    noise.close()


def test_a_forked_child_starts_empty(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    with noise.step():
        noise.add_noise_([torch.zeros(100)], 1.0)
    parents = noise._prefetcher._worker
    monkeypatch.setattr(noise._prefetcher, "_pid", -1)  # as seen from another process
    assert noise._prefetcher.pending == 0 and noise._prefetcher._worker is None
    parents.stop()  # (in a real child the parent's thread does not exist)
    noise.close()


# ----------------------------------------------------------------------------- the worker
def test_worker_starts_lazily_is_a_daemon_and_is_joined_at_close():
    noise = GaussianNoise(seed=0, prefetch=True)
    assert noise._prefetcher._worker is None
    _release(Privatizer(noise), [nn.Parameter(torch.zeros(10))])
    thread = noise._prefetcher._worker.thread
    assert isinstance(thread, threading.Thread) and thread.daemon and thread.is_alive()
    noise.close()
    assert not thread.is_alive() and noise._prefetcher.pending == 0
    _release(Privatizer(noise), [nn.Parameter(torch.zeros(10))])  # a later release starts a new worker
    assert noise._prefetcher._worker.thread.is_alive()
    noise.close()


def test_a_worker_exception_is_raised_at_the_next_take():
    prefetcher = NoisePrefetcher()

    def failing(key):
        raise ValueError("no entropy")

    prefetcher.submit(["k"], failing)
    with pytest.raises(RuntimeError, match="prefetch worker") as info:
        prefetcher.take("k")
    assert isinstance(info.value.__cause__, ValueError)
    assert prefetcher.pending == 0
    prefetcher.close()


@pytest.mark.parametrize("spare,size,ahead", [(True, 70_000, True), (False, 70_000, False), (True, 1_000, False)])
@pytest.mark.parametrize("mechanism", ["gaussian", "secure"])
def test_auto_draws_ahead_on_cpu_only_where_it_pays(spare, size, ahead, mechanism, monkeypatch):
    """prefetch="auto" (the default): a worker only where a CPU is free for it (torch's threads fewer than the CPUs)
    and the release draws at least MIN_AHEAD numbers; the noise is the same calls either way."""
    import lightning_dp.performance.noise_prefetch as noise_prefetch

    monkeypatch.setattr(noise_prefetch, "spare_cpu", lambda: spare)
    noise = GaussianNoise(seed=0) if mechanism == "gaussian" else SecureGaussianNoise()
    assert noise.prefetch == "auto" and 70_000 > noise_prefetch.MIN_AHEAD > 1_000
    _release(Privatizer(noise), [nn.Parameter(torch.zeros(size))])
    assert noise._prefetcher.pending == int(ahead) and (noise._prefetcher._worker is not None) == ahead
    noise.close()


def test_spare_cpu_compares_torch_threads_with_the_usable_cpus(monkeypatch):
    import os

    import lightning_dp.performance.noise_prefetch as noise_prefetch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for threads, spare in [(1, True), (2, False), (4, False)]:
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        assert noise_prefetch.spare_cpu() is spare


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_prefetch_takes_auto_true_or_false(bad):
    with pytest.raises(ValueError, match="prefetch"):
        GaussianNoise(prefetch=bad)


def test_no_prefetch_draws_nothing_ahead():
    noise = GaussianNoise(seed=0, prefetch=False)
    _release(Privatizer(noise), [nn.Parameter(torch.zeros(10))])
    assert noise._prefetcher is None


def test_a_shared_generator_is_never_drawn_ahead():
    noise = GaussianNoise(generator=torch.Generator().manual_seed(0))
    _release(Privatizer(noise), [nn.Parameter(torch.zeros(10))])
    assert noise._prefetcher is None


def test_a_rank_that_adds_no_noise_draws_nothing_ahead():
    noise = GaussianNoise(seed=0, prefetch=True)
    p = nn.Parameter(torch.zeros(10))
    Privatizer(noise, reduce=lambda ts: None, adds_noise=False).privatize(
        ClippedBatch({p: torch.zeros(10)}, None, torch.zeros(0), 0), [p], MechanismRequest(), 1.0, 1.0, 1.0)
    assert noise._prefetcher._worker is None and noise._prefetcher.pending == 0


def test_per_rank_streams_draw_ahead_independently():
    noise = GaussianNoise(seed=3, prefetch=True)
    ranks = [noise.for_rank(r) for r in range(2)]
    assert all(r.prefetch is True for r in ranks) and ranks[0]._prefetcher is not ranks[1]._prefetcher


# ----------------------------------------------------------------------------- the private step drops unused draws
def _private_step(noise, monkeypatch, **kwargs):
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp.privacy.private_step import PrivateStep

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 5), torch.randint(0, 3, (40,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(1.0, 0.3, noise, sampler_seed=0, **kwargs)
    step.attach(model, optimizer)
    loader = iter(step.poisson_loader(DataLoader(data, batch_size=8)))

    def loss(batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    step.verify(loss)

    def one_step(release=True):
        batch = next(loader)
        step.begin()
        loss(batch).backward()
        if release:
            step.release(optimizer=optimizer)
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            return grads

    return step, model, one_step


def _held(noise) -> int:
    return noise._prefetcher.pending


def test_the_private_step_releases_with_draws_made_ahead(monkeypatch):
    """Positive control: after a release the next one's draws are held, and the next release uses them."""
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    assert _held(noise) == 1
    _sentinel_draws(noise, monkeypatch)
    assert all((g.abs() < 1e3).all() for g in one_step())  # the (Gaussian) draw made ahead; SENTINEL drawn ahead
    assert all((g.abs() > 1e3).all() for g in one_step())  # SENTINEL / B
    step.detach()


def test_a_refused_step_drops_the_draws(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    assert _held(noise) == 1
    step.release_guards.append(lambda sigma, q: "a budget callback says stop")
    assert step.refusal() is not None
    assert _held(noise) == 0
    step.detach()


def test_a_release_that_raises_drops_the_draws(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    assert _held(noise) == 1
    monkeypatch.setattr(step.boundary, "check_release", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        one_step()
    assert _held(noise) == 0
    step.detach()


def test_a_step_that_raised_before_its_release_drops_the_draws(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    one_step(release=False)  # forward and backward ran, the release never came (the step raised)
    assert _held(noise) == 1
    one_step(release=False)  # the next step's begin()
    assert _held(noise) == 0
    step.detach()


def test_a_changed_parameter_set_or_a_restore_drops_the_draws(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    model[0].bias.requires_grad_(False)
    assert step.refresh_parameters() and _held(noise) == 0  # the engine was switched
    model[0].bias.requires_grad_(True)
    step.refresh_parameters()
    step._verified = True
    one_step()
    assert _held(noise) == 1
    step.load_state_dict(step.state_dict())
    assert _held(noise) == 0
    step.detach()


def test_detach_joins_the_worker(monkeypatch):
    noise = GaussianNoise(seed=0, prefetch=True)
    step, model, one_step = _private_step(noise, monkeypatch)
    one_step()
    thread = noise._prefetcher._worker.thread
    step.detach()
    assert not thread.is_alive() and _held(noise) == 0
