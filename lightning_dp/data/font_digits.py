"""Public digits for pretraining: the numerals of the fonts that ship with matplotlib, drawn the way
scikit-learn's handwritten digits were digitised.

scikit-learn's digits are the UCI "optdigits" set: each handwritten numeral was scanned into a 32×32
bitmap, normalised to fill the box, and every 4×4 block of it counted (0..16 pixels on), giving 8×8
images. :func:`render_font_digits` makes the same kind of image from typeset numerals: a glyph of one
of 21 DejaVu, STIX and Computer Modern fonts (bundled with matplotlib: nothing is downloaded), its
strokes thickened (a k×k maximum filter, k ∈ {1, 3, 5, 7, 9} at 96 px), stretched horizontally by
U(0.7, 1.3), rotated by U(−15°, 15°), sheared by U(−0.3, 0.3), cropped to its ink, its longer side
scaled to 32·U(0.85, 1) pixels and centred (±1 px) in a 32×32 box; then an elastic distortion (Simard,
Steinkraus & Platt 2003: a displacement field of U(−1, 1) values smoothed by a Gaussian of σ = 4 px and
scaled by α = 34 px) makes the strokes look written rather than typeset; a threshold at half intensity
(0.4) gives the bitmap, and 4×4 block counts the 8×8 image, scaled to [−1, 1] as
:class:`~lightning_dp.data.DigitsDataModule` scales its images.

The images depend on no private data, so training on them costs no privacy: they are the "public
data" of public pretraining followed by private fine-tuning
(:class:`~lightning_dp.callbacks.PublicPretraining`; docs/results/digits_recipe.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from scipy.ndimage import maximum_filter
from torch.utils.data import TensorDataset

from lightning_dp._extras import require

log = logging.getLogger(__name__)

#: matplotlib's bundled fonts whose ten numerals are ordinary digits (not symbols or old-style figures).
FONTS = (
    "DejaVuSans", "DejaVuSans-Bold", "DejaVuSans-Oblique", "DejaVuSans-BoldOblique",
    "DejaVuSansMono", "DejaVuSansMono-Bold", "DejaVuSansMono-Oblique", "DejaVuSansMono-BoldOblique",
    "DejaVuSerif", "DejaVuSerif-Bold", "DejaVuSerif-Italic", "DejaVuSerif-BoldItalic",
    "STIXGeneral", "STIXGeneralBol", "STIXGeneralItalic", "STIXGeneralBolIta",
    "cmr10", "cmss10", "cmtt10", "cmb10", "cmti10",
)
_GLYPH_PX = 96  # font size of the drawn glyph, before it is scaled into the 32×32 box
_BOX = 32  # the optdigits bitmap
_ELASTIC_ALPHA, _ELASTIC_SIGMA = 34.0, 4.0
_THRESHOLD = 0.4


def font_paths() -> list[str]:
    """Paths of the :data:`FONTS` found in this matplotlib installation (at least 10 are required)."""
    matplotlib = require("matplotlib", "data")
    folder = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf")
    paths = [os.path.join(folder, f"{name}.ttf") for name in FONTS]
    found = [p for p in paths if os.path.exists(p)]
    if len(found) < 10:
        raise RuntimeError(f"only {len(found)} of matplotlib's bundled fonts were found under {folder}; "
                           "font digits need at least 10 (reinstall matplotlib)")
    return found


def render_font_digits(n: int, seed: int = 0) -> TensorDataset:
    """``n`` public 8×8 digit images (``[n, 1, 8, 8]``, values k/8 − 1 for k = 0..16) and their labels.

    Deterministic for a given ``seed`` and installation (the fonts and Pillow's rasteriser).
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    rng = np.random.default_rng(seed)
    glyphs = _glyphs(font_paths())
    labels = rng.integers(0, 10, n)
    pil = require("PIL.Image", "data")
    boxes = np.stack([_typeset(pil, rng, glyphs[int(rng.integers(len(glyphs)))][d]) for d in labels])
    generator = torch.Generator().manual_seed(seed)
    bitmaps = elastic(torch.from_numpy(boxes).unsqueeze(1), generator) > _THRESHOLD
    counts = F.avg_pool2d(bitmaps.float(), 4) * 16  # 4×4 block counts, 0..16
    return TensorDataset(counts / 8.0 - 1.0, torch.from_numpy(labels).long())


def _glyphs(paths: list[str]) -> list[list[Any]]:
    """For each font, its ten numerals drawn at 96 px and cropped to their ink (Pillow images)."""
    image_font, image_draw, pil = (require(m, "data") for m in ("PIL.ImageFont", "PIL.ImageDraw", "PIL.Image"))
    out = []
    for path in paths:
        font = image_font.truetype(path, _GLYPH_PX)
        row = []
        for digit in range(10):
            g = pil.new("L", (2 * _GLYPH_PX, 2 * _GLYPH_PX), 0)
            image_draw.Draw(g).text((_GLYPH_PX // 3, _GLYPH_PX // 10), str(digit), fill=255, font=font)
            row.append(g.crop(g.getbbox()))
        out.append(row)
    return out


def _typeset(pil: Any, rng: np.random.Generator, glyph: Any) -> np.ndarray:
    """One glyph thickened, stretched, rotated, sheared and centred in the 32×32 box (intensities in [0, 1]);
    ``pil``: the ``PIL.Image`` module."""
    k = int(rng.choice([1, 3, 5, 7, 9]))
    g = pil.fromarray(maximum_filter(np.pad(np.asarray(glyph), k // 2), size=k)) if k > 1 else glyph
    g = g.resize((max(1, int(g.width * rng.uniform(0.7, 1.3))), g.height))
    g = g.rotate(rng.uniform(-15, 15), resample=pil.BILINEAR, expand=True, fillcolor=0)
    s, (w, h) = rng.uniform(-0.3, 0.3), g.size
    g = g.transform((w + int(abs(s) * h), h), pil.AFFINE, (1, s, -max(s, 0) * h, 0, 1, 0),
                    resample=pil.BILINEAR, fillcolor=0)
    g = g.crop(g.getbbox())
    scale = _BOX / max(g.width, g.height) * rng.uniform(0.85, 1.0)
    g = g.resize((max(1, round(g.width * scale)), max(1, round(g.height * scale))), pil.BILINEAR)
    box = pil.new("L", (_BOX, _BOX), 0)
    box.paste(g, ((_BOX - g.width) // 2 + int(rng.integers(-1, 2)), (_BOX - g.height) // 2 + int(rng.integers(-1, 2))))
    return np.asarray(box, dtype=np.float32) / 255.0


def elastic(images: Tensor, generator: torch.Generator, alpha: float = _ELASTIC_ALPHA,
            sigma: float = _ELASTIC_SIGMA) -> Tensor:
    """Simard et al. (2003)'s elastic distortion of ``[n, 1, H, W]`` images: each pixel is read from
    (y + α·(g_σ * u_y), x + α·(g_σ * u_x)), u uniform on (−1, 1) per pixel, g_σ a Gaussian blur
    (bilinear sampling, zeros outside)."""
    n, _, h, w = images.shape
    field = torch.rand(n, 2, h, w, generator=generator) * 2 - 1
    radius = int(3 * sigma)
    taps = torch.exp(-torch.arange(-radius, radius + 1, dtype=torch.float32) ** 2 / (2 * sigma ** 2))
    taps = taps / taps.sum()
    field = F.conv2d(field.reshape(2 * n, 1, h, w), taps.view(1, 1, 1, -1), padding=(0, radius))
    field = F.conv2d(field, taps.view(1, 1, -1, 1), padding=(radius, 0)).reshape(n, 2, h, w) * alpha
    return displace(images, field[:, 0], field[:, 1])


def displace(images: Tensor, dy: Tensor, dx: Tensor) -> Tensor:
    """``out[y, x] = images[y + dy[y, x], x + dx[y, x]]`` for ``[n, 1, H, W]`` images and ``[n, H, W]``
    displacements in pixels (bilinear, zeros outside)."""
    _, _, h, w = images.shape
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    # grid_sample wants (x, y) in [-1, 1] with align_corners=True: pixel p ↦ 2p/(size − 1) − 1.
    gx = (xs + dx) * (2 / (w - 1)) - 1
    gy = (ys + dy) * (2 / (h - 1)) - 1
    return F.grid_sample(images, torch.stack((gx, gy), dim=-1), mode="bilinear", padding_mode="zeros",
                         align_corners=True)


class FontDigits(TensorDataset):
    """:func:`render_font_digits` as a dataset (for a config file's ``class_path``): ``size`` public
    8×8 digits and their labels, rendered once at construction.

    Args:
        size: number of images.
        seed: seed of the rendering (fonts, distortions, labels).
    """

    def __init__(self, size: int = 20000, seed: int = 0) -> None:
        log.info("rendering %d public font digits (seed %d)", size, seed)
        super().__init__(*render_font_digits(size, seed).tensors)
        self.size, self.seed = size, seed
