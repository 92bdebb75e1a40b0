"""Small example models used by the CLI configs and examples."""

from lightning_dp.models.digits_cnn import DigitsCNN

__all__ = ["DigitsCNN"]
