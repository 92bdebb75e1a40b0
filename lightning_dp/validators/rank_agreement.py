"""One mechanism on every rank: the ranks of a DDP or FSDP2 run agree on the settings the guarantee rests on.

Under several processes each rank samples, clips and sums its own shard; the noise is added once (DDP: by rank 0,
at σ·C of rank 0) or per owned shard (FSDP2), and the ledger charges one q. The guarantee is the one of a single
process only if every rank uses the same mechanism: the same C and clipping policy (a rank clipping at 100·C has
its examples' sensitivity 100·C under noise σ·C), the same q and expected batch (a rank drawing its shard at a
higher rate than the ledger charges), one population sharded disjointly (a per-rank ``SubsetRandomSampler`` split
puts a record in two ranks' shards: sampled twice per step) and one partition into users (ids computed per process,
a salted ``hash()``, put one person's records into units of several ranks).

- :func:`check_ranks_agree` runs once per training loader
  (:meth:`~lightning_dp.validators.step_checks.StepChecks.check_ranks_agree`, from ``PrivateStep.poisson_loader``):
  every rank digests each setting (:func:`mechanism_settings`) and all-gathers the digests (and the numeric values,
  to name them). Any difference is refused on every rank alike (the verdict is computed from the same gathered
  tensors everywhere: no rank is left waiting in a collective), naming the setting and the ranks' values.
- :func:`release_agreement` folds σ, C and the clipping policy's settings into the all-reduce every release already
  runs (``StepChecks.on_every_rank``, the boundary's release check): small hashes h and h² of each, summed; the ranks
  agree iff W·Σh² = (Σh)² for each (equality in Cauchy–Schwarz), which every rank computes from the same sums.

The population compared is the *global* one (the sampler's indices before the library shards it by rank): the
ranks' shards are disjoint positions of it, so it must be the same list on every rank.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_dp.errors import PrivacyConfigurationError

Setting = tuple[str, Any, Optional[float]]
"""(name, the value digested, the value shown per rank when numeric)."""

_HASH_BITS = 24  # h < 2^24: Σh² over up to 2^14 ranks fits int64 exactly


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _stable(value: Any) -> bytes:
    """Bytes of ``value`` that are the same in every process (no ``hash()``: it is salted per process)."""
    if isinstance(value, float):
        return value.hex().encode()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes()
    if isinstance(value, (list, tuple)):
        return b"(" + b",".join(_stable(v) for v in value) + b")"
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a NumPy array
        return str(value.dtype).encode() + str(getattr(value, "shape", "")).encode() + value.tobytes()
    return repr(value).encode()


def _digest(value: Any, bits: int = 63) -> int:
    full = int.from_bytes(hashlib.blake2b(_stable(value), digest_size=8).digest(), "little")
    return full & ((1 << bits) - 1)


def _guarded(read: Callable[[], Any]) -> Any:
    """A setting's value, or the name of what reading it raised: every rank reaches the collective."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001  (compared like any value; the later checks refuse by name)
        return f"unreadable ({type(err).__name__})"


def _population(population: Any) -> Any:
    indices = getattr(population, "indices", None)
    if indices is None:
        return ("all", int(population.num_samples))
    return ("indices", int(population.num_samples), torch.as_tensor([int(i) for i in indices], dtype=torch.int64))


def _partition(sampler: Any) -> Any:
    members = getattr(sampler, "members", None)
    if members is None:
        return None
    return ("users", len(members), hashlib.blake2b(b"".join(_stable(m) for m in members), digest_size=16).digest())


def _noise(noise: Any) -> Any:
    return (type(noise).__name__, int(getattr(noise, "bands", 1)), getattr(noise, "coefficients", None))


def mechanism_settings(step: Any, population: Any, sampler: Any) -> list[Setting]:
    """The settings of ``step`` (a ``PrivateStep``) every rank must share, in a fixed order (the same list on every
    rank, whatever its values: the gathered tensors line up)."""
    plan = step.plan
    users = step.users
    read: list[tuple[str, Callable[[], Any]]] = [
        ("noise_multiplier σ", lambda: step.noise_multiplier),
        ("target (ε, δ) σ is calibrated for", lambda: (step.target_epsilon, step.target_delta)),
        ("max_grad_norm C", lambda: step.max_grad_norm),
        ("clipping policy", lambda: (type(step.clipping).__name__, step.clipping.settings())),
        ("sample rate q", lambda: plan.sample_rate),
        ("expected batch size B", lambda: plan.expected_batch_size),
        ("loader batch size (per process)", lambda: population.batch_size),
        ("population size N", lambda: plan.num_samples),
        ("steps per epoch", lambda: plan.steps_per_epoch),
        ("noise mechanism (banded / min-separation settings)", lambda: _noise(step.noise)),
        ("training population (the sampler's indices)", lambda: _population(population)),
        ("privacy unit", lambda: None if users is None else (
            type(users).__name__, users.users_per_batch, users.max_examples_per_user)),
        ("partition into users", lambda: _partition(sampler)),
        ("fixed batch size", lambda: step.fixed_batch_size),
        ("secure mode", lambda: step.secure_sampling),
    ]
    settings = []
    for name, get in read:
        value = _guarded(get)
        settings.append((name, value, _number(value)))
    return settings


