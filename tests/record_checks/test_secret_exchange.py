"""The exchange is secret and changes every element (record_checks/outside_records.py): a read of one element or one
label outside the batch is set apart in every exchange, no bit is flipped in every element (no public map to undo or
to symmetrise over), two exchanges draw other masks, and the restore puts back every bit. The statistics the old
public map left alike — p(1 − p) of the labels, |p − ½| rounded, a band symmetric about ½, ½(s(X) + s(e(X))) — are
refused by the judges, and the same habits on public values train.

The masks are drawn from a generator the suite seeds per test (tests/conftest.py, ``SECRET.reseed``): the fits below
are the same at every run."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_checks.holders import RowItems  # noqa: E402
from lightning_dp.record_checks.outside_records import SECRET, exchange, exchanged_copy  # noqa: E402

OLD_FLOAT_MAP = -0x80000000 | 0x00400000  # the public map the exchange was: sign and top mantissa bit of a float32


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ---------------------------------------------------------------------------- the masks
def test_one_element_changes_in_every_exchange() -> None:
    """Every label, pixel and feature takes another value in each of 20 exchanges: a read of one is set apart by
    every judged run, never by chance."""
    labels = torch.arange(64) % 2
    pixels = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    features = torch.randn(64, 3, dtype=torch.float64)
    features[0, 0] = 0.0
    for _ in range(20):
        for array in (labels, pixels, features, features.numpy()):
            before = array.clone() if isinstance(array, torch.Tensor) else array.copy()
            restore = exchange(array)
            assert bool((array != before).all())
            restore()


def test_no_bit_is_flipped_in_every_element() -> None:
    """The lowest bit of an integer, the sign and each exchanged mantissa bit of a float change in some elements and
    not in others: no bit of the exchange is a public map (``y & 1``, ``|x|``) to read around or symmetrise over."""
    labels, features = torch.zeros(4096, dtype=torch.int64), torch.randn(4096)
    before_x = _bits(features.clone())
    exchange(labels)
    exchange(features)
    moved = _bits(features) ^ before_x
    for which in (labels & 1, labels & 2, moved & -0x80000000, moved & 0x00400000, moved & 0x00200000):
        flipped = which != 0
        assert bool(flipped.any()) and not bool(flipped.all())


def test_two_exchanges_draw_other_masks() -> None:
    x = torch.randn(512)
    masks = []
    for _ in range(2):
        before = _bits(x.clone())
        restore = exchange(x)
        masks.append(_bits(x) ^ before)
        restore()
    assert not torch.equal(masks[0], masks[1])


def test_the_restore_puts_back_every_bit() -> None:
    """NaN payloads, -0.0, infinities and subnormals, every float width, integers, pixels, bools, lists of records
    and records held one per item: bit for bit as they were; an exchanged copy leaves its batch alone."""
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, 3.0], dtype=torch.float32)
    nan_payload = torch.tensor([0x7FC00001, -0x00400001], dtype=torch.int32).view(torch.float32)
    arrays: list[Any] = [torch.cat([special, nan_payload]), torch.randn(40, 3).to(torch.bfloat16),
                         torch.randn(40, 3).half(), torch.randn(40, 3).double().t(), torch.randint(0, 9, (40,)),
                         torch.randint(0, 255, (40, 3)).to(torch.uint8), torch.rand(40) > 0.5,
                         np.random.default_rng(0).normal(size=(40, 3)).astype(">f4")]
    for array in arrays:
        before = array.clone() if isinstance(array, torch.Tensor) else array.copy()
        restore = exchange(array)
        restore()
        if isinstance(array, torch.Tensor):
            assert torch.equal(array, before) if array.dtype == torch.bool else torch.equal(_bits(array), _bits(before))
        else:
            assert array.tobytes() == before.tobytes()
    records = [[0, 1, 1, 5], [0.5, -2.0, 0.0], ["ab", "c"], [True, False]]
    for items in records:
        kept = list(items)
        restore = exchange(items)
        assert all(a != b for a, b in zip(items, kept))
        restore()
        assert items == kept and [type(v) for v in items] == [type(v) for v in kept]
    rows = RowItems([torch.randn(3) for _ in range(8)] + [np.arange(4)])
    kept_rows = [a.clone() if isinstance(a, torch.Tensor) else a.copy() for a in rows.arrays]
    for _ in range(3):  # the items' views are found once; each exchange draws its masks again
        restore = exchange(rows)
        assert all(bool((a != b).all()) for a, b in zip(rows.arrays, kept_rows))
        restore()
    assert all(bool((a == b).all()) for a, b in zip(rows.arrays, kept_rows))
    x, y = torch.randn(6, 2), torch.tensor([0, 1, 1, 0, 1, 0])
    copy = exchanged_copy((x, y))
    assert torch.equal(copy[1], y ^ 1), "a batch copy's labels stay labels (the public map)"
    assert bool((copy[0] != x).all()) and torch.equal(x, x.clone())


def test_the_old_maps_invariants_move_in_every_exchange() -> None:
    """What the public map left alike moves in each of 20 exchanges: the labels' p(1 - p) and |p - 1/2| (rounded to
    four places), and the mean symmetrised under the old map, ½(mean(X) + mean(e(X)))."""
    x, y = (t.clone() for t in data(64).tensors)

    def balance(labels: torch.Tensor) -> tuple[float, float]:
        p = float(labels.double().mean())
        return round(p * (1 - p), 4), round(abs(p - 0.5), 4)

    def symmetrised(features: torch.Tensor) -> torch.Tensor:
        old = (features.view(torch.int32) ^ OLD_FLOAT_MAP).view(torch.float32)
        return 0.5 * (features.double().mean(0) + old.double().mean(0))

    plain_balance, plain_symmetrised = balance(y), symmetrised(x)
    flipped = y ^ 1
    assert balance(flipped) == plain_balance, "alike under the old map (the statistic of the class)"
    for _ in range(20):
        restores = [exchange(y), exchange(x)]
        moved = balance(y)
        assert moved[0] != plain_balance[0] and moved[1] != plain_balance[1]
        assert not torch.allclose(symmetrised(x), plain_symmetrised, rtol=0, atol=1e-4)
        for restore in restores:
            restore()


# ---------------------------------------------------------------------------- the judges, on fits
DATA = data(64, seed=0)  # labels at rate 0.4375; the ten chosen by a step at rates 0.1 to 0.7


def _fit(model: Any, steps: int = 3, **trainer_kwargs: Any) -> None:
    quiet_trainer(strategy=strategy(), max_steps=steps, **trainer_kwargs).fit(model, DataLoader(DATA, batch_size=16))


def _balance() -> float:
    p = DATA.tensors[1].double().mean()
    return float(p * (1 - p))


class _BiasWriter(torch.optim.SGD):
    """A user's optimizer whose step writes ``value()`` into a bias after its update."""

    def __init__(self, params: Any, bias: torch.Tensor, value: Any) -> None:
        super().__init__(params, lr=0.1)
        self.bias, self.value = bias, value

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.bias.copy_(torch.as_tensor(self.value(), dtype=self.bias.dtype).expand_as(self.bias))
        return loss


