"""The public font digits: optdigits-like 8×8 images of the numerals their labels name, reproducible,
from matplotlib's bundled fonts only (issue 21)."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.data import FontDigits, render_font_digits
from lightning_dp.data import font_digits as fd

pytest.importorskip("matplotlib")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def public():
    return render_font_digits(2000, seed=0).tensors


def test_images_have_the_optdigits_form(public):
    x, y = public
    assert x.shape == (2000, 1, 8, 8) and y.dtype == torch.long
    counts = (x + 1) * 8  # back to 0..16 pixels on per 4×4 block
    assert torch.equal(counts, counts.round()) and counts.min() == 0 and counts.max() == 16
    assert torch.bincount(y, minlength=10).min() > 150  # every numeral, roughly uniform
    assert 0.15 < float((counts > 0).float().mean()) < 0.7  # ink, not blank or filled boxes


def test_the_images_are_the_digits_their_labels_name(public):
    """A nearest-class-mean classifier fitted on font digits reads scikit-learn's handwritten digits far
    above chance; with the labels shifted by one it falls to chance: images and labels agree."""
    load_digits = pytest.importorskip("sklearn.datasets").load_digits
    x, y = public
    means = torch.stack([x[y == d].mean(0).flatten() for d in range(10)])
    digits = load_digits()
    real = torch.tensor(digits.images / 8.0 - 1.0, dtype=torch.float32).flatten(1)
    pred = torch.cdist(real, means).argmin(1)
    truth = torch.tensor(digits.target)
    assert float((pred == truth).float().mean()) > 0.45
    assert float(((pred + 1) % 10 == truth).float().mean()) < 0.2


def test_reproducible_per_seed():
    a, b, c = render_font_digits(50, seed=3), render_font_digits(50, seed=3), render_font_digits(50, seed=4)
    assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
    assert not torch.equal(a.tensors[0], c.tensors[0])
    ds = FontDigits(size=50, seed=3)
    assert len(ds) == 50 and torch.equal(ds.tensors[0], a.tensors[0]) and torch.equal(ds.tensors[1], a.tensors[1])


def test_elastic_with_zero_amplitude_is_the_identity_and_moves_ink_otherwise():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 32, 32, generator=g)
    torch.testing.assert_close(fd.elastic(images, g, alpha=0.0), images)
    moved = fd.elastic(images, torch.Generator().manual_seed(0), alpha=34.0)
    assert (moved - images).abs().mean() > 0.05


def test_displacements_read_from_y_plus_dy_and_x_plus_dx():
    image = torch.zeros(1, 1, 32, 32)
    image[0, 0, :, 10] = 1.0  # a vertical line at column 10
    image[0, 0, 20, :] = 1.0  # a horizontal line at row 20
    zero, two = torch.zeros(1, 32, 32), torch.full((1, 32, 32), 2.0)
    right = fd.displace(image, zero, two)[0, 0]  # out[y, x] = in[y, x + 2]: the column moves to 8
    assert right[:19, 8].min() == 1.0 and right[:19, 10].max() == 0.0 and right[20, :30].min() == 1.0
    down = fd.displace(image, -two, zero)[0, 0]  # out[y, x] = in[y − 2, x]: the row moves to 22
    assert down[22, 11:].min() == 1.0 and down[20, 11:].max() == 0.0 and down[2:, 10].min() == 1.0


def test_too_few_fonts_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fd, "FONTS", ("NoSuchFont",) * 12)
    with pytest.raises(RuntimeError, match="only 0 of matplotlib's bundled fonts"):
        render_font_digits(5)


def test_nonpositive_size_is_refused():
    with pytest.raises(ValueError):
        render_font_digits(0)
