"""Running user code again to judge what it wrote (docs/release_boundary.md, rule 3, "Your hooks run more than once";
rule 8): a starting state saved and put back (:mod:`.starting_state`), runs under variants compared with the real run
(:mod:`.runs_again`), the clocks and the unseeded draws the first run read served again to the others
(:mod:`.clock`, :mod:`.draws`). Pure torch and NumPy, below ``records/`` and ``validators/``, which both build on it."""
