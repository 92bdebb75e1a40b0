"""examples/lm_recipe.py: a few steps of the last ladder row (EMA, larger batch) and the table it writes."""

from __future__ import annotations

import math
from dataclasses import replace

from tests.examples.example_loader import load_example


def test_short_run_and_the_table():
    recipe = load_example("lm_recipe.py", "lm_recipe_example")
    row = recipe.run(replace(recipe.LADDER[-1], steps=3, batch_size=32), 3.0, 0, max_train_windows=256)
    assert row["sigma"] > 0 and math.isclose(row["perplexity"], math.exp(row["val_loss"]))
    assert 1.0 < row["perplexity"] < 1000.0  # a byte model: 256 is uniform guessing
    text = recipe.table([row])
    assert text.splitlines()[2].startswith(f"| {recipe.LADDER[-1].name} | {row['perplexity']:.2f} ± 0.00")
