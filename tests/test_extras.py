"""Optional dependencies fail with the install command that provides them."""

from __future__ import annotations

import pytest

from lightning_dp._extras import require


def test_a_missing_optional_module_names_its_extra():
    with pytest.raises(ImportError, match=r'pip install "lightning_dp\[data\]"'):
        require("lightning_dp_no_such_module", "data")


def test_an_installed_module_is_returned():
    assert require("math", "data").sqrt(4.0) == 2.0
