"""Which parameters a torch optimizer stepped in this process outside the private mechanism.

The library cannot know what data a model was fitted on, but it can know *that* weights were fitted in this process
by an optimizer that is not a private step's: a teacher trained with plain Adam on the training set before the DP fit,
then frozen and held by the student (its soft targets carry what it memorised; the ledger counts only the student's
releases). One global post-step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``, installed when
``torch.optim`` is imported with ``lightning_dp`` loaded: ``lightning_dp/__init__.py``) counts, per parameter that had
a gradient, the steps of every optimizer that is not private. Nothing is copied: a dict from the parameter's ``id`` to
a weak reference and a count (the entry goes with the parameter).

A step is private when its optimizer was marked so (:func:`mark_private`: the optimizer a
:class:`~lightning_dp.privacy.private_step.PrivateStep` was attached with, marked when its first step is verified,
before any release, or was given to its ``release(optimizer=...)``, marked at that release), when the optimizer is
one of lightning_dp's own (DP-Adam and the other post-processing variants), or when it runs inside
:func:`public_steps` (``PublicPretraining``'s loop on the public set it is given; the inputs it saw are kept, sampled,
with the parameters stepped: :mod:`.public_inputs`).
:func:`stepped_outside` reads the count; ``validators/outside_fits.py`` judges it before the first release.

What it cannot see: steps made before ``lightning_dp`` was imported, in another process (weights loaded from a file
are fresh tensors: not counted), weights copied out of a stepped tensor into a new one (``load_state_dict`` into a
fresh module, ``copy.deepcopy``), and fits that use no torch optimizer (a closed-form solution, ``param.data -= ...``).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

from lightning_dp.records.public_inputs import close_block, link_stepped, open_block
from lightning_dp.records.library_code import library_named

_STEPPED: dict[int, tuple["weakref.ref[Any]", int]] = {}
"""``id`` of a parameter stepped outside the mechanism → (a weak reference to it, the steps counted)."""
_PRIVATE: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_PUBLIC_DEPTH = [0]
_INSTALLED = [False]


def mark_private(optimizer: Any) -> None:
    """``optimizer``'s steps from now on are a private step's (its releases are the noised mean): not counted."""
    if isinstance(optimizer, Optimizer):
        _PRIVATE.add(optimizer)


@contextmanager
def public_steps() -> Iterator[None]:
    """Steps made inside are declared training on public data (``PublicPretraining``): not counted. A sample of the
    inputs the model's forward sees inside is kept with the parameters stepped (:mod:`.public_inputs`): the private fit
    they go on to refuses them if they are its training records."""
    if not _PUBLIC_DEPTH[0]:
        open_block()
    _PUBLIC_DEPTH[0] += 1
    try:
        yield
    finally:
        _PUBLIC_DEPTH[0] -= 1
        if not _PUBLIC_DEPTH[0]:
            close_block()


def stepped_outside(param: Any) -> int:
    """How many steps an optimizer outside the mechanism made on ``param`` in this process (0: none seen)."""
    held = _STEPPED.get(id(param))
    return held[1] if held is not None and held[0]() is param else 0


def _forget(key: int, ref: "weakref.ref[Any]") -> None:
    held = _STEPPED.get(key)
    if held is not None and held[0] is ref:
        del _STEPPED[key]


def _after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if _PUBLIC_DEPTH[0] and optimizer not in _PRIVATE:
        link_stepped(p for g in optimizer.param_groups for p in g["params"] if getattr(p, "grad", None) is not None)
    if _PUBLIC_DEPTH[0] or optimizer in _PRIVATE or library_named(type(optimizer), "lightning_dp."):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "grad", None) is None:
                continue
            key = id(p)
            held = _STEPPED.get(key)
            if held is None or held[0]() is not p:
                ref = weakref.ref(p, lambda r, key=key: _forget(key, r))
                held = (ref, 0)
            _STEPPED[key] = (held[0], held[1] + 1)


def install() -> None:
    """Install the global post-step hook (once)."""
    if not _INSTALLED[0]:
        register_optimizer_step_post_hook(_after_step)
        _INSTALLED[0] = True


install()
