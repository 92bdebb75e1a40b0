"""No raw gradient observable: hooks on parameters see the batch gradient before the release.

A tensor hook on a parameter (``p.register_hook``) or a post-accumulate hook
(``p.register_post_accumulate_grad_hook``) is called by autograd with the parameter's raw batch
gradient, unclipped and un-noised, during the backward — before the release can replace it. Gradient
statistics built that way (an EWC Fisher, gradient-norm logs) would leave the step without noise. The
Lightning hooks that read ``p.grad`` (``on_after_backward``, ``on_before_optimizer_step``) run after the
release and see ĝ_t; parameter hooks cannot, so they are refused. Hooks the engine itself registers while
attaching are allowed (recorded by :func:`gradient_hooks` before and after).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError

HookKeys = dict[int, frozenset[tuple[str, int]]]


def gradient_hooks(params: Sequence[Tensor]) -> HookKeys:
    """The gradient hooks on each parameter: ``id(p)`` → {("tensor" | "post-accumulate", handle id)}."""
    out: HookKeys = {}
    for p in params:
        keys = [("tensor", k) for k in (p._backward_hooks or {})]
        keys += [("post-accumulate", k) for k in (getattr(p, "_post_accumulate_grad_hooks", None) or {})]
        if keys:
            out[id(p)] = frozenset(keys)
    return out


def user_hooked(named: Sequence[tuple[str, Tensor]], allowed: HookKeys) -> list[str]:
    """Names of parameters holding a gradient hook that is not in ``allowed`` (the engine's own). A parameter
    without any hook (the usual case) costs two attribute reads; only hooked ones are compared key by key."""
    out = []
    for name, p in named:
        if not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None):
            continue
        if gradient_hooks([p]).get(id(p), frozenset()) - allowed.get(id(p), frozenset()):
            out.append(name)
    return out


def hooked_error(names: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of parameter gradient hooks, with the fix."""
    shown = ", ".join(names[:6]) + (" …" if len(names) > 6 else "")
    return PrivacyConfigurationError(
        f"Parameter(s) {shown} carry a gradient hook (Tensor.register_hook or register_post_accumulate_grad_hook): "
        "autograd calls it with the raw batch gradient, before clipping and noise, so whatever it computes or keeps "
        "leaves the step unprotected. Nothing was released. Read gradients in on_after_backward or "
        "on_before_optimizer_step instead: under the private strategies p.grad holds the released (clipped, noised) "
        "gradient there. Remove the hook (handle.remove()).")
