"""Performance settings of the private step: when the work happens and in what shapes, never what is released.

- :mod:`.noise_prefetch`: the next release's noise drawn while the current step runs (a worker thread on CPU, a side
  stream on CUDA), the same draws in the same order, each used at most once.
- :mod:`.fixed_batch`: fixed-shape physical batches (padding rows whose clip factor is 0; the Poisson accounting
  unchanged, truncation refused).
- :mod:`.scheduler_search`: a plain loop's learning-rate schedulers found by a referrer walk only when one may hold
  the optimizer (the walk costs tens of ms a step in a large process).

The privacy core (:mod:`lightning_dp.privacy`) uses both; docs/performance.md measures them.
"""
