"""Where a step draws random numbers of its own: the modules whose forward moved a random generator, and whether the
step drew outside every module's forward (augmentation in ``training_step``).

The first step's probe (:mod:`.probe`) finds that the step draws random numbers outside dropout (one more pass with
another seed) and then only warns, having compared less. The warning says where the draws come from: one more forward
pass of the probe's examples runs with a forward pre-hook and post-hook on every module of the model, each comparing
the random generators' state (torch's CPU generator, the CUDA generators once CUDA is initialised, NumPy's global
generator, Python's ``random`` and the user's own ``torch.Generator`` objects, :mod:`~lightning_dp.records.
user_generators`) with its state when the module's forward, or its last child's, began or ended: a module whose own
code drew is named (Hugging Face's SpecAugment in ``Wav2Vec2Model``'s forward, with NumPy's generator), and so are
draws between the modules' forwards. It runs only when the warning is given, once.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from lightning_dp.records import user_generators

__all__ = ["drawing_modules", "random_step_warning"]


def _state() -> tuple[Any, ...]:
    cuda = [g.get_state() for g in torch.cuda.default_generators] if torch.cuda.is_initialized() else []
    numpy_state = np.random.get_state()
    return (torch.random.get_rng_state(), cuda, numpy_state[1], numpy_state[2], random.getstate(),
            [state for _, state in user_generators.states()])


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and np.array_equal(a[2], b[2]) and a[3] == b[3] and a[4] == b[4] and len(a[5]) == len(b[5])
            and all(torch.equal(x, y) for x, y in zip(a[5], b[5])))


def drawing_modules(module: nn.Module, run: Callable[[], Any]) -> tuple[list[tuple[str, nn.Module]], bool]:
    """Run ``run`` (the step's forward) and return the submodules of ``module`` (name, module) whose own forward code
    drew random numbers (not their children's), in the order they ran, and whether the step drew outside every
    forward of ``module``'s modules (module docstring)."""
    names = {id(m): name for name, m in module.named_modules()}
    top: list[Any] = [None, _state(), False]  # the step outside the forwards: its state after the last; whether it drew
    stack = [top]  # [module, the state after its last child (or at its start), whether its own code drew]
    found: dict[int, tuple[str, nn.Module]] = {}

    def before(m: nn.Module, args: Any) -> None:
        if id(m) not in names:
            return
        now = _state()
        if not _same(stack[-1][1], now):
            stack[-1][2] = True
        stack.append([m, now, False])

    def after(m: nn.Module, args: Any, output: Any) -> None:
        if len(stack) < 2 or stack[-1][0] is not m:
            return
        _, last, drew = stack.pop()
        now = _state()
        if drew or not _same(last, now):
            found.setdefault(id(m), (names[id(m)] or "<root>", m))
        stack[-1][1] = now

    hooks = [nn.modules.module.register_module_forward_pre_hook(before),
             nn.modules.module.register_module_forward_hook(after, always_call=True)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return list(found.values()), bool(top[2]) or not _same(top[1], _state())


def _spec_augment(m: nn.Module) -> bool:
    """A Hugging Face speech model whose configuration masks time steps or features at random in training mode."""
    config = getattr(m, "config", None)
    return bool(getattr(config, "apply_spec_augment", False)) and (
        (getattr(config, "mask_time_prob", 0) or 0) > 0 or (getattr(config, "mask_feature_prob", 0) or 0) > 0)


def _layer_drop(m: nn.Module) -> bool:
    """A Hugging Face model whose configuration skips whole layers at random in training mode (LayerDrop)."""
    return (getattr(getattr(m, "config", None), "layerdrop", 0) or 0) > 0


def random_step_warning(what: str, found: list[tuple[str, nn.Module]], outside: bool) -> str:
    """The probe's warning that the step draws random numbers of its own (``what``: ``"training_step"`` under
    DPStrategy, else a plain loop's loss function), naming the modules that drew (:func:`drawing_modules`) and what
    to do: Hugging Face's SpecAugment turned off or accepted; augmentation moved into the dataset's ``__getitem__``."""
    lightning = what == "training_step"
    who = "DPStrategy: the training step" if lightning else f"PrivateStep: {what} given to verify()"
    named = ", ".join(f"{name!r} ({type(m).__name__})" for name, m in found[:3]) + (" …" if len(found) > 3 else "")
    where = [f"in the forward of module{'s' if len(found) > 1 else ''} {named}"] if found else []
    if outside or not found:
        where.append(f"in {what} outside any module's forward (e.g. augmentation)")
    text = (f"{who} draws random numbers outside dropout ({'; and '.join(where)}), so the first step's probe could "
            "not compare each example's gradient in a batch and alone; only a summed loss and uncaptured parameter "
            "uses were checked (the batch check compares its batches instead). Make sure examples do not interact "
            "through the loss or the model (see docs/verification.md).")
    if any(_spec_augment(m) for _, m in found):
        text += (" Hugging Face's SpecAugment (on by default in wav2vec2, HuBERT and WavLM: config.mask_time_prob) "
                 "masks time steps at random in training mode: set config.apply_spec_augment=False (or "
                 "mask_time_prob=0.0 and mask_feature_prob=0.0) before training to turn it off, or keep it and accept "
                 "this warning.")
    if any(_layer_drop(m) for _, m in found):
        text += (" Hugging Face's LayerDrop (config.layerdrop) skips whole layers at random in training mode: set "
                 "config.layerdrop=0.0 to turn it off, or keep it and accept this warning.")
    if found and not any(_spec_augment(m) or _layer_drop(m) for _, m in found):
        text += (" Draws that are each example's own noise entering only its own loss (a VAE's reparameterisation, "
                 "mu + std * torch.randn_like(std)) are served: once you know they are, silence this warning with "
                 "warnings.filterwarnings('ignore', category=lightning_dp.errors.RandomStepWarning).")
    if outside or not found:
        text += (" Random augmentation trains without this warning in the Dataset's __getitem__ (not the collate "
                 "function, run on the whole batch): each record is read from generators seeded for it alone, so the "
                 "probe compares each example exactly (a torch.Generator kept on the module does not do that: the "
                 "batch and each example alone still draw different numbers for one example).")
    return text
