"""Small example models used by the CLI configs and examples."""

from lightning_dp.models.digits_cnn import DigitsCNN
from lightning_dp.models.tiny_transformer import TinyTransformerLM

__all__ = ["DigitsCNN", "TinyTransformerLM"]
