"""The first step's probe (validators/probe.py) on plain torch models, for every engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.grad_sample import make_engine
from lightning_dp.validators.probe import ExampleIndependenceProbe, probe_failure_error, probe_tolerance

ENGINES = ["ghost", "vmap", "opacus_hooks"]
_G = torch.Generator().manual_seed(15)  # (seeded: at import the global generator's state is the collection order's)
X, Y = torch.randn(8, 5, dtype=torch.float64, generator=_G), torch.randint(0, 3, (8,), generator=_G)


class Net(nn.Module):
    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.a, self.b, self.drop, self.mode = nn.Linear(5, 5), nn.Linear(5, 3), nn.Dropout(0.5), mode

    def forward(self, x):
        h = self.a(x)
        if self.mode == "centre":
            h = h - h.mean(0)
        if self.mode == "outside":
            # a second use outside a's forward, by a read the library does not watch (self.a.weight read outside is
            # followed: test_zoo.py's FunctionalQKV); the probe still sees the gradient no use accounts for
            h = h + F.linear(x, next(self.a.parameters()))
        if self.mode == "nan":
            h = h * torch.sqrt(h - h.detach())  # sqrt of 0: an infinite derivative, NaN gradients
        return self.b(self.drop(torch.tanh(h)))


def _probe(mode: str, engine_name: str, reduction: str = "mean") -> Net:
    torch.manual_seed(0)
    model = Net(mode).double()
    engine = make_engine(engine_name)
    engine.attach(model)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def loss_of(idx):
        return F.cross_entropy(model(X[idx]), Y[idx], reduction=reduction)

    ExampleIndependenceProbe(model, engine, params, names, loss_of, probe_tolerance(torch.float64, False)).run(
        list(range(6)))
    return model


@pytest.mark.parametrize("engine", ENGINES)
def test_independent_examples_pass_with_dropout_and_leave_no_trace(engine):
    model = _probe("ok", engine)
    assert model.training and model.drop.training
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_summed_loss_is_named(engine):
    with pytest.raises(PrivacyConfigurationError, match="SUM over the batch"):
        _probe("ok", engine, reduction="sum")


@pytest.mark.parametrize("engine", ENGINES)
def test_mixing_across_the_batch_is_an_interaction(engine):
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        _probe("centre", engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_use_outside_the_owning_module_is_named(engine):
    # the ghost engine sees it exactly (its replaced forward leaves p.grad alone: tests/grad_sample/test_hidden_uses.py)
    with pytest.raises(PrivacyConfigurationError, match="Parameter a.weight receives gradient|parameter a.weight is "
                                                        "used by its layer's forward and also"):
        _probe("outside", engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_gradients_that_are_not_finite_are_named_as_such(engine):
    with pytest.raises(PrivacyConfigurationError, match=r"not finite \(NaN or inf\) \(autograd's gradient of a.weight"):
        _probe("nan", engine)


def _vmap_probe_with_hook(hook) -> ExampleIndependenceProbe:
    torch.manual_seed(0)
    model = Net().double()
    model.a.register_forward_hook(hook)
    engine = make_engine("vmap")
    engine.attach(model)
    return ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                                    lambda idx: F.cross_entropy(model(X[idx]), Y[idx]),
                                    probe_tolerance(torch.float64, False))


def test_a_forward_hook_marking_the_output_as_requiring_grad_is_served_by_vmap():
    """Hugging Face's gradient checkpointing puts ``out.requires_grad_(True)`` on the input embeddings; vmap's replay
    of the layer runs the hook too, where torch.func refused it (grad_sample/functorch_vmap.py,
    ``_TransformedRequiresGrad``): now a no-op there, and the probe's checks pass."""
    _vmap_probe_with_hook(lambda m, args, out: out.requires_grad_(True)).run(list(range(6)))


def test_a_failure_inside_the_engine_is_named_as_the_engines():
    """A forward hook reading its output's storage (``data_ptr``) cannot run inside vmap's replay of the layer: the
    engine's failure, not the user's step (engine named, fix named)."""
    probe = _vmap_probe_with_hook(lambda m, args, out: out.data_ptr() and None)
    with pytest.raises(PrivacyConfigurationError, match=r"engine failed .*functorch_vmap\.py:\d+.*per_sample='ghost'"):
        probe.run(list(range(6)))