def _bias_writer(value: Any) -> Classifier:
    class Model(Classifier):
        def configure_optimizers(self):
            return _BiasWriter(self.parameters(), self.net[2].bias, value)
    return Model()


def _symmetrised_mean() -> torch.Tensor:
    x = DATA.tensors[0]
    old = (x.view(torch.int32) ^ OLD_FLOAT_MAP).view(torch.float32)
    return (0.5 * (x.double().mean(0) + old.double().mean(0)))[:2].float()


@pytest.mark.parametrize("value", [_balance, _symmetrised_mean, lambda: float(DATA.tensors[1][5])],
                         ids=["label_balance", "symmetrised_mean", "one_label"])
def test_a_step_writing_what_the_old_map_left_alike_is_refused(value: Any) -> None:
    """(zoo36 T46, T47) The labels' p(1 - p), a feature mean symmetrised under the old map, or one label, written
    into a bias by the user's optimizer step: refused before any release."""
    model = _bias_writer(value)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="read the training data"):
        _fit(model)
    assert unchanged(before, model)


def test_a_step_writing_a_public_constant_trains() -> None:
    model = _bias_writer(lambda: 0.25)
    _fit(model)
    assert torch.equal(model.net[2].bias.detach(), torch.full((2,), 0.25))


def _rate(step: int) -> float:
    labels = DATA.tensors[1][(step % 6) * 10:(step % 6) * 10 + 10]
    return float(labels.float().mean())


