"""A spectral norm's power iteration, run by the library once per update while a model is attached to a private step.

``torch.nn.utils.parametrizations.spectral_norm`` divides a weight by σ(W) = uᵀ W v, ``u`` and ``v`` buffers that
every training forward advances by ``n_power_iterations`` steps of the power method (in place, without gradient: σ's
gradient treats them as constants). They follow the weights, not the data, but a private step runs the model more
than once (the probe's and the checks' passes, the engines' replays, gradient accumulation's physical batches): each
pass would advance them, so σ would differ between the examples of one step and the buffers would be written inside
the step, which the release boundary refuses as state kept from the batch.

:class:`PowerIterations` holds every spectral norm's iteration (``n_power_iterations = 0``) while the model is
attached, so every forward of a step (the real one and every check's) divides by the same σ(W) and writes nothing,
and runs the iteration itself, ``n_power_iterations`` times, after each update (:meth:`PowerIterations.advance`, from
the release boundary's optimizer step post-hook, before its new baseline): a function of the released weights only.
Non-private training runs it at the start of every training forward, on the same weights: each step's σ is the same
as there, the first step's excepted (it uses u, v as the fit finds them). A parametrization in eval mode is not
advanced, as in torch. Detaching restores ``n_power_iterations``.

A parametrization of the user's own that advances a buffer in its forward (``u.copy_(...)`` under ``no_grad``) is
not run so: its code may read anything (the data), and calling it after each update would run the user's code
outside every check. The per-example engines cannot run through its in-place write either; the probe's refusal says
whether the examples set the buffer apart (:func:`buffers_set_apart`: a statistic of the batch kept) or not (a power
iteration from the weights: use torch's ``spectral_norm``, or advance the buffer after the release, in
``on_train_batch_end``, where the write is judged and accepted when the weights alone make it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm


def spectral_norms(module: nn.Module) -> list[tuple[nn.Module, int, nn.Module]]:
    """(parametrization list, index in it, the spectral norm) for every matrix spectral norm in ``module`` (a
    vector's is F.normalize, with no iteration). Torch's own class only, by identity: a class of the user's (named so,
    or a subclass) may compute anything in its ``_power_method``, which the library would run after each update."""
    found = []
    for sub in module.modules():
        if not parametrize.is_parametrized(sub):
            continue
        for chain in sub.parametrizations.values():
            found.extend((chain, i, p) for i, p in enumerate(chain)
                         if type(p) is _SpectralNorm and hasattr(p, "n_power_iterations"))
    return found


def _input_of(chain: nn.Module, index: int) -> Tensor:
    """What the ``index``-th parametrization of ``chain`` is applied to: the originals through those before it."""
    if index == 0:
        return chain.original
    x = chain[0](chain.original) if chain.is_tensor else chain[0](*(getattr(chain, f"original{i}")
                                                                     for i in range(chain.ntensors)))
    for i in range(1, index):
        x = chain[i](x)
    return x


class PowerIterations:
    """The spectral norms of one attached model, their iteration held (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self._held = [(chain, i, p, p.n_power_iterations) for chain, i, p in spectral_norms(module)]
        for _, _, p, _ in self._held:
            p.n_power_iterations = 0

    def advance(self) -> None:
        """One training forward's iteration on the weights as they are now (after an update), for each spectral norm
        in training mode."""
        with torch.no_grad():
            for chain, i, p, n in self._held:
                if p.training and n:
                    p._power_method(p._reshape_weight_to_matrix(_input_of(chain, i)), n)

    def release(self) -> None:
        """Give the iteration back to the forward (``n_power_iterations`` as it was)."""
        for _, _, p, n in self._held:
            p.n_power_iterations = n
        self._held = []


def buffers_set_apart(module: nn.Module, names: Sequence[str], run: Callable[[int], Any],
                      examples: Sequence[int]) -> Optional[dict[str, bool]]:
    """Whether each buffer ``names`` of ``module`` (as ``named_buffers`` names it) that a training forward writes in
    place is written from the examples: ``run(i)`` (a forward and backward on example ``i`` alone, without the
    per-example engine) is run from the same buffers on the first example twice and on the second, and a buffer the
    second sets apart from the first, where the first's two runs agree, is the batch's (a scale set from ``|x|`` in a
    forward pre-hook); one written alike is the weights' (a power iteration of the user's own parametrization
    advancing ``u`` from ``W``). For the refusal's text only (the write is refused either way: the engine cannot run
    through it); ``None`` when a run fails, the runs on the same example disagree, or fewer than two examples. The
    buffers are left as they were."""
    buffers = dict(module.named_buffers())
    held = {name: buffers[name] for name in names if name in buffers}
    if not held or len(examples) < 2:
        return None
    kept = {name: b.detach().clone() for name, b in held.items()}

    def once(i: int) -> dict[str, Tensor]:
        with torch.no_grad():
            for name, b in held.items():
                b.copy_(kept[name])
        run(i)
        return {name: b.detach().clone() for name, b in held.items()}
    try:
        first, again, other = once(examples[0]), once(examples[0]), once(examples[1])
    except Exception:  # noqa: BLE001  (a diagnosis only: the refusal stands without it)
        return None
    finally:
        with torch.no_grad():
            for name, b in held.items():
                b.copy_(kept[name])
    if any(not torch.equal(first[name], again[name]) for name in held):
        return None
    return {name: not torch.equal(first[name], other[name]) for name in held}
