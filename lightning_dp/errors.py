"""Errors raised before training when a configuration would break the guarantee."""


class PrivacyConfigurationError(ValueError):
    """A Trainer, model or data setting is incompatible with differentially private training.

    The message always names what to change.
    """


class KnownSeedWarning(UserWarning):
    """A seed or generator was given for the sampling or the noise: whoever knows it can re-draw what the guarantee
    assumes secret (the noise, or which steps sampled a record), so the ε reported holds only while it stays secret.
    For tests and reproducible research; production runs give none (OS-seeded generators)."""