def test_failures_of_the_users_step_on_small_batches_name_poisson_sampling():
    model = Net().double()
    engine = make_engine("vmap")
    engine.attach(model)

    def loss_of(idx):
        out = model(X[idx]).squeeze()  # breaks for a batch of one
        return F.cross_entropy(out, Y[idx])

    with pytest.raises(PrivacyConfigurationError, match="any size"):
        ExampleIndependenceProbe(model, engine, list(model.parameters()), ["a"] * 4, loss_of, 1e-8).run([0, 1, 2])


def test_an_interrupt_raised_in_the_probes_step_names_the_runs_again_not_the_batch_size():
    """zoo36 T19's message: a KeyboardInterrupt from the user's code inside the probe (a failed run again) was
    explained as "training_step must accept batches of any size"."""
    model = Net().double()
    engine = make_engine("vmap")
    engine.attach(model)

    def loss_of(idx):
        if len(idx) < 3:
            raise KeyboardInterrupt
        return F.cross_entropy(model(X[idx]), Y[idx])

    with pytest.raises(PrivacyConfigurationError, match="raised KeyboardInterrupt while the check ran") as refused:
        ExampleIndependenceProbe(model, engine, list(model.parameters()), ["a"] * 4, loss_of, 1e-8).run([0, 1, 2])
    assert "any size" not in str(refused.value)


def test_user_modes_are_restored_module_by_module():
    model = Net().double()
    model.a.eval()  # a user's deliberate mixed state
    engine = make_engine("ghost")
    engine.attach(model)
    ExampleIndependenceProbe(model, engine, list(model.parameters()), ["p"] * 4,
                             lambda idx: F.cross_entropy(model(X[idx]), Y[idx]), 1e-8).run([0, 1])
    assert model.training and not model.a.training and model.b.training


class Augmented(Net):
    def forward(self, x):
        return super().forward(x + 0.3 * torch.randn_like(x))  # augmentation noise drawn in the step


def _probe_model(model, engine_name="ghost", reduction="mean"):
    engine = make_engine(engine_name)
    engine.attach(model)
    loss_of = lambda idx: F.cross_entropy(model(X[idx]), Y[idx], reduction=reduction)  # noqa: E731
    ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                             loss_of, probe_tolerance(torch.float64, False)).run(list(range(6)))


def test_augmentation_randomness_is_detected_and_warned_not_refused():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="draws random numbers"):
        _probe_model(Augmented().double())


def test_every_pass_runs_the_step_under_the_same_modes():
    """Dynamo guards a torch.compile'd model's frames on the types of the torch-function mode stack: the dtype watch
    entered for the batch's pass only compiled them once more for it and once more for the passes after it (each
    frame up to 8 times, then left uncompiled). Alone, together, reseeded, clipped, autograd and the random-draw
    warning's pass: one stack."""
    torch.manual_seed(0)
    model, stacks = Augmented().double(), []
    engine = make_engine("ghost")
    engine.attach(model)

    def loss_of(idx):
        stacks.append(tuple(type(m) for m in torch.overrides._get_current_function_mode_stack()))
        return F.cross_entropy(model(X[idx]), Y[idx])

    with pytest.warns(UserWarning, match="draws random numbers"):  # (the warning's own pass runs too)
        ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                                 loss_of, probe_tolerance(torch.float64, False)).run(list(range(6)))
    assert len(stacks) >= 6 + 5  # alone ×6, together, reseeded, clipped, autograd, the warning's
    assert len(set(stacks)) == 1, set(stacks)


def test_a_summed_loss_is_still_caught_under_augmentation():
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError, match="SUM over the batch"):
        _probe_model(Augmented().double(), reduction="sum")


def _nt_xent(model: nn.Module, x: torch.Tensor, augment: bool) -> torch.Tensor:
    """SimCLR's NT-Xent over two views of the batch (zoo28 c01/c02): per example, [B]; each row's negatives are the
    other examples' views."""
    views = [x + 0.3 * torch.randn_like(x) if augment else x * s for s in (1.0, -1.0)]
    z = F.normalize(torch.cat([model(v) for v in views]), dim=1)
    b = len(x)
    sim = (z @ z.T / 0.5).masked_fill(torch.eye(2 * b, dtype=torch.bool), -1e9)
    per_view = F.cross_entropy(sim, torch.cat([torch.arange(b, 2 * b), torch.arange(b)]), reduction="none")
    return (per_view[:b] + per_view[b:]) / 2


