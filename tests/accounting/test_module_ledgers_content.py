"""The ledger travels with the weights (accounting/module_ledgers.py): a trained module re-created as another
object in the same process — a deep copy, an unpickled copy, a fresh module loaded with its state dict, a part of
it — continues the trained module's record instead of restarting at zero; a freshly initialised module does not."""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402

from lightning_dp.accounting import module_ledgers  # noqa: E402


@pytest.fixture
def trained() -> Classifier:
    model = Classifier()
    assert fit(model, steps=3).ledger.steps == 3
    return model


def _loaded(model: Classifier) -> Classifier:
    fresh = Classifier()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _encoder_only(model: Classifier) -> Classifier:
    fresh = Classifier()
    with torch.no_grad():
        torch.nn.init.normal_(fresh.net[2].weight)
    fresh.net[0].load_state_dict(model.net[0].state_dict())
    return fresh


def _rounded(dtype: torch.dtype):
    """The trained weights saved in ``dtype`` and loaded into a fresh float32 module."""
    def recreate(model: Classifier) -> Classifier:
        fresh = Classifier()
        fresh.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        return fresh
    return recreate


@pytest.mark.parametrize("recreate", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), _loaded,
                                      _encoder_only, _rounded(torch.float16), _rounded(torch.bfloat16)],
                         ids=["deepcopy", "pickle", "load_state_dict", "a part", "float16 round trip",
                              "bfloat16 round trip"])
def test_a_recreated_module_continues_the_record(trained, recreate):
    again = fit(recreate(trained), steps=2)
    assert again.ledger.steps == 5


def test_a_fresh_module_starts_its_own_record(trained):
    """The same initial weights as the trained module had (Classifier seeds its initialisation): only weights the
    releases changed carry the record."""
    assert fit(Classifier(), steps=2).ledger.steps == 2


def test_the_digest_follows_contents_shape_and_dtype():
    x = torch.arange(12, dtype=torch.float32)
    assert module_ledgers.digest(x) == module_ledgers.digest(x.clone())
    assert module_ledgers.digest(x) != module_ledgers.digest(x.flip(0))  # the same values elsewhere
    assert module_ledgers.digest(x) != module_ledgers.digest(x.view(3, 4))
    assert module_ledgers.digest(x) != module_ledgers.digest(x.double())


class Normed(Classifier):
    """A classifier with a LayerNorm (weight of ones, bias of zeros) trained with a tiny learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def test_a_fresh_module_is_not_taken_for_a_rounding_of_barely_trained_weights():
    """The norm's weight moved by ~1e-6 is still all ones in bfloat16: that rounding is a fresh module's too."""
    assert fit(Normed(), steps=3).ledger.steps == 3
    assert fit(Normed(), steps=2).ledger.steps == 2
