"""Choose the fastest per-example engine valid for a model (``DPStrategy(per_sample="auto")``).

Order, fastest first (benchmarks/speed.py): ``ghost`` (ghost norms + book-keeping, no
per-example gradients for Linear/Conv2d/Embedding), ``vmap`` (per-layer torch.func,
materialised; also handles tied weights), ``opacus_hooks`` (Opacus' grad samplers, the
broadest coverage). The first engine whose ``unsupported_layers`` is empty wins.

That choice reads layer types only. The first step's probe (``validators/probe.py``) then checks
the chosen engine on real examples; where it refuses, :func:`engines_after` lists the engines that
``auto`` tries next (``PrivateStep.verify_on``): an engine that passes the probe is verified as
the first choice would have been, so a model that defeats one engine (an unusual use of a
parameter, a layer rule's edge case) trains on another instead of being refused.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_dp.grad_sample.base import make_engine

PREFERENCE: tuple[str, ...] = ("ghost", "vmap", "opacus_hooks")


def unsupported_by_engine(module: nn.Module) -> dict[str, list[str]]:
    """For each engine in :data:`PREFERENCE`, the layers of ``module`` it cannot handle."""
    import lightning_dp.grad_sample.functorch_vmap  # noqa: F401  (registers "vmap")
    import lightning_dp.grad_sample.ghost  # noqa: F401  (registers "ghost")
    import lightning_dp.grad_sample.opacus_hooks  # noqa: F401  (registers "opacus_hooks")

    return {name: make_engine(name).unsupported_layers(module) for name in PREFERENCE}


def select_engine(module: nn.Module, views_per_example: int = 1) -> str:
    """Name of the fastest engine that supports every trainable layer of ``module`` (and, for
    ``views_per_example`` > 1, augmentation multiplicity: :attr:`GradSampleEngine.supports_views`).

    Raises:
        ValueError: no engine supports the model; the message lists each engine's problems.
    """
    problems = unsupported_by_engine(module)
    if views_per_example > 1:
        for name in PREFERENCE:
            if not make_engine(name).supports_views:
                problems[name] = problems[name] + ["K > 1 views per example (augmentation multiplicity)"]
    for name in PREFERENCE:
        if not problems[name]:
            return name
    raise ValueError(no_engine_message(module, problems))


def no_engine_message(module: nn.Module, problems: dict[str, list[str]]) -> str:
    """Why no engine serves ``module``, cause and fix first: a BatchNorm in training mode (every engine refuses it)
    is named once with its fix, eval mode for the whole fit; the engines' other problems follow, engine by engine, only
    where no engine would serve the model with that fixed."""
    norms = [name for name, sub in module.named_modules()
             if isinstance(sub, _BatchNorm) and sub.training and any(p.requires_grad for p in sub.parameters())]
    rest = {engine: [p for p in found if not any(p.startswith(f"{n or '<root>'} (") for n in norms)]
            for engine, found in problems.items()}
    detail = "; ".join(f"{engine}: {'; '.join(found)}" for engine, found in rest.items() if found)
    if not norms:
        return (f"No per-example gradient engine supports this model ({detail}). Replace the listed layers, or "
                "freeze them (requires_grad_(False)).")
    named = "; ".join(f"{n or '<root>'} ({type(module.get_submodule(n)).__name__}): mixes examples in training mode"
                      for n in norms)
    return (f"No per-example gradient engine supports this model: {named} (a BatchNorm in training mode normalises "
            "with the batch's statistics). Put it in eval mode before fit "
            f"(e.g. {_eval_call(norms[0])} at the end of __init__: Lightning keeps a module's mode; running statistics "
            "frozen, the affine weights still train) or replace it with nn.GroupNorm/nn.LayerNorm."
            + (f" Then still: {detail}." if all(rest.values()) else ""))


def _eval_call(name: str) -> str:
    """The call that puts submodule ``name`` of a LightningModule in eval mode, as the user would write it."""
    if name and all(part.isidentifier() for part in name.split(".")):
        return f"self.{name}.eval()"
    return f"self.get_submodule({name!r}).eval()"


def engines_after(module: nn.Module, name: str, views_per_example: int = 1) -> list[str]:
    """The engines of :data:`PREFERENCE` after ``name`` that support every trainable layer of ``module``
    (and ``views_per_example`` rows per example): ``auto``'s next choices when the probe refuses ``name``."""
    later = PREFERENCE[PREFERENCE.index(name) + 1:] if name in PREFERENCE else ()
    problems = unsupported_by_engine(module)
    return [engine for engine in later
            if not problems[engine] and (views_per_example == 1 or make_engine(engine).supports_views)]