@pytest.mark.parametrize("augment", [True, False], ids=["augmented views", "fixed views"])
def test_in_batch_negatives_are_named_as_such_not_as_a_sum(augment):
    """An in-batch contrastive loss returning its mean (DPStrategy takes a per-example vector's mean: the same)
    couples the examples: refused, and the refusal names the cause (alone, an example has no negatives and no
    gradient) and the fixes, not a SUM (which the augmented views' randomness made it look like)."""
    torch.manual_seed(0)
    model = Net().double()
    engine = make_engine("ghost")
    engine.attach(model)

    def loss_of(idx):
        return _nt_xent(model, X[idx], augment).mean()

    with pytest.raises(PrivacyConfigurationError) as refused:
        ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                                 loss_of, probe_tolerance(torch.float64, False)).run(list(range(6)))
    message = str(refused.value)
    assert message.startswith("Each example's loss depends on the other examples of the batch (in-batch negatives)")
    assert "public negative bank" in message and "per-example objective" in message and "SUM" not in message


@pytest.mark.parametrize("error,cause", [
    (RuntimeError("Output 0 of BackwardHookFunction is a view and is being modified inplace. ..."), "modified in place"),
    (AssertionError("If you want to train `ReformerModel`, make sure to use `model.train()`"), "eval mode"),
    (RuntimeError("shape constraint violated: expected [4, 3]"), "batches of any size"),  # 'constraint' is no 'train'
    (IndexError("index 0 is out of bounds for dimension 0 with size 0"), "batches of any size"),
    (torch.utils.checkpoint.CheckpointError("Recomputed values ... have different metadata"), "without gradient check"),
])
def test_a_failing_step_is_explained_by_its_likely_cause(error, cause):
    message = str(probe_failure_error(error, 2))
    assert message.startswith("The first step's probe ran training_step on a batch of 2 example(s)") and cause in message


def test_a_failure_inside_opacus_hooks_is_named_the_engines_not_the_steps():
    """The opacus_hooks engine's rules run inside the user's forward and backward: a failure there is the engine's."""
    import os

    where = os.path.join(os.sep, "site-packages", "opacus", "grad_sample", "rule.py")
    scope: dict = {}
    exec(compile("def rule():\n    raise RuntimeError('stack expects each tensor to be equal size')\n", where, "exec"),
         scope)
    try:
        scope["rule"]()
    except RuntimeError as error:
        message = str(probe_failure_error(error, 2))
    assert "inside the per-example engine (opacus" in message and "rule.py:2" in message
    assert "batches of any size" not in message


def test_the_interaction_error_quotes_no_gradient_values():
    """The probe's examples are training data: its error counts the examples that differ and quotes no norms."""
    from lightning_dp.validators.probe import interaction_error

    together = torch.tensor([1.2345678, 2.0, 3.0], dtype=torch.float64)
    alone = torch.tensor([1.0, 2.0, 3.7654321], dtype=torch.float64)
    message = str(interaction_error(together, alone, 3))
    assert "for 2 of the 3" in message
    assert "1.23" not in message and "3.76" not in message and "0.797" not in message


@pytest.mark.parametrize("requires_grad", [True, False], ids=["rewrapped-leaf", "plain-number"])
def test_a_loss_detached_from_the_model_is_named_as_such(requires_grad):
    """training_step returning torch.tensor(loss.item(), requires_grad=True): no gradient path to the model. Named
    as a detached loss (it was 'the engine's hooks did not run', or a failure blamed on batch sizes)."""
    model = Net().double()
    engine = make_engine("ghost")
    engine.attach(model)

    def loss_of(idx):
        return torch.tensor(F.cross_entropy(model(X[idx]), Y[idx]).item(), requires_grad=requires_grad)

    with pytest.raises(PrivacyConfigurationError, match=r"^The loss training_step returned is detached from the model"):
        ExampleIndependenceProbe(model, engine, list(model.parameters()), ["p"] * 4, loss_of, 1e-8).run([0, 1, 2])


