"""examples/plain_pytorch.py: the private step in a loop without Lightning learns at the target ε."""

from __future__ import annotations

import pytest

from tests.examples.example_loader import load_example


def test_plain_loop_learns_digits_within_the_target():
    example = load_example("plain_pytorch.py", "plain_pytorch_example")
    result = example.train(epochs=3, target_epsilon=3.0)
    assert result.epsilon <= 3.0 + 1e-6 and result.epsilon == pytest.approx(3.0, rel=0.02)
    assert result.steps == 3 * 22
    assert result.test_accuracy > 0.5  # 10 classes: chance is 0.1
