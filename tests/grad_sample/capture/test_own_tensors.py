"""The engine's own reads of a layer's parameters (capture/own_tensors.py): the values ``getattr`` and torch's checks
give, without the watched table's per-read inspection."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_dp.grad_sample.base import make_engine
from lightning_dp.grad_sample.capture.activations import direct_trainable, is_unit
from lightning_dp.grad_sample.capture.own_tensors import is_parametrized, own, own_trainable, plain_leaf
from lightning_dp.grad_sample.capture.root_parameters import _OutsideReads
from lightning_dp.validators.layers import parametrized


def _cnn():
    """A small convolutional classifier (a convolution, a group norm, a linear layer) and a batch of 4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    return model, torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))


def _step(engine, model, x, y):
    engine.begin_step(x.shape[0])
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


class _Shadowed(nn.Linear):
    """A registered ``weight`` behind a class attribute of the same name: the attribute is what a read gets."""

    @property
    def weight(self):  # type: ignore[override]
        if "weight" not in self._parameters:  # nn.Linear.__init__ registers it (hasattr must be False before)
            raise AttributeError("weight")
        return self._parameters["weight"] * 1


def _modules() -> list[nn.Module]:
    p = nn.Linear(3, 2)
    parametrize.register_parametrization(p, "weight", _Double())
    twice = nn.Linear(2, 2)
    twice.register_parameter("alias", twice.weight)  # one parameter under two names: listed once
    frozen = nn.Conv2d(1, 2, 3, bias=False)
    frozen.weight.requires_grad_(False)
    odd = nn.Linear(2, 2)
    odd.__dict__["parametrizations"] = nn.ModuleDict({"weight": nn.ModuleList([_Double()])})  # not via setattr
    return [nn.Linear(3, 2), nn.Conv2d(1, 2, 3, bias=False), p, twice, frozen, nn.GroupNorm(2, 4),
            nn.Sequential(nn.Linear(2, 2)), nn.MultiheadAttention(4, 2), odd]


@pytest.mark.parametrize("k", range(len(_modules())))
def test_the_fast_checks_answer_as_torch_does(k):
    m = _modules()[k]
    assert is_parametrized(m) == parametrized(m)
    if plain_leaf(m):
        assert not parametrized(m) and not list(m.children())
    named = [(n, p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    assert [(n, id(p)) for n, p in own_trainable(m)] == [(n, id(p)) for n, p in named]
    slow = [(n, p) for n, p in m.named_parameters(recurse=is_unit(m)) if p.requires_grad]
    assert [(n, id(p)) for n, p in direct_trainable(m)] == [(n, id(p)) for n, p in slow]


@pytest.mark.parametrize("k", range(len(_modules())))
def test_own_reads_what_getattr_reads(k):
    m = _modules()[k]
    for name in ("weight", "bias", "alias", "in_proj_weight"):
        if hasattr(m, name):
            a, b = own(m, name), getattr(m, name)
            if parametrized(m) and name == "weight":  # computed anew at each read
                assert torch.equal(a, b)
            else:
                assert a is b


def test_a_class_attribute_shadowing_a_parameter_is_read_as_getattr_reads_it():
    m = _Shadowed(2, 2)
    with torch.no_grad():  # reset_parameters initialised the property's copy: the parameter holds torch.empty's bytes
        m._parameters["weight"].copy_(torch.arange(4.0).reshape(2, 2))
    assert own(m, "weight") is not m._parameters["weight"]
    assert torch.equal(own(m, "weight"), m._parameters["weight"])


def test_the_clipping_makes_no_read_the_watched_tables_inspect(monkeypatch):
    """The engine's per-step reads of a layer's own parameters skip the watched table's ``__getitem__`` (a frame
    inspection each, ≈ 1 µs); the values are unchanged (test_ghost.py compares them with the reference)."""
    model, x, y = _cnn()
    engine = make_engine("ghost")
    engine.attach(model)
    assert sum(isinstance(m._parameters, _OutsideReads) for m in model.modules()) == 3
    reads = []
    original = _OutsideReads.__getitem__

    def counted(self, name):
        reads.append(name)
        return original(self, name)

    _step(engine, model, x, y)
    monkeypatch.setattr(_OutsideReads, "__getitem__", counted)
    batch = engine.clip_and_sum(list(model.parameters()), 1.0)
    monkeypatch.undo()
    engine.detach()
    assert torch.isfinite(batch.norms).all() and batch.batch_size == 4
    assert reads == []


def test_the_check_is_exercised_by_a_read_outside_the_engine(monkeypatch):
    """The counter above sees a read made the ordinary way (the test would pass vacuously otherwise)."""
    model, x, y = _cnn()
    engine = make_engine("ghost")
    engine.attach(model)
    layer = next(m for m in model.modules() if isinstance(m._parameters, _OutsideReads))
    reads = []
    original = _OutsideReads.__getitem__
    monkeypatch.setattr(_OutsideReads, "__getitem__", lambda self, name: reads.append(name) or original(self, name))
    layer.weight  # noqa: B018
    monkeypatch.undo()
    _step(engine, model, x, y)
    engine.clip_and_sum(list(model.parameters()), 1.0)
    engine.detach()
    assert reads == ["weight"]