def test_norms_are_compared_up_to_the_order_of_the_examples_only():
    """A batch that reorders its examples (sorted before packing) keeps one example per row: the probe accepts the same
    norms in another order (then confirmed by its clipped pass), never different ones."""
    from lightning_dp.validators.probe import same_norms

    a = torch.tensor([1.0, 2.0, 3.0])
    assert same_norms(a, a.flip(0), 1e-9)
    assert not same_norms(a, torch.tensor([1.0, 2.0, 3.5]), 1e-3)
    assert not same_norms(a, a[:2], 1.0)


def test_the_batch_check_accepts_a_reordering_and_nothing_else():
    from lightning_dp.validators.batch_check import _reordered

    whole = torch.tensor([4.0, 1.0, 3.0, 2.0])
    assert _reordered(whole, [torch.tensor([2.0, 4.0]), torch.tensor([3.0, 1.0]), torch.tensor([3.0])], 1e-9)
    assert not _reordered(whole, [torch.tensor([2.0, 4.0]), torch.tensor([3.0, 1.5])], 1e-3)  # a norm moved
    assert not _reordered(whole, [torch.tensor([2.0, 4.0]), torch.tensor([3.0, 1.0]), torch.tensor([5.0])], 1e-3)


class Attending(nn.Module):
    """nn.TransformerEncoderLayer with dropout: its nn.MultiheadAttention drops attention weights inside
    F.multi_head_attention_forward, where no dropout module (and no torch-function mode) sees the draw."""

    def __init__(self, centre: bool = False) -> None:
        super().__init__()
        self.inp, self.centre = nn.Linear(5, 8), centre
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(self.inp(x).unsqueeze(1).expand(-1, 3, -1)).mean(1)
        return self.head(h - h.mean(0) if self.centre else h)


@pytest.mark.parametrize("engine", ["vmap", "ghost"])
def test_attention_dropout_is_off_during_the_probe_so_batch_and_alone_are_compared(engine, recwarn):
    torch.manual_seed(0)
    _probe_model(Attending().double(), engine)
    assert not [w for w in recwarn if "draws random numbers" in str(w.message)]


@pytest.mark.parametrize("engine", ["vmap", "ghost"])
def test_examples_mixed_beside_attention_dropout_are_an_interaction(engine):
    torch.manual_seed(0)  # with the draw seen as augmentation only the coarse checks ran: the centring went unseen
    with pytest.raises(PrivacyConfigurationError, match="interact"):
        _probe_model(Attending(centre=True).double(), engine)


def _probe_fgsm(engine_name: str, mode: str) -> None:
    """FGSM adversarial training: the gradient of a summed loss with respect to the input (each example's own when the
    examples do not interact), then the loss on x + ε·sign(∂L/∂x)."""
    torch.manual_seed(0)
    model = Net("centre" if mode == "centre" else "ok").double()
    engine = make_engine(engine_name)
    engine.attach(model)

    def loss_of(idx):
        x0 = X[idx].clone().requires_grad_(True)
        inner = F.cross_entropy(model(x0), Y[idx], reduction="sum")
        gx, = torch.autograd.grad(inner, x0, create_graph=mode == "create_graph")
        adversarial = X[idx] + 0.05 * (gx if mode == "create_graph" else gx.sign())
        return F.cross_entropy(model(adversarial), Y[idx])

    ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                             loss_of, probe_tolerance(torch.float64, False)).run(list(range(6)))


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_fgsm_input_gradients_are_served(engine):
    """torch.autograd.grad(loss, x) with respect to the input, without create_graph, is no part of the parameters'
    gradients: the engines' output-gradient hooks ignore that backward (capture/engine_hooks.py feeds_parameters).
    Opacus' own backward hooks (opacus_hooks) still accumulate it: refused there (an engine failure)."""
    _probe_fgsm(engine, "ok")


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_an_input_made_to_require_grad_is_still_the_steps_own_backward(engine):
    """A step whose input requires grad (a saliency map kept for later): under ghost no parameter is in the graph, and
    its backward() is told from an input gradient by the input leaf it accumulates into (feeds_parameters' inputs)."""
    torch.manual_seed(0)
    model = Net("ok").double()
    engine_ = make_engine(engine)
    engine_.attach(model)

    def loss_of(idx):
        return F.cross_entropy(model(X[idx].clone().requires_grad_(True)), Y[idx])

    ExampleIndependenceProbe(model, engine_, list(model.parameters()), [n for n, _ in model.named_parameters()],
                             loss_of, probe_tolerance(torch.float64, False)).run(list(range(6)))


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_fgsm_with_interacting_examples_is_still_refused(engine):
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        _probe_fgsm(engine, "centre")


