"""The ``.grad`` of the trainable parameters as a step starts (rule 2 of docs/release_boundary.md): what the library
released, nothing else.

Between an update and the next step's ``zero_grad`` the ``.grad`` of every trainable parameter still holds ĝ_t, the
release; Lightning zeroes it only inside the next step's closure, *after* ``training_step`` ran. A hook that rewrites
it there (``p.grad.copy_(x[y == 1].mean(0))`` at a batch's end, in ``on_before_zero_grad`` with ``optimizer_zero_grad``
overridden to keep it) hides a statistic of the batch where no fingerprint reads it — the release compares the
gradient the next backward writes, by then replaced — and the next forward can read it (``x + self.fc.bias.grad``):
a value of the data steering a step outside the noise. :class:`ReleasedGradients` is checked as each training step
starts (``_strategy_glue.PrivateTraining.training_step``, before the user's ``training_step`` and the checks' runs of
it): every trainable parameter's ``.grad`` must be ``None``, the release as it was written
(:func:`~lightning_dp.engine_api.is_release`: neither replaced nor written in place since), or all zeros (as
``zero_grad(set_to_none=False)`` leaves it). The optimizer's own step may change ĝ in place (post-processing inside
the optimizer is allowed, rule 2; when the step runs the user's code, :mod:`.judged_updates` judges it): what it
leaves is marked as released again (a step post-hook). A parameter frozen
and written so is the hung gradient's case (``fingerprints/state_walker.hung_gradient``); ``public_state=["p.grad"]``
declares ``.grad`` writes public and turns this check off.

Cost: one dictionary look-up per trainable parameter per step while each ``.grad`` is the release or ``None``; a
``.grad`` that is neither (zeroed in place) is summed, all of them in one reduction (one device synchronisation).

Not seen: a ``.grad`` rewritten after the step started (in ``training_step`` itself before its forward: that step's
own data, judged as the forward's reads are), a ``.grad`` on a tensor that is not a trainable parameter of the model
(the hung gradients' and the kept state's walk), and a statistic kept in ``.grad`` that is then put back to the
release's values before the next step starts (no trace left to read).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_dp.engine_api import is_release, mark_released
from lightning_dp.errors import PrivacyConfigurationError

__all__ = ["ReleasedGradients", "rewritten_gradients"]


def rewritten_gradients(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """The names of the parameters in ``named`` whose ``.grad`` is neither ``None``, the release as written, nor all
    zeros."""
    left = [(name, g) for name, p in named if (g := p.grad) is not None and not is_release(g)]
    if not left:
        return []
    with torch.no_grad():
        sums = [g.detach().coalesce().values().abs().sum().float() if g.is_sparse else
                g.detach().abs().amax().float() if g.numel() else g.new_zeros((), dtype=torch.float32) for _, g in left]
        nonzero = torch.stack([s.to(sums[0].device) for s in sums]).ne(0).tolist()  # one synchronisation
    return [name for (name, _), flag in zip(left, nonzero) if flag]


class ReleasedGradients:
    """The check as each training step starts (module docstring), and the optimizers' step post-hooks that mark what
    their update leaves in ``.grad`` as released."""

    def __init__(self) -> None:
        self._watched: dict[int, Any] = {}  # id(optimizer) → its post-hook's handle

    def watch(self, optimizers: Sequence[Any]) -> None:
        """Mark ``.grad`` as released after each step of these optimizers (their own post-processing of ĝ)."""
        for optimizer in optimizers:
            optimizer = getattr(optimizer, "optimizer", optimizer)  # (Lightning's wrapper)
            if id(optimizer) not in self._watched and hasattr(optimizer, "register_step_post_hook"):
                self._watched[id(optimizer)] = optimizer.register_step_post_hook(_mark_stepped)

    def check(self, named: Sequence[tuple[str, Tensor]], public: Sequence[str] = ()) -> None:
        """Refuse a trainable parameter's ``.grad`` that is neither ``None``, the release, nor zeros (module
        docstring)."""
        if "p.grad" in public:
            return
        names = rewritten_gradients(named)
        if names:
            raise PrivacyConfigurationError(
                f"The .grad of {', '.join(names[:6])}{' and more' if len(names) > 6 else ''} was written after the "
                "last update, before this step's zero_grad (at a batch's end, in on_before_zero_grad or a callback's "
                "hook): it is neither the released gradient ĝ_t nor zeros, and this step's forward runs before "
                "Lightning zeroes it, so a value kept there (a statistic of the batch) would steer the step outside "
                "the noise. Keep such values in a buffer (judged as kept state) or compute them from public data; "
                "if the write is a function of ĝ_t and public values only, declare it: "
                "DPStrategy(public_state=['p.grad']).")

    def close(self) -> None:
        """Remove the optimizers' post-hooks."""
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()


def _mark_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if (g := p.grad) is not None and not is_release(g):  # (changed by the step itself: its own processing)
                mark_released(g)
