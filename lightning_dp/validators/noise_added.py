"""The noise a release adds is there: every noise mechanism's ``add_noise_`` is checked where it is called.

:mod:`~lightning_dp.mode_free` takes the user's torch modes off the stack while the noise is drawn, but a draw can be
emptied without a mode (zoo36 T27–T31): ``torch.Tensor.normal_`` replaced by a function of the user's, the CPU kernel of
``aten::normal_`` overridden through ``torch.library``, ``torch.empty`` patched to return a subclass whose ``normal_``
writes zeros, the noise module's own ``torch`` name replaced by a proxy. Each left the release un-noised (σ = 100, the
weights moved as if σ were 0) while the ledger charged for σ. Where the draw went wrong does not matter to the
guarantee; what the release holds does. So every ``add_noise_`` (t ← a·t + s·z) of a library
:class:`~lightning_dp.privacy.noise.NoiseMechanism` (:func:`libraries_noise`; wrapped by :func:`checked_noise_methods`)
is checked by what it did to the tensors, whatever path the numbers took: each small tensor (≤ :data:`COPIED` elements)
is copied before the call, each large one read at :data:`SAMPLED` positions a private generator draws afresh;
after the call the added noise at those coordinates, t_after − a·t_before, is read exactly, and its energy in units of
the noise's variance per coordinate (s²·v, v: :meth:`~.NoiseMechanism.variance_factor`, 1 for independent noise, Σ_j
(C⁻¹)²_{t,j}·sens² for banded noise) is a χ² of n degrees of freedom. The read-back is rounded (the release's sum,
a·t_before and the difference, each within half an ulp): the norm read is credited with that rounding's bound before
the test (a noise below the values' float resolution, σ = 10⁻⁶ on sums near 16, reads as zeros and is not refused;
such a release carries less noise than asked whatever the code: the float format's limit, not the user's). Refused
(:class:`NoiseMissingError`, before the optimizer steps, before the ledger is charged) when a tensor's, or all of them
pooled, falls under :func:`chi2_floor` — a chance of 10⁻¹² for a legitimate draw: noise removed from any tensor of a
few numbers or more, or shrunk (to under ≈ 0.84 of itself on a large tensor, under ≈ 0.9 pooled over a large model).
The signal's size does not matter (the difference is read, not the norms).

Cost (benchmarks/cost_floor.py's MLP, 670k coordinates, 1 thread): a multi-tensor copy of the small tensors and a
gather of 4096 positions per large one before, the same reads and one multi-tensor norm after, one host read. The
check alone has little power where little is read (noise removed from a few coordinates of a large tensor, or from a
tensor of one or two numbers) and none against numbers of the right energy that are not fresh Gaussians (a function
of the data, a replay): those come from a replaced draw, which the noise path no longer calls (it computes with
torch's operations bound at import, :mod:`~lightning_dp.bound_torch`, and refuses a release once one of its own names
is replaced, :mod:`~lightning_dp.sealed_noise`, checked first by the wrapper below). A :class:`~.NoiseMechanism` of
yours (``sample`` or ``add_noise_`` overridden: a scripted or zero noise of a test) is yours to answer for.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.bound_torch import TB, VF, Generator, finfo
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.mode_free import mode_free
from lightning_dp.records.library_code import library_callable
from lightning_dp.secure_random import secure_seed
from lightning_dp.sealed_noise import check_sealed, seal

__all__ = ["COPIED", "LOG_P", "NoiseMissingError", "REPEATS", "SAMPLED", "check_noise_added", "checked_noise_methods",
           "chi2_floor", "libraries_noise", "noise_taken"]

LOG_P = math.log(1e-12)
"""Log of the chance a small tensor's legitimate noise falls under its floor (:func:`chi2_floor`)."""

COPIED = 1 << 16
"""Tensors of up to this many elements are copied before the noise (their added noise read exactly, coordinate by
coordinate); larger ones at :data:`SAMPLED` positions (no copy of a large model's gradient)."""

