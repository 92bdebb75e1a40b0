"""The Gaussian mechanism's settings as decisions: σ, the clipping policy (flat clipping's C, an adaptive policy's
configuration) and what else decides a release (the policy's state, the noise, the sampling plan), read from a private
step (:func:`step_mechanism`, :func:`mechanism_state`), as fingerprint entries (:func:`mechanism_entries`), and put back
after a replay (:func:`put_mechanism_settings`). Set from the data between releases, they steer the next one.
"""

from __future__ import annotations

from typing import Any

from lightning_dp.clipping.flat import FlatClipping
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.records.identity import Same

def mechanism_settings(loop: Any) -> dict[str, Any]:
    """The Gaussian mechanism's settings where ``loop`` (a trainer) trains with a private strategy
    (:func:`step_mechanism` of its private step); none without one."""
    return step_mechanism(getattr(getattr(loop, "strategy", None), "private_step", None))


def step_mechanism(step: Any) -> dict[str, Any]:
    """A private step's σ (``noise_multiplier``) and clipping policy (``clipping``: flat clipping by its C; a policy
    that moves its own bound, by the policy object, whose moves are its own releases', and its configuration — an
    adaptive policy's target quantile and learning rate: ``ClippingPolicy.settings``). Set from the data between two
    releases — a C from the batch's losses, a σ lowered once the loss crosses a threshold — they steer the next release
    by un-noised data, and C is released with every step (the noise's scale, ``privacy/clip_norm``)."""
    if step is None or not hasattr(step, "clipping"):
        return {}
    clipping = step.clipping
    bound = ("C", clipping.max_grad_norm) if isinstance(clipping, FlatClipping) else \
        (type(clipping), Same(clipping), clipping.settings())
    return {"noise_multiplier": step.noise_multiplier, "clipping": bound, "policy": clipping}


def mechanism_decisions(loop: Any) -> Fingerprint:
    """:func:`mechanism_settings` as fingerprint entries (``"privacy noise_multiplier"``, ``"privacy clipping"``)."""
    return mechanism_entries(mechanism_settings(loop))


def mechanism_entries(settings: dict[str, Any]) -> Fingerprint:
    """:func:`step_mechanism`'s settings as fingerprint entries (``"privacy noise_multiplier"``)."""
    return {f"privacy {k}": v for k, v in settings.items() if k != "policy"}


def mechanism_state(step: Any) -> Fingerprint:
    """:func:`step_mechanism`'s entries with what else decides the next release's noise and clipping: the clipping
    policy's own settings and state (its bound, quantile, rates, budgets: a policy's attribute set by hand), the noise
    mechanisms in use (which objects, their public settings) and the sampling plan the ledger charges (q, B). What a
    step may not change between its ``begin`` and its release (nor a plain loop between releases, unless declared)."""
    out = mechanism_entries(step_mechanism(step))
    if not out:
        return out
    out["privacy clipping state"] = _scalar_settings(step.clipping, private=True)
    for name, noise in (("noise", getattr(step, "noise", None)),
                        ("release noise", getattr(getattr(step, "_privatizer", None), "noise", None))):
        if noise is not None:
            out[f"privacy {name}"] = (Same(noise), _scalar_settings(noise, private=False))
    plan = getattr(step, "plan", None)
    out["privacy sampling"] = None if plan is None else repr(plan)
    return out


def _scalar_settings(obj: Any, private: bool) -> tuple[tuple[str, str], ...]:
    """``obj``'s attributes that are numbers, strings, flags or dicts of them, as text (``private``: the underscored
    ones too: a policy's bound is ``_bound``)."""
    items = []
    for name, value in sorted(getattr(obj, "__dict__", {}).items()):
        if name.startswith("_") and not private:
            continue
        if isinstance(value, dict) and all(isinstance(v, (bool, int, float, str)) for v in value.values()):
            items.append((name, repr(sorted((str(k), v) for k, v in value.items()))))
        elif value is None or isinstance(value, (bool, int, float, str)):
            items.append((name, repr(value)))
    return tuple(items)


def put_mechanism_settings(loop: Any, settings: dict[str, Any]) -> None:
    """σ and the clipping policy of ``loop``'s private step set back to ``settings`` (:func:`mechanism_settings`)."""
    step = getattr(getattr(loop, "strategy", None), "private_step", None)
    if step is None or not settings:
        return
    if step.noise_multiplier != settings["noise_multiplier"]:
        step.noise_multiplier = settings["noise_multiplier"]
    if step.clipping is not settings["policy"]:
        step.clipping = settings["policy"]
    bound = settings.get("clipping")
    if isinstance(bound, tuple) and len(bound) == 3:  # a policy's configuration (ClippingPolicy.settings) as noted
        for key, value in bound[2]:
            if getattr(step.clipping, key, value) != value:
                setattr(step.clipping, key, value)
