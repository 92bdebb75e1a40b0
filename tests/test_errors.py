"""lightning_dp/errors.py: the strict-able warnings warn, or refuse where the user made them errors."""

from __future__ import annotations

import warnings

import pytest

from lightning_dp.errors import (OutsideStepsWarning, PackedRecordsWarning, PrivacyConfigurationError, listed,
                                 warn_or_refuse)


@pytest.mark.parametrize("category", [OutsideStepsWarning, PackedRecordsWarning])
def test_a_warning_by_default(category):
    with pytest.warns(category, match="what was found"):
        warn_or_refuse(category, "what was found")


@pytest.mark.parametrize("category", [OutsideStepsWarning, PackedRecordsWarning])
def test_a_refusal_naming_the_warning_when_it_is_an_error(category):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category)
        with pytest.raises(PrivacyConfigurationError, match=rf"^Refused \({category.__name__} is an error here\): x"):
            warn_or_refuse(category, "x")


def test_another_warning_made_an_error_does_not_refuse():
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutsideStepsWarning)
        with pytest.warns(PackedRecordsWarning):
            warn_or_refuse(PackedRecordsWarning, "x")


def test_a_refusals_list_names_six_then_counts_the_rest():
    assert listed(["a", "b"]) == "a, b"
    assert listed([str(i) for i in range(6)]) == "0, 1, 2, 3, 4, 5"
    assert listed([str(i) for i in range(9)]) == "0, 1, 2, 3, 4, 5 and 3 more"
    assert listed(list(range(8)), lambda i: f"<{i}>", "; ") == "<0>; <1>; <2>; <3>; <4>; <5> and 2 more"
