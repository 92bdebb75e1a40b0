"""The ``public_state`` name a refusal of kept state suggests is one ``public_state`` accepts
(validators/kept_state.public_name): taking the message's suggestion, the same fit trains. A class attribute's entry
(``class attribute M.history``) used to be suggested whole, which no declared name matches."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.kept_state import public_name  # noqa: E402
from lightning_dp.validators.probe import state_mutation_error  # noqa: E402


def suggested(err: BaseException) -> list[str]:
    """The names of the first ``public_state=[...]`` the refusal suggests."""
    found = re.search(r"public_state=(\[[^\]]*\])", str(err))
    assert found, str(err)
    return ast.literal_eval(found.group(1))


class History(Classifier):
    """A list in the class body, shared by every instance, appended with each step's loss (a log kept for the epoch's
    end: public by the user's choice)."""

    history: list = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        type(self).history.append(float(loss))
        return loss


class HP:
    """A namespace class of the user's module used as a mutable setting."""

    scale = 1.0


class Settings(Classifier):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        HP.scale = float(outputs["loss"])


@pytest.mark.parametrize("model", [History, Settings])
def test_the_suggested_public_name_of_a_class_attribute_lets_the_fit_train(model):
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError, match="class attribute") as refused:
        fit(model(), steps=3)
    names = suggested(refused.value)
    assert not any(name.startswith("class attribute") for name in names)
    torch.manual_seed(0)
    fit(model(), steps=3, public_state=names)  # the suggestion taken as it is: trains


def test_each_entry_kind_is_suggested_by_the_name_public_state_matches():
    assert public_name("class attribute M.history") == "M.history"
    assert public_name("class attribute pkg.mod.M.f.__defaults__") == "pkg.mod.M.f.__defaults__"
    assert public_name("contents of class attribute M.bank") == "M.bank"
    assert public_name("buffer stats.mean") == "stats.mean"
    assert public_name("attribute offset of library class LightningModule") == "LightningModule.offset"


def test_the_probes_refusal_of_a_write_suggests_the_same_names():
    names = suggested(state_mutation_error(["class attribute M.history", "buffer stats.mean"]))
    assert names == ["M.history", "stats.mean"]
