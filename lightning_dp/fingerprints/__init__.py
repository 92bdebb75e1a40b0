"""How a step's kept state is read into comparable digests: the machinery the release boundary's and the replays'
fingerprints share, below the checks that judge them (:mod:`lightning_dp.validators`).

- :mod:`.module_tree`: the module tree's shape, and which of a module's attributes are state or configuration;
- :mod:`.fingerprint_entries`: a fingerprint (entry name → token) and how two compare;
- :mod:`.checksums`: tokens of contents — tensors' content sums, norms, NumPy arrays, byte containers and streams;
- :mod:`.state_walker`: the walk of the user's Python values, callables and class bodies into tokens, and the same
  rules for plain values held outside the modules (:func:`~.state_walker.freeze`, :func:`~.state_walker.closure_token`);
- :mod:`.callback_state`: which callbacks are trusted and what of a callback is state;
- :mod:`.dataset_tokens`: the training data as the fingerprint reads it;
- :mod:`.context_values`: the values ``contextvars.ContextVar`` globals hold;
- :mod:`.replaced_objects`: the layers and parameters a baseline held, and the entries of those put in place since;
- :mod:`.held_numbers`: the Python numbers and strings the user's state holds, given other values for the logger
  judge's run again (:mod:`lightning_dp.validators.logger_judge`).

It imports nothing from the checks (:mod:`lightning_dp.validators` imports it, never the reverse); only
:mod:`lightning_dp.records` and the standard libraries.
"""
