"""examples/digits_recipe.py: one short run per kind of ladder step (augmentation multiplicity through
DPStrategy and DigitsDataModule, public pretraining with frozen features included) and the table it writes."""

from __future__ import annotations

from dataclasses import replace

from tests.examples.example_loader import load_example


def test_short_runs_and_the_table():
    recipe = load_example("digits_recipe.py", "digits_recipe_example")
    plain = replace(recipe.LADDER[0], epochs=1)
    views = replace(recipe.LADDER[-1], epochs=1, views=2, channels=8)
    pretrained = replace(next(s for s in recipe.LADDER if s.freeze), epochs=1, public=200, public_epochs=1, channels=8)
    rows = [recipe.run(plain, 3.0, 0), recipe.run(views, 3.0, 0), recipe.run(pretrained, 3.0, 0)]
    for row in rows:
        assert 0.1 < row["test"] <= 1.0 and row["sigma"] > 0
    text = recipe.table(rows, [3.0])
    assert text.splitlines()[0].startswith("| setting | ε = 3 |")
    assert f"| {plain.name} | {100 * rows[0]['test']:.1f} ± 0.0" in text