def _scheduled(rate: Any) -> Classifier:
    class Model(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, rate), "interval": "step"}}
    return Model()


@pytest.mark.parametrize("rate", [lambda s: 0.2 + round(abs(_rate(s) - 0.5), 4),
                                  lambda s: 0.2 + float(DATA.tensors[1][s % 64])],
                         ids=["rounded_balance", "one_label"])
def test_a_schedule_from_what_the_old_map_left_alike_is_refused(rate: Any) -> None:
    """(zoo36 T51) A LambdaLR of round(|rate of ten training labels - 1/2|, 4), or of one training label: refused."""
    with pytest.raises(PrivacyConfigurationError,  # (refused first as configure_optimizers builds it, or when stepped)
                       match="learning-rate schedule read the training data|changed from the training data by the hooks"):
        _fit(_scheduled(rate), steps=4)


def test_a_public_schedule_trains() -> None:
    model = _scheduled(lambda s: 0.2 + 0.1 * (s % 3))
    _fit(model, steps=4)
    assert model.trainer.global_step == 4


class _EpochEnder(Classifier):
    """Ends every epoch at its first batch when ``ends()``."""

    def __init__(self, ends: Any) -> None:
        super().__init__()
        self.ends = ends

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        return -1 if batch_idx == 0 and self.ends(self) else None


def test_an_epoch_ended_by_a_band_symmetric_about_a_half_is_refused() -> None:
    """(zoo36 T50, the band's inside) -1 when the training labels' rate lies within 0.1 of 1/2 (0.4375 here; the old
    map's 0.5625 too): refused — every exchange moves the rate out of the band."""
    def balanced(module: Any) -> bool:
        p = float(module.trainer.train_dataloader.dataset.tensors[1].float().mean())
        return abs(p - 0.5) < 0.1

    model = _EpochEnder(balanced)
    assert balanced(types_namespace(DATA))
    with pytest.raises(PrivacyConfigurationError, match="on_train_batch_start returned -1"):
        _fit(model, steps=-1, max_epochs=2)


def test_an_epoch_ended_at_a_public_place_trains() -> None:
    model = _EpochEnder(lambda module: module.current_epoch == 0)
    _fit(model, steps=-1, max_epochs=2)
    assert model.trainer.global_step == 4  # the first epoch ended before its first step; the second ran its four


def types_namespace(dataset: Any) -> Any:
    """A stand-in module whose trainer's loader holds ``dataset`` (the decision run on the data itself)."""
    from types import SimpleNamespace

    return SimpleNamespace(trainer=SimpleNamespace(train_dataloader=SimpleNamespace(dataset=dataset)))


def test_the_secret_generator_is_seeded_from_the_operating_system() -> None:
    """Production draws come from ``os.urandom``: two fresh secrets draw other masks (the suite's seeding is a test
    hook, ``SECRET.reseed``)."""
    from lightning_dp.record_checks.outside_records import _Secret

    first, second = _Secret(), _Secret()
    assert not np.array_equal(first.block(64, 1, 2), second.block(64, 1, 2))
    assert SECRET.generator is not first.generator


def test_arrays_of_the_users_state_keep_their_integers_in_range() -> None:
    """Beside the training data, a judged hook's run again exchanges what the user's state holds (held_values.
    other_values: stored labels and predictions, which a hook may index with): their integers by the public map (a
    label stays a label), their floats by secret masks."""
    from lightning_dp.record_checks.outside_records import ExchangedRecords

    labels, scores = torch.tensor([0, 1, 1, 0]), torch.randn(4)
    before = scores.clone()
    with ExchangedRecords([("labels", labels), ("scores", scores)], fixed_integers=True).exchanged():
        assert labels.tolist() == [1, 0, 0, 1]
        assert bool((scores.abs() != before.abs()).all())
    assert labels.tolist() == [0, 1, 1, 0] and torch.equal(scores, before)
