"""Optimizer ⊆ mechanism: every tensor the optimizer updates is one the mechanism privatises.

The release writes ĝ_t into ``p.grad`` for the model's trainable parameters, the tensors the engine
clips. A tensor the optimizer holds that is not one of them — a plain ``torch.ones(1, requires_grad=True)``
temperature, the parameters of modules kept in a Python list or dict (never registered, so never
hooked), a parameter group added to the optimizer later — keeps its raw batch gradient from autograd
and would be stepped with it: no clipping, no noise. Checked before every release (the param groups
can grow at any time), in O(number of tensors), by the release boundary (rule 1 of
:mod:`lightning_dp.privacy.boundary`), which refuses with :func:`uncovered_error`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp.errors import PrivacyConfigurationError, listed


def uncovered_tensors(optimizer: Optimizer, covered: Sequence[Tensor]) -> list[tuple[int, Tensor]]:
    """(group index, tensor) for every tensor of ``optimizer`` that requires grad and is not in ``covered``."""
    ids = {id(p) for p in covered}
    return [(g, t) for g, group in enumerate(optimizer.param_groups) for t in group["params"]
            if isinstance(t, Tensor) and t.requires_grad and id(t) not in ids]


def where_held(module: nn.Module, tensor: Tensor) -> Optional[str]:
    """The attribute path by which ``module`` holds ``tensor`` outside its registered parameters
    (``temperature``, ``heads[1].weight``), or ``None``."""
    for prefix, m in module.named_modules():
        for key, value in vars(m).items():
            path = f"{prefix}.{key}" if prefix else key
            found = _find(value, tensor, path)
            if found is not None:
                return found
    return None


def _find(value: Any, tensor: Tensor, path: str) -> Optional[str]:
    if value is tensor:
        return path
    if isinstance(value, nn.Module):
        return next((f"{path}.{name}" for name, p in value.named_parameters() if p is tensor), None)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if isinstance(item, (Tensor, nn.Module)):
            found = _find(item, tensor, f"{path}[{key!r}]")
            if found is not None:
                return found
    return None


def uncovered_error(module: nn.Module, missing: Sequence[tuple[int, Tensor]]) -> PrivacyConfigurationError:
    """The refusal naming each uncovered tensor and the fix."""
    def described(entry: tuple[int, Tensor]) -> str:
        group, t = entry
        name = where_held(module, t)
        what = f"'{name}'" if name else "a tensor the model does not hold as an attribute"
        return f"{what} (param group {group}, shape {list(t.shape)})"

    return PrivacyConfigurationError(
        "The optimizer updates tensors the private mechanism does not cover: " + listed(missing, described, "; ")
        + ". They would be stepped with their raw batch gradient, without clipping or noise. Nothing was released. "
        "Make each one a registered parameter of the model (self.temperature = nn.Parameter(torch.ones(1)); "
        "nn.ModuleList / nn.ModuleDict for modules kept in a list or dict), or leave it out of the optimizer "
        "(configure_optimizers: self.parameters()).")
