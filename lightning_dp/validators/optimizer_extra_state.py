"""An optimizer's state beyond its moments: entries kept under keys that are not its parameters, and values that are
not tensors (rule 3 of docs/release_boundary.md: the optimizer's state).

``optimizer.state`` maps each parameter to its moments, and those are compared (identity and version counter) from a
step's start to its release and by the first step's replays. The mapping takes any key and any value: a loss-aware
step size that keeps the last batch loss as ``optimizer.state["loss_scale"]`` or ``optimizer.state[p]["scale"]``
(a Polyak-like rule, written in ``training_step`` or a batch hook, read by the optimizer's ``step`` at the next
update) steers every later update by an un-noised value of the batch (zoo16 o1, o2, o3: the weights of neighbouring
datasets part after a step that did not sample the changed record).

- :func:`extra_state`: every key of ``optimizer.state`` that is not a parameter of its groups, as fingerprint entries
  (``"optimizer kept['loss_scale']"``) judged as the hyper-parameters are: a write within the step is refused before
  its release, a value the first step's replays set apart (from other data) is refused, one they set alike (a count
  of steps) is kept;
- :func:`rebound_state`: those and the parameters' entries that are not tensors (a number rebound at every write),
  for the decision windows (:mod:`.decisions`), which note them at a batch's or an epoch's end like a learning rate;
  :func:`saved_state` and :func:`put_state` put them back after each run of the hooks (the first step's replays,
  a window's runs), so a count kept there is counted once.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import Tensor

from lightning_dp.fingerprints.state_walker import freeze

__all__ = ["extra_state", "rebound_state", "saved_state", "put_state"]


def extra_state(optimizer: Any) -> dict[str, Hashable]:
    """The entries of ``optimizer.state`` whose key is not a parameter of its ``param_groups``, as fingerprint entries
    (``"optimizer kept['loss_scale']"``; a tensor key that is no group's parameter: by its position among them)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return {}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    out: dict[str, Hashable] = {}
    for i, (key, value) in enumerate(list(state.items())):
        if isinstance(key, Tensor) and id(key) in held:
            continue
        label = repr(key) if isinstance(key, (str, int, float, bool)) else f"{type(key).__name__} #{i}"
        out[f"optimizer kept[{label}]"] = freeze(value)
    return out


def rebound_state(optimizer: Any) -> dict[str, Hashable]:
    """:func:`extra_state` and each parameter's state entries that are not tensors (``"optimizer
    state[0][1].scale"``: group, parameter, key): what a hook outside the step may set for later updates."""
    out = extra_state(optimizer)
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, Tensor):
                    out[f"optimizer state[{i}][{j}].{key}"] = freeze(value)
    return out


def saved_state(optimizer: Any) -> dict[Any, Any]:
    """A shallow copy of ``optimizer.state`` (each parameter's entries copied one level): :func:`put_state` sets the
    entries a hook rebinds back after each of a replay's runs (a tensor written in place is not put back: the moments'
    checks refuse that)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return {}
    return {key: dict(value) if isinstance(value, dict) else value for key, value in state.items()}


def put_state(optimizer: Any, saved: dict[Any, Any]) -> None:
    """``optimizer.state`` as :func:`saved_state` took it: keys added since removed, the entries rebound set back."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for key in [k for k in state if k not in saved]:
        del state[key]
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            state[key].clear()
            state[key].update(value)
        else:
            state[key] = value
