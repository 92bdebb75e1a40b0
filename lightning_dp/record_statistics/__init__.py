"""What is verified about the data: statistics of the private training records computed before training and kept
outside a step, where no noise covers them (docs/release_boundary.md, rule 11). A normalisation buffer holding the
features' mean, class weights from the labels' counts, quantile bin edges, a whitening matrix, a ``max_length`` set
to the longest record: each depends on every record, and is released with the model.

- :mod:`.data_statistics`: the check, once before the first release: the holders walked, the statistics compared;
- :mod:`.training_statistics`: the training tensors' statistics (computed once, kept for the fit) and the comparison of
  a held value with them; :mod:`.scaled_records`: feature tensors scaled by their own statistics or holding
  statistics written into their cells;
- :mod:`.written_statistics`: the same statistics compared, during the fit, with the state the hooks wrote since it
  was last compared (before each release, checkpoint and the fit's end: a statistic read back from a file);
- :mod:`.order_statistics`: per-feature minima, maxima, medians and quantiles at any level, and exact data values;
- :mod:`.second_moments`: a [D, D] whitening, covariance or correlation matrix, its inverse or Cholesky factor;
- :mod:`.near_statistics`: vectors within a rounding or subsample error of a statistic, beyond chance (rounded,
  of a random part of the rows, of the rows with others); :mod:`.number_tables`: dicts and lists of per-column
  numbers read as vectors;
- :mod:`.conditional_statistics`: class-conditional means, standard deviations and variances (a prototype head);
- :mod:`.derived_columns`: per-record columns derived from the labels (balanced weights, a target encoding);
- :mod:`.loader_statistics`: the training loader's collate function, sampler and transforms as holders;
- :mod:`.read_records`: the records the items read from outside the dataset (a global ``X[i]``) as record sources;
- :mod:`.record_lengths`: the records' lengths kept as a setting (the longest record's token count);
- :mod:`.imputed_cells`, :mod:`.grouped_fills`, :mod:`.neighbour_copies`, :mod:`.decorrelated_columns`,
  :mod:`.rank_columns`: statistics written into the features themselves (missing cells filled with the column's
  mean or median, or its class's or group's, or copied or interpolated from the neighbouring records; a PCA
  projection, rank transforms and quantile bins).
- :mod:`.released_statistics`: what a DP mechanism released and a ledger charged (a private standardiser's mean and
  standard deviation), which the check lets through.

It stands below the checks of a step (:mod:`lightning_dp.validators` imports it, never the reverse) and above
:mod:`lightning_dp.fingerprints` and :mod:`lightning_dp.records`, whose row digests tell a copy of the records
(:func:`~lightning_dp.records.held_records.holds_records`) from a statistic of them.
"""