def _collective_device() -> Optional[torch.device]:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def check_ranks_agree(step: Any, population: Any, sampler: Any) -> None:
    """Refuse, on every rank alike, a run whose ranks disagree on a setting of :func:`mechanism_settings` (two
    all-gathers of K numbers each, once per training loader; nothing when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    settings = mechanism_settings(step, population, sampler)
    compare_across_ranks(settings, dist.get_world_size())


def compare_across_ranks(settings: Sequence[Setting], world: int) -> None:
    """All-gather the settings' digests and numeric values; raise on every rank when any digest differs."""
    import torch.distributed as dist

    device = _collective_device()
    digests = torch.tensor([_digest(v) for _, v, _ in settings], dtype=torch.int64, device=device)
    shown = torch.tensor([math.nan if n is None else n for _, _, n in settings], dtype=torch.float64, device=device)
    every_digest = [torch.empty_like(digests) for _ in range(world)]
    every_shown = [torch.empty_like(shown) for _ in range(world)]
    dist.all_gather(every_digest, digests)
    dist.all_gather(every_shown, shown)
    gathered = torch.stack(every_digest).cpu()
    values = torch.stack(every_shown).cpu()
    differing = [k for k in range(len(settings)) if not bool((gathered[:, k] == gathered[0, k]).all())]
    if differing:
        raise disagreement_error([settings[k][0] for k in differing],
                                 [[float(v) for v in values[:, k]] for k in differing])


def disagreement_error(names: Sequence[str], per_rank: Sequence[Sequence[float]] = (),
                       where: str = "when the training loader was set up") -> PrivacyConfigurationError:
    """The refusal every rank raises when the ranks' mechanisms differ."""
    described = []
    for k, name in enumerate(names):
        values = per_rank[k] if k < len(per_rank) else ()
        if values and not any(math.isnan(v) for v in values):
            described.append(f"{name}: " + ", ".join(f"rank {r} {v:g}" for r, v in enumerate(values)))
        else:
            described.append(f"{name} (differs between ranks)")
    return PrivacyConfigurationError(
        f"The ranks do not run the same mechanism ({where}): " + "; ".join(described) + ". Under DDP or FSDP2 every "
        "rank clips and samples its own shard while the noise and the ledger are one rank's: a rank with a larger C, "
        "a higher q, a population of its own (a per-rank split or sampler: records in two ranks' shards are sampled "
        "twice per step) or a partition into users of its own (ids from a per-process salted hash()) breaks the "
        "guarantee the ledger reports. Nothing more was released. Configure the privacy settings, the loader's "
        "batch_size, the sampler's indices and the user ids alike on every rank (fixed seeds, not seed + rank; no "
        "setting chosen per device).")


RELEASE_SETTINGS = ("noise_multiplier σ", "max_grad_norm C", "clipping policy")


def release_values(step: Any) -> list[Any]:
    """σ, C and the clipping policy's settings of ``step`` now, as every release compares them across ranks."""
    return [_guarded(lambda: step.noise_multiplier), _guarded(lambda: step.max_grad_norm),
            _guarded(lambda: (type(step.clipping).__name__, step.clipping.settings()))]


def release_agreement(values: Sequence[Any]) -> list[int]:
    """The int64 terms [h, h², …] of ``values`` to add to a SUM all-reduce (:func:`differing_release_values`)."""
    terms = []
    for value in values:
        h = _digest(value, _HASH_BITS)
        terms += [h, h * h]
    return terms


def differing_release_values(summed: Sequence[int], world: int) -> list[str]:
    """The names of :data:`RELEASE_SETTINGS` whose summed terms show the ranks disagree (W·Σh² ≠ (Σh)²)."""
    return [name for k, name in enumerate(RELEASE_SETTINGS)
            if world * int(summed[2 * k + 1]) != int(summed[2 * k]) ** 2]