SAMPLED = 4096
"""Positions of a large tensor read before and after the noise (drawn afresh at each release, with replacement)."""

REPEATS = 512
"""Positions counted as repeats of others among a large tensor's :data:`SAMPLED` (of more than :data:`COPIED`: ≤ 128
expected; more than 512 has a chance under 10⁻⁵⁰): its energy, each repeat counted again, is at least the distinct
positions' χ² of SAMPLED − REPEATS degrees of freedom or more, so the floor for those keeps its chance."""


class NoiseMissingError(PrivacyConfigurationError):
    """The noise the mechanism was asked to add is not in the tensors (module docstring)."""


@functools.lru_cache(maxsize=4096)
def chi2_floor(n: int, log_p: float = LOG_P) -> float:
    """x with P(χ²_n ≤ x) ≤ e^log_p, by the Chernoff bound P(χ²_n ≤ r·n) ≤ (r·e^{1−r})^{n/2} (r < 1), solved for r."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        r = (lo + hi) / 2
        if 0.5 * n * (math.log(r) + 1.0 - r) < log_p:
            lo = r
        else:
            hi = r
    return lo * n


def noise_taken(tensors: Sequence[Tensor]) -> list[tuple[Optional[Tensor], Tensor]]:
    """What the check needs from the tensors before the noise, per tensor ``(indices, values)``: a small one's
    (≤ :data:`COPIED` elements) every value (``indices`` ``None``), a large one's values at :data:`SAMPLED` positions
    drawn from a private generator (the user's code cannot know which)."""
    with torch.no_grad():
        small = [t for t in tensors if TB.numel(t) <= COPIED]
        copies = iter(VF._foreach_mul([_flat(t) for t in small], 1.0) if small else ())  # (one copy)
        out: list[tuple[Optional[Tensor], Tensor]] = []
        for t in tensors:
            if TB.numel(t) <= COPIED:
                out.append((None, next(copies)))
                continue
            index = VF.randint(0, TB.numel(t), (SAMPLED,), generator=_generator(t.device), device=t.device)
            out.append((index, VF.index_select(_flat(t), 0, index)))
        return out


def _flat(t: Tensor) -> Tensor:
    return TB.view(t, -1) if TB.is_contiguous(t) else TB.reshape(t, -1)


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    """This module's own generator on ``device``, seeded from the OS (never torch's global one, which the user's code
    and the replays reseed)."""
    if device not in _GENERATORS:
        _GENERATORS[device] = Generator(device=device).manual_seed(secure_seed())
    return _GENERATORS[device]


def check_noise_added(tensors: Sequence[Tensor], taken: Sequence[tuple[Optional[Tensor], Tensor]], std: float,
                      scale_by: float, variance: float) -> None:
    """Refuse (:class:`NoiseMissingError`) when ``tensors`` (``taken`` by :func:`noise_taken` before the call) did
    not receive noise of standard deviation ``std``·√``variance`` per coordinate after the scaling by ``scale_by``:
    the added noise read exactly at the coordinates taken, its energy χ²-tested per tensor and pooled (module
    docstring). Non-finite values are left to the release's own finiteness check."""
    if not std > 0 or not variance > 0 or not tensors:
        return
    with torch.no_grad():
        now = [_flat(t) if index is None else VF.index_select(_flat(t), 0, index)
               for t, (index, _) in zip(tensors, taken)]
        base = VF._foreach_mul([v for _, v in taken], scale_by)
        added = VF._foreach_sub(now, base)
        norms = VF.stack(VF._foreach_norm(added) + VF._foreach_norm(now) + VF._foreach_norm(base))
        norms = TB.tolist(TB.view(TB.double(norms), 3, -1))
    scale = std * math.sqrt(variance)
    energies = [((e + _rounding(t) * (a + b)) / scale) ** 2 for e, a, b, t in zip(*norms, tensors)]
    sizes = [TB.numel(a) if index is None else SAMPLED - REPEATS for a, (index, _) in zip(added, taken)]
    read = [TB.numel(a) for a in added]
    missing = [(i, e, r) for i, (e, n, r) in enumerate(zip(energies, sizes, read))
               if n and math.isfinite(e) and e <= chi2_floor(n)]
    total = sum(sizes)
    if not missing and total and math.isfinite(sum(energies)) and sum(energies) <= chi2_floor(total):
        missing = [(-1, sum(energies), sum(read))]
    if missing:
        shown = "; ".join(f"{'all tensors' if i < 0 else f'tensor {i}'}, {n} numbers read: {got:.3g} where about {n} "
                          "was due" for i, got, n in missing[:4])
        raise NoiseMissingError(
            f"The noise the mechanism was asked to add is missing from the release ({shown}; energies in units of "
            "the noise's variance per coordinate). Something replaced the noise draw or its addition — a patched "
            "torch.Tensor.normal_, torch.empty or torch.randn, a torch.library kernel for aten::normal_, a replaced "
            "name in lightning_dp's modules, a mock of the random generator left on from a test. Nothing was "
            "released (the optimizer did not step). Remove the patch for the fit; to train without noise, train "
            "without DPStrategy (a non-private baseline) or use AdamVariant('noiseless').")


def _rounding(t: Tensor) -> float:
    """A bound on the rounding in the read-back of the added noise relative to the values' norms: the release's sum,
    a·t and the difference each rounded to within half an ulp of numbers no larger than |t_after| + |a·t_before|."""
    return 2.0 * finfo(t.dtype).eps if TB.is_floating_point(t) else 0.0


def _checked(add_noise_: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(add_noise_)
    def checked(self: Any, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        if not libraries_noise(type(self)):
            add_noise_(self, tensors, std, scale_by)
            return
        tensors = list(tensors)
        check_sealed(self, getattr(self, "_prefetcher", None), getattr(self, "_source", None))  # torch's and ours
        taken = noise_taken(tensors)
        add_noise_(self, tensors, std, scale_by)
        check_noise_added(tensors, taken, float(std), float(scale_by), float(self.variance_factor()))
    checked.__noise_checked__ = True  # type: ignore[attr-defined]
    return checked


_DRAWING = ("sample", "add_noise_", "_draw_key")
"""The methods whose code makes a mechanism's noise."""

_LIBRARIES: dict[type, bool] = {}


def libraries_noise(cls: type) -> bool:
    """Whether every method that makes ``cls``'s noise is the library's code (:func:`~lightning_dp.records.
    library_code.library_callable`, through the wrappers): the noise is then checked. A mechanism of yours that
    draws its own (a subclass overriding ``sample`` or ``add_noise_``: a scripted or zero noise in a test) is yours
    to answer for; not checked."""
    known = _LIBRARIES.get(cls)
    if known is None:
        known = _LIBRARIES[cls] = all(library_callable(getattr(cls, name)) for name in _DRAWING
                                      if getattr(cls, name, None) is not None)
    return known


def checked_noise_methods(*mode_free_names: str) -> Any:
    """The ``__init_subclass__`` of :class:`~lightning_dp.privacy.noise.NoiseMechanism`: every subclass's
    ``add_noise_`` (its own or inherited) checked (:func:`check_noise_added`), and the methods ``mode_free_names``
    run outside the user's torch modes (:func:`~lightning_dp.mode_free.mode_free`, the check inside)."""
    def init_subclass(cls: type, **kwargs: Any) -> None:
        fn = getattr(cls, "add_noise_", None)
        if callable(fn) and not getattr(fn, "__noise_checked__", False):
            setattr(cls, "add_noise_", _checked(fn))
        for name in mode_free_names:
            fn = getattr(cls, name, None)
            if callable(fn) and not getattr(fn, "__mode_free__", False):
                wrapped = mode_free(fn)
                wrapped.__mode_free__ = True  # type: ignore[attr-defined]
                setattr(cls, name, wrapped)
    return classmethod(init_subclass)


seal(__name__)
