"""grad_sample/capture/example_dims.py: where each argument of a layer holds the examples."""

from __future__ import annotations

from torch import nn

from lightning_dp.grad_sample.capture.example_dims import example_dims


class _Lengths(nn.LSTM):
    def forward(self, x, lengths=None, hx=None):  # type: ignore[override]
        return super().forward(x, hx)


def test_torch_rnns_take_the_state_in_dimension_one():
    dims = example_dims(nn.GRU(3, 4, batch_first=False))
    assert [dims.argument(k) for k in ("0", "input", "1", "hx")] == [1, 1, 1, 1]


def test_an_rnn_subclass_binds_its_own_signature():
    """forward(x, lengths=None, hx=None): lengths [B] is one row per example in dimension 0, the state in dimension 1,
    the input at the layout's example dimension (issue 37)."""
    for batch_first, seq in ((True, 0), (False, 1)):
        dims = example_dims(_Lengths(3, 4, batch_first=batch_first))
        assert [dims.argument(k) for k in ("0", "1", "lengths", "2", "hx")] == [seq, 0, 0, 1, 1]


def test_draws_randomness_reads_no_missing_attribute():
    """A layer that is neither attention nor an RNN draws nothing, answered without ``getattr(m, "dropout")`` (a
    missing attribute raises and is caught inside ``nn.Module.__getattr__``: issue 38's per-call Python)."""
    from lightning_dp.grad_sample.capture.example_dims import draws_randomness

    class Counting(nn.Linear):
        reads = 0

        def __getattr__(self, name):
            if name == "dropout":
                type(self).reads += 1
            return super().__getattr__(name)

    m = Counting(3, 2)
    assert not draws_randomness(m) and Counting.reads == 0
    attention = nn.MultiheadAttention(4, 2, dropout=0.1)
    assert draws_randomness(attention) and not draws_randomness(attention.eval())
    assert not draws_randomness(nn.LSTM(3, 4, num_layers=2))  # dropout 0.0
