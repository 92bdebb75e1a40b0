"""Running user code again to judge what it wrote: a starting state saved and put back, runs under variants, compared.

The release boundary judges a hook's or a fetch's write by running it again (docs/release_boundary.md, rule 3 and
"Your hooks run more than once"; a fetch's write, rule 8): from the state it started from, on the training data
exchanged or with other values handed to what the user holds, compared with what the real run wrote, and everything
put back after. :mod:`.starting_state` saves and puts back (what is saved is a parameter), :mod:`.runs_again` runs
and compares (the comparison is a parameter). Pure torch and NumPy: both ``records/`` and ``validators/`` build on it.
"""
