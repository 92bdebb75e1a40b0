"""Checks of the training records themselves: where they come from and what holds them, before and while a private fit
reads them.

One concept a module: the checks a private fit runs on its data (:mod:`.records`, the entry point), records that
repeat one another (:mod:`.repeated_records`, :mod:`.shared_records`: one record behind several rows, by copies,
views or index arithmetic; :mod:`.copied_rows`; :mod:`.user_copies`: one person's records under two user ids), where
the records come from (:mod:`.record_sources`, :mod:`.stored_sources`, :mod:`.stored_records`: files and stores a
dataset reads), copies of the records held in memory outside the dataset (:mod:`.outside_records`, :mod:`.holders`),
and reads that write state shaping later records (:mod:`.read_writes`). The release boundary's run-time checks of the
user's hooks live in :mod:`lightning_dp.validators` and use these; this room imports nothing from it.
"""
