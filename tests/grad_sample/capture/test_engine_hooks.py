"""grad_sample/capture/engine_hooks.py: nothing an engine attaches makes the module unpicklable, travels with a copy or shows in a
trace (issue 37: ModelCheckpoint pickling a network kept in hparams, TensorBoard's log_graph)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.grad_sample.capture.engine_hooks import DroppedHook, EngineHook, ReplacedForward
from lightning_dp.privacy.private_step import PrivateStep

ENGINES = ["ghost", "vmap", "opacus_hooks"]


class Block(nn.Module):
    """A container that reads its own parameter (the root-parameter interception swaps its class) around leaf layers
    whose parameters are watched (their ``_parameters`` replaced), and a frozen batch norm (a hook of its own; a group
    norm for Opacus, which refuses batch norms)."""

    def __init__(self, recurrent: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.proj = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6).eval() if recurrent else nn.GroupNorm(2, 6)
        self.rnn = nn.LSTM(6, 6, batch_first=True) if recurrent else None
        self.attn = nn.MultiheadAttention(6, 2) if recurrent else None

    def forward(self, x):  # [B, T, 4]
        h = self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2) * self.scale
        if self.rnn is not None:
            h = self.rnn(h)[0].transpose(0, 1)
            h = self.attn(h, h, h, need_weights=False)[0].transpose(0, 1)
        return h.mean(1)


def _attached(engine: str) -> tuple[nn.Module, PrivateStep]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(recurrent=engine != "opacus_hooks"), nn.Linear(6, 2))
    model[0].norm.requires_grad_(engine == "opacus_hooks")
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine=engine)
    step.attach(model)
    return model, step


def _engine_objects(model: nn.Module) -> list[object]:
    found = []
    for m in model.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            found += [h for h in getattr(m, name).values() if isinstance(h, (EngineHook, DroppedHook))]
        found += [m.__dict__["forward"]] if isinstance(m.__dict__.get("forward"), ReplacedForward) else []
        found += [m.__dict__["_dp_root_reader"]] if "_dp_root_reader" in m.__dict__ else []
        found += [m._parameters] if type(m._parameters) is not dict else []
    return found


@pytest.mark.parametrize("engine", ENGINES)
def test_a_module_pickles_while_an_engine_is_attached(engine):
    model, step = _attached(engine)
    keys = list(model.state_dict())
    x = torch.randn(3, 5, 4)
    step._engine.begin_step(3)  # one step's capture, as between two steps of a fit
    model(x).sum().backward()
    step._engine.clip_and_sum([p for p in model.parameters() if p.requires_grad], 1.0)
    expected = model(x).detach()
    assert _engine_objects(model)  # the engine did attach something
    buffer = io.BytesIO()
    torch.save(model, buffer)  # what ModelCheckpoint does with a network kept in the hyperparameters
    loaded = pickle.loads(pickle.dumps(model))
    step.detach()
    for copy_ in (loaded, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        assert [type(m) for m in copy_.modules()] == [type(m) for m in model.modules()]  # the user's own classes
        assert list(copy_.state_dict()) == keys
        torch.testing.assert_close(copy_(x), expected)
        assert not _engine_objects(copy_)  # its first call removed the dropped hooks; nothing else of the engine
    if engine == "ghost":  # the loaded module attaches like any other: its linear layers get the book-keeping forward
        again = PrivateStep(1.0, 1.0, GaussianNoise(), engine=engine)
        again.attach(loaded)
        assert isinstance(loaded[1].__dict__.get("forward"), ReplacedForward)
        again.detach()


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_deep_copy_of_an_attached_module_is_not_attached(engine):
    """An EMA or a teacher network copied mid-fit: its calls never record into the original's capture, its layers keep
    their own forward (a book-keeping forward would leave its weights without gradients)."""
    model, step = _attached(engine)
    twin = copy.deepcopy(model)
    assert [type(m).__name__ for m in twin.modules()] == [type(m).__name__ for m in model.modules()]
    assert all(type(m).__module__ in (__name__, "torch.nn.modules.container") or type(m).__module__.startswith(
        "torch.") for m in twin.modules())
    assert type(twin[0]) is Block  # the user's class, not the interception's subclass
    capture = step._engine._capture
    capture.begin_step(3)
    twin(torch.randn(3, 5, 4)).sum().backward()
    assert not capture.any_recorded()
    assert not _engine_objects(twin)  # the placeholders removed themselves at the first call
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    step.detach()


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_trace_of_an_attached_module_is_the_modules_own(engine):
    """torch.jit.trace (TensorBoard's add_graph) checks that two traces agree: the engine's hooks stay out of both."""
    model, step = _attached(engine)
    model.eval()
    x = torch.randn(3, 5, 4)
    traced = torch.jit.trace(model, (x,), check_trace=True)
    assert not step._engine._capture.any_recorded()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))
    step.detach()
