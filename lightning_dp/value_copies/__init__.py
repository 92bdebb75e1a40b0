"""Copies of given values kept elsewhere, found by name and by value, moved and put back: the loggers' own copies of
the logged values (:mod:`lightning_dp.validators.logger_copies`) — in memory (:mod:`.in_memory`) and in the text
files they write (:mod:`.text_files`), matched as :class:`.logged_values.LoggedValues` says; a user's own logger is
rebuilt instead, re-fed its calls with the values moved (:mod:`.refed_loggers`, its files set apart:
:mod:`.logger_files`, and any other path its calls wrote: :mod:`.logger_effects`)."""