@pytest.mark.parametrize("engine", ENGINES)
def test_fgsm_trained_through_the_input_gradient_is_still_refused(engine):
    with pytest.raises(PrivacyConfigurationError, match="create_graph=True"):
        _probe_fgsm(engine, "create_graph")


# ---------------------------------------------------------------- class-weighted mean losses (safezoo6 #9)
CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


def _weighted_loss(kind: str):
    """The loss of ``kind`` on the model's logits: the class-weighted mean torch divides by Σ w[y_j] of the batch, and
    the fix (per-example losses, their plain mean)."""
    criterion = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS)
    return {
        "module": lambda logits, y: criterion(logits, y),
        "functional": lambda logits, y: F.cross_entropy(logits, y, weight=CLASS_WEIGHTS),
        "nll": lambda logits, y: F.nll_loss(F.log_softmax(logits, -1), y, CLASS_WEIGHTS),
        "fixed": lambda logits, y: F.cross_entropy(logits, y, weight=CLASS_WEIGHTS, reduction="none").mean(),
    }[kind]


def _probe_weighted(kind: str, engine_name: str) -> None:
    torch.manual_seed(0)
    model = Net().double()
    engine = make_engine(engine_name)
    engine.attach(model)
    loss = _weighted_loss(kind)
    ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                             lambda idx: loss(model(X[idx]), Y[idx]), probe_tolerance(torch.float64, False)).run(
        list(range(6)))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["module", "functional", "nll"])
def test_a_class_weighted_mean_loss_is_refused_and_named(kind, engine):
    """nn.CrossEntropyLoss(weight=w) with reduction='mean' couples the examples through Σ w[y_j]: still refused, and
    the error names that cause and the fix first."""
    assert len(set(Y[:6].tolist())) > 1  # the probe's examples carry labels of different weights
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact: The step calls a "
                       r"class-weighted loss with reduction='mean'.*sum of the weights of the batch's labels.*"
                       r"reduction='none'.*\.mean\(\).*Nothing was released\. Other possible causes") as err:
        _probe_weighted(kind, engine)
    assert "please report it" not in str(err.value)  # a recognised cause is not an engine's bug (qa12 b06)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_class_weighted_loss_averaged_per_example_passes(engine):
    _probe_weighted("fixed", engine)


@pytest.mark.parametrize("call,weighted", [
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), y, weight=w), True),
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), y, w), True),
    (lambda w, y: nn.NLLLoss(weight=w)(torch.randn(4, 3), y), True),
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), y), False),                          # no weight
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), y, weight=w, reduction="none"), False),
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), y, weight=w, reduction="sum"), False),
    (lambda w, y: F.nll_loss(torch.randn(4, 3), y, w, None, -100, None, "none"), False),  # reduction positional
    (lambda w, y: F.cross_entropy(torch.randn(4, 3), torch.rand(4, 3).softmax(-1), weight=w), False),  # soft labels
])
def test_the_step_watch_sees_class_weighted_means_only(call, weighted):
    from lightning_dp.validators.step_calls import StepWatch

    with StepWatch() as watch:
        call(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 2, 1]))
    assert watch.weighted_mean is weighted


# ---------------------------------------------------------------- autocast in a plain loop (safezoo6 #8)
def _plain_bf16_step(low_precision: bool) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    torch.manual_seed(0)
    data = TensorDataset(torch.rand(64, 64), torch.randint(0, 10, (64,)))
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(model(batch[0]), batch[1])

    step = PrivateStep(noise_multiplier=1.0, max_grad_norm=1.0, noise=GaussianNoise())
    step.attach(model, optimizer)
    step.poisson_loader(DataLoader(data, batch_size=16))
    try:
        step.verify(loss_fn, low_precision=low_precision)
    finally:
        step.detach()


