"""The batch check's refusal names half precision first when the step computed in it (zoo37 T36: a float16 model
with a batch of 2,000 was refused as "examples interact", the rounding of its sums unnamed)."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.batch_check import batch_interaction_error
from lightning_dp.validators.step_checks import _named_precision


def _refusal() -> PrivacyConfigurationError:
    return batch_interaction_error(0, 1945, 128, [], "ghost")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_named_first(dtype: torch.dtype) -> None:
    named = _named_precision(_refusal(), dtype, low=False)
    assert isinstance(named, PrivacyConfigurationError)
    assert str(named).startswith(f"The step computed in {dtype}") and "precision='bf16-mixed'" in str(named)
    assert "Examples interact at step 0" in str(named)  # what the check saw, kept


@pytest.mark.parametrize("dtype, low, error", [
    (torch.float32, False, _refusal()), (torch.float64, False, _refusal()),
    (torch.float16, True, _refusal()),  # the tolerance is already half precision's: the interaction is real
    (torch.float16, False, PrivacyConfigurationError("The optimizer's update read the training data")),
])
def test_other_refusals_and_float32_steps_are_left_as_they_are(dtype: torch.dtype, low: bool,
                                                               error: Exception) -> None:
    assert _named_precision(error, dtype, low) is error
