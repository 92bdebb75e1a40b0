"""Errors raised before training when a configuration would break the guarantee, and what their messages share."""

from __future__ import annotations

from typing import Any, Callable, Sequence


class PrivacyConfigurationError(ValueError):
    """A Trainer, model or data setting is incompatible with differentially private training.

    The message always names what to change.
    """


class KnownSeedWarning(UserWarning):
    """A seed or generator was given for the sampling or the noise: whoever knows it can re-draw what the guarantee
    assumes secret (the noise, or which steps sampled a record), so the ε reported holds only while it stays secret.
    For tests and reproducible research; production runs give none (OS-seeded generators)."""


class PackedRecordsWarning(UserWarning):
    """The training records look packed: token rows holding several documents or pieces of them (``group_texts``,
    bin-packing, two texts joined), so DP per record does not bound one document's influence
    (:mod:`lightning_dp.validators.packed_records`). Made an error, the fit is refused before any release instead."""


class OutsideStepsWarning(UserWarning):
    """A private fit starts from trainable weights that an optimizer outside the private step moved in this process
    (a plain loop, a fit without ``DPStrategy``): if those steps saw the private data they are releases no ledger
    counts. Steps on public data go inside :func:`lightning_dp.public_steps` (or ``PublicPretraining``); steps on the
    private data must be charged (train with ``DPStrategy`` or a ``PrivateStep``). Made an error
    (``warnings.simplefilter("error", OutsideStepsWarning)``), the fit is refused before any release instead."""


class RandomStepWarning(UserWarning):
    """The step draws random numbers of its own outside dropout (a VAE's reparameterisation ``torch.randn_like``,
    augmentation in ``training_step``, Hugging Face's SpecAugment), so the first step's probe could not compare each
    example's gradient in a batch with its gradient alone and checked less (:mod:`lightning_dp.validators.
    random_draws`); the batch check still compares batches. Filter it where the draws are each example's own noise
    entering only that example's loss."""


def warn_or_refuse(category: type[Warning], message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` as ``category``; where the user made ``category`` an error (``warnings.simplefilter("error",
    category)``), refuse instead with :class:`PrivacyConfigurationError` (before any release: callers check first)."""
    import warnings

    try:
        warnings.warn(category(message), stacklevel=stacklevel)
    except category:
        raise PrivacyConfigurationError(f"Refused ({category.__name__} is an error here): {message}") from None


def listed(items: Sequence[Any], describe: Callable[[Any], str] = str, sep: str = ", ") -> str:
    """The first six of ``items`` described, joined by ``sep``, then " and N more" for the rest (a refusal's list)."""
    more = f" and {len(items) - 6} more" if len(items) > 6 else ""
    return sep.join(describe(item) for item in items[:6]) + more
