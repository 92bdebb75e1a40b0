"""Errors raised before training when a configuration would break the guarantee."""


class PrivacyConfigurationError(ValueError):
    """A Trainer, model or data setting is incompatible with differentially private training.

    The message always names what to change.
    """
