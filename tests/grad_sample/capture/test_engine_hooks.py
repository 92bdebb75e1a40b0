"""grad_sample/capture/engine_hooks.py: nothing an engine attaches makes the module unpicklable, travels with a copy or shows in a
trace (issue 37: ModelCheckpoint pickling a network kept in hparams, TensorBoard's log_graph), or changes a forward
that records no gradient (a validation loop inside the fit: torch's nested-tensor fast path of a TransformerEncoder)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError
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


class EveryReplaced(nn.Module):
    """One layer of every kind whose forward the ghost engine replaces: Linear, convolutions, PReLU, an RNN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.up = nn.Conv1d(4, 4, 3, padding=1), nn.ConvTranspose1d(4, 4, 3, padding=1)
        self.act, self.rnn, self.head = nn.PReLU(), nn.GRU(4, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):  # [B, T, 4]
        h = self.act(self.up(self.conv(x.transpose(1, 2)))).transpose(1, 2)
        return self.head(self.rnn(h)[0]).mean(1)


def test_a_replaced_forward_is_the_layers_own_where_no_gradient_is_recorded():
    """Under no_grad or inference_mode (validation inside the fit) every replaced forward runs the layer's own;
    with gradients recorded the book-keeping forward runs, and the step's capture records every layer."""
    torch.manual_seed(0)
    model = EveryReplaced()
    x = torch.randn(3, 5, 4)
    expected = model(x).detach()
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine="ghost")
    step.attach(model)
    replaced = {name: m.__dict__["forward"] for name, m in model.named_children()}
    assert all(isinstance(f, ReplacedForward) for f in replaced.values()), replaced
    called: list[str] = []
    for name, forward in replaced.items():
        forward.fn = (lambda fn, name: lambda *a, **k: called.append(name) or fn(*a, **k))(forward.fn, name)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            torch.testing.assert_close(model(x), expected)
    assert called == []
    step._engine.begin_step(3)
    model(x).sum().backward()
    assert sorted(set(called)) == sorted(replaced)  # a training forward takes the book-keeping forward: never skipped
    assert all(p.grad is None for p in model.parameters())  # … whose backward leaves p.grad to the clipping
    assert len(step._engine._capture.completed()) == len(replaced)
    step.detach()


def test_a_nested_input_runs_the_layers_own_forward_or_is_refused():
    """A nested tensor (torch's TransformerEncoder fast path) takes the layer's own forward where no parameter
    gradient is recorded; with gradients recorded for the layer's parameters it is refused, never trained around."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine="ghost")
    step.attach(nn.Sequential(layer))
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(5, 4)])
    with torch.no_grad():
        out = layer(nested)
    for got, part in zip(out.unbind(), nested.unbind()):
        torch.testing.assert_close(got, F.linear(part, layer.weight, layer.bias))
    with pytest.raises(PrivacyConfigurationError, match="nested tensor reached Linear"):
        layer(nested)
    layer.requires_grad_(False)
    assert layer(nested).is_nested
    step.detach()


class PaddedEncoder(pl.LightningModule):
    """A TransformerEncoder classifier on padded token sequences with ``src_key_padding_mask``: in eval mode under
    no_grad torch's fast path turns the encoder's input into a nested tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=0)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.cls = nn.Linear(8, 2)
        self.validated = 0

    def forward(self, x):
        pad = x == 0
        h = self.encoder(self.emb(x), src_key_padding_mask=pad)
        return self.cls(h.masked_fill(pad.unsqueeze(-1), 0).sum(1) / (~pad).sum(1, keepdim=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.validated += 1
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _padded_tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 12, (n, 9), generator=g)
    for i in range(n):
        x[i, 4 + i % 5:] = 0  # lengths 4..8: every batch padded
    return TensorDataset(x, torch.randint(0, 2, (n,), generator=g))


def test_a_transformer_encoder_with_a_padding_mask_validates_inside_a_private_fit():
    torch.manual_seed(0)
    model = PaddedEncoder()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, strategy=strategy,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(_padded_tokens(24, 0), batch_size=8, shuffle=True),
                DataLoader(_padded_tokens(16, 1), batch_size=8))
    assert trainer.global_step == 3 and strategy.ledger.steps == 3
    assert model.validated == 2 and torch.isfinite(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("engine", ENGINES)
def test_an_eager_private_step_runs_nothing_through_dynamo(engine):
    """perf31 (issue 38): no hook an engine attaches, and nothing of the step around them, hands a frame to dynamo in an
    eager run on the CPU (no compile, no recompile, no graph break: the engine's hooks need no
    ``torch.compiler.disable``)."""
    from torch._dynamo.utils import counters

    model, step = _attached(engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    loader = step.poisson_loader(DataLoader(TensorDataset(torch.randn(8, 3, 4, generator=g),
                                                          torch.randint(0, 2, (8,), generator=g)), batch_size=8))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    counters.clear()
    for _ in range(3):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            step.begin()
            F.cross_entropy(model(x), y).backward()
            step.release(optimizer=opt)
            opt.step()
    assert not any(counters.values()), {k: dict(v) for k, v in counters.items() if v}
