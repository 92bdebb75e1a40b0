"""Which numbers are the logged values' copies (lightning_dp/value_copies/logged_values.py)."""

from __future__ import annotations

import torch

from lightning_dp.value_copies.logged_values import LoggedValues, significant

LOSS = float(torch.tensor(0.6412345))  # a float32 value, as Lightning hands it to the loggers


def _logged(**kwargs) -> LoggedValues:
    return LoggedValues({"train_loss"}, {"train_loss": [torch.tensor(0.6412345), 0.5, 3.0]},
                        (lambda v: v + 100, lambda v: v - 100), **kwargs)


def test_a_copy_is_found_as_a_float64_a_float32_or_rounded_to_four_digits_or_more():
    logged = _logged()
    assert logged.of(LOSS) == "train_loss"
    assert logged.of(float(torch.tensor(LOSS, dtype=torch.float64).float().double())) == "train_loss"
    assert logged.of(0.6412, "0.6412") == "train_loss" and logged.of(0.6412) == "train_loss"
    assert logged.of(0.641, "0.641") is None, "three digits: too short to tell"
    assert logged.of(0.6413) is None


def test_whole_and_short_values_are_found_by_name_only():
    logged = _logged()
    assert logged.of(0.5) is None and logged.of(3.0) is None  # a learning rate, a step count
    assert logged.named("train_loss") == "train_loss" and logged.named("val_loss") is None


def test_the_name_before_a_number_on_its_line_is_its_name():
    logged = _logged(keys={"fit-train_loss"})
    assert logged.before('{"step": 3, "train_loss": ') == "train_loss"
    assert logged.before("epoch=1 fit-train_loss=") == "fit-train_loss"
    assert logged.before("3,train_loss,") == "train_loss"
    assert logged.before("val-train_loss=") is None and logged.before("train_loss_count ") is None


def test_significant_digits():
    assert [significant(t) for t in ("0.6412", "1e-05", "12.5", "0.0001")] == [4, 1, 3, 1]
