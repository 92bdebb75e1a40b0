"""torch's own bookkeeping of an RNN layer is not kept state (fingerprints/module_tree.py, ``_rnn_listing``): the list of
weights an ``nn.LSTM``/``nn.GRU`` keeps for its fused kernel (``_flat_weights``, weak references
``_flat_weight_refs``) derives from its parameters. A multi-layer RNN with inter-layer dropout is replayed per example
by a ``functional_call``, which leaves its substitutes listed until the next forward lists the parameters again: that
trains. A plain tensor written into the up-to-date list (the next forward would run on it) is still refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class Recurrent(Classifier):
    """A two-layer recurrent classifier over the 4 features read as a sequence of 4 steps."""

    def __init__(self, layer: type = nn.LSTM, dropout: float = 0.2) -> None:
        super().__init__()
        self.rnn = layer(1, 8, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.unsqueeze(-1))
        return self.head(out[:, -1])


@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_a_multi_layer_rnn_with_dropout_between_layers_trains(layer, dropout):
    model = Recurrent(layer, dropout)
    dp = fit(model, steps=3)
    assert dp.ledger.steps == 3


class ListsItsOwnWeight(Recurrent):
    """Writes a tensor of the batch into the RNN's up-to-date list of weights: the next forward runs on it."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        flat = self.rnn._flat_weights
        flat[-1] = flat[-1].detach() + batch[0].mean()


def test_a_tensor_written_into_the_rnn_list_of_weights_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"rnn\._flat_weights"):
        fit(ListsItsOwnWeight(dropout=0.0), steps=3)
