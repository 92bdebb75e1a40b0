"""Everything the mechanism verifies about the user's model, loss and loader, in one room.

Per-example clipping bounds one example's influence on the released sum by C only under
assumptions about the user's code. Each is checked here, at the latest before the release it
would otherwise corrupt, and refused with an error that names the fix:

- :mod:`.layers`: layers that mix examples (BatchNorm without running statistics,
  ``scale_grad_by_freq``) or have no per-example rule (static, before training); a BatchNorm
  forward in training mode and an ``nn.EmbeddingBag(mode="max")`` call on a flat input with offsets
  (a forward pre-hook, every call; modes sum and mean are served there).
- :mod:`.example_dim`: every captured call holds one row per sampled example (every step); rows of
  flattened examples only where the flattening is a verified view (``flattened_rows``); calls with no
  example dimension at all (``unbatched_call``) only where the model broadcasts them over the examples
  (:mod:`~lightning_dp.grad_sample.capture.broadcast_sites`, whose examples' gradients must add up every step).
- :mod:`.probe`: on the first step, example i's per-example gradient does not depend on the
  other examples of the batch (no interaction through the loss or the model, no summed loss),
  and the engine's gradient equals autograd's (every use of every parameter captured).
- :mod:`.batch_check` (when: :mod:`.schedule`): the same on a step's own sampled batch — as one
  batch, as two halves and two examples alone — on the first step and at random later steps
  (or every step); the checks' passes leave the generators as they were (:mod:`.rng`).
- :mod:`lightning_dp.record_checks.records`: each index reads one fixed record, each record is in the data once.

What leaves a step besides the noised update (kept state, raw gradients, uncovered optimizer
tensors) is the release boundary's to refuse: :mod:`lightning_dp.privacy.boundary`.
- :mod:`.loaders`: the training loader's sampler can be replaced by Poisson sampling without
  training on examples the user held out.
"""

from lightning_dp.validators.example_dim import (
    check_example_dim,
    check_something_captured,
    example_dim_error,
    missing_gradient_error,
)
from lightning_dp.validators.layers import batch_mixing_layers, validate_module

__all__ = [
    "batch_mixing_layers",
    "check_example_dim",
    "check_something_captured",
    "example_dim_error",
    "missing_gradient_error",
    "validate_module",
]