def test_a_plain_loop_under_autocast_is_told_of_low_precision():
    """A float32 model whose loss runs under torch.autocast(bfloat16), verified at float32's tolerance: bf16 rounding
    differs batch against alone, and the refusal names the fix, verify(..., low_precision=True)."""
    with pytest.raises(PrivacyConfigurationError, match=r"The forward computed in torch\.bfloat16 \(torch\.autocast.*"
                       r"step\.verify\(loss_fn, low_precision=True\).*precision='bf16-mixed'"):
        _plain_bf16_step(low_precision=False)
    _plain_bf16_step(low_precision=True)  # the fix the message names


def test_the_low_precision_hint_is_left_out_where_it_cannot_help():
    """float32 compute (a float64 model's float32 rotary part is not half precision) or a tolerance already loose."""
    model = Net().double()
    engine = make_engine("ghost")
    probe = ExampleIndependenceProbe(model, engine, list(model.parameters()), ["p"] * 4, lambda idx: None, 1e-3)
    for dtype, rtol, hinted in [(None, 1e-3, False), (torch.float32, 1e-3, False), (torch.float64, 1e-6, False),
                                (torch.bfloat16, 1e-3, True), (torch.float16, 1e-3, True),
                                (torch.bfloat16, probe_tolerance(torch.float32, True), False)]:
        probe.compute_dtype, probe.rtol = dtype, rtol
        assert ("low_precision=True" in probe.precision_hint()) is hinted, (dtype, rtol)


class _MaskedConv(nn.Conv2d):
    """PixelCNN's masked convolution as commonly written: the mask applied to the weight's .data in the forward, or
    (``functional``) applied to the weight the convolution uses."""

    def __init__(self, functional: bool) -> None:
        super().__init__(1, 4, 3, padding=1)
        self.functional = functional
        self.register_buffer("mask", torch.ones_like(self.weight))
        self.mask[:, :, 1, 1:] = 0
        self.mask[:, :, 2:] = 0

    def forward(self, x):
        if self.functional:
            return F.conv2d(x, self.weight * self.mask, self.bias, self.stride, self.padding)
        self.weight.data *= self.mask
        return super().forward(x)


def _pixelcnn_fit(functional: bool):
    import pytorch_lightning as pl
    from conftest import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import DPStrategy

    class PixelCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(_MaskedConv(functional), nn.ReLU(), nn.Conv2d(4, 2, 1))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), (batch[0][:, 0] > 0).long())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 1, 4, 4, generator=g))
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=2).fit(PixelCNN(), DataLoader(data, batch_size=8))
    return dp


def test_a_weight_masked_in_place_in_the_forward_is_refused_naming_the_functional_form():
    """The write is refused (it is the model's state written outside the gradient), named as what to fix with the
    form that trains, not as an engine's failure to report."""
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)net\.0\.weight.*self\.weight \* self\.mask") as info:
        _pixelcnn_fit(functional=False)
    assert "please report" not in str(info.value) and "functorch" not in str(info.value), str(info.value)
    assert _pixelcnn_fit(functional=True).ledger.steps == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_a_gradient_of_the_parameters_taken_in_the_step_is_named(engine):
    """zoo34 L38: ``torch.autograd.grad(loss, params)`` in the step (its norm logged) is the batch's raw gradient; the
    refusal names it, not a weight-tying use (an input's gradient, an adversarial example, is served: above)."""
    torch.manual_seed(0)
    model = Net("ok").double()
    eng = make_engine(engine)
    eng.attach(model)
    params, names, logged = list(model.parameters()), [n for n, _ in model.named_parameters()], []

    def loss_of(idx):
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        logged.append(float(sum(g.pow(2).sum() for g in grads)))
        return loss

    with pytest.raises(PrivacyConfigurationError, match="takes a gradient with respect to the model's parameters"):
        ExampleIndependenceProbe(model, eng, params, names, loss_of, probe_tolerance(torch.float64, False)).run(
            list(range(6)))
