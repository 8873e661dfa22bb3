"""How the app shows per-phrase heatmaps: one panel per phrase, the map blended over the image so the scene stays
visible beneath it, with a colour scale of the phrase's scores and ComAlign's winning box.

A map drawn as an opaque mask hides the image, so it cannot show *where* a phrase is. Here each panel is the image
(kept at its aspect ratio, small images enlarged by a whole factor with sharp pixels) with the map laid over it in
a perceptual colour map (inferno: dark is low, bright yellow is the peak; its lightness rises steadily, so it
reads correctly in grey too) at an opacity that grows with the map's value: where the phrase scores low the image
shows through almost unchanged. Under each panel a colour bar gives the scale, from the phrase's lowest to its
peak score (``PhraseMap.low`` / ``peak``, un-normalised: each map is min-max normalised, so a phrase that is not in
the image still has a hot spot, and its peak says how weak it is). Panels sit side by side, three to a row.

:func:`render` returns the picture and the annotations ``gr.AnnotatedImage`` takes: per phrase the outline of its
panel, per box its outline in the panel (the page's legend highlights either on hover), so the component draws
outlines only and never washes over the picture. A grounded head's relation adds where its two boxes overlap
(``PhraseMap.overlaps``): that region outlined and hatched with thin diagonal lines (told apart from a box at a
glance, the picture still showing between the lines) in the panels of both phrases, one legend entry saying whose
pixels fill it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

#: inferno (matplotlib's perceptually uniform map), sampled at nine evenly spaced points, 0-255 RGB
INFERNO = np.array([(0, 0, 4), (31, 12, 72), (85, 15, 109), (136, 34, 106), (186, 54, 85), (227, 89, 51),
                    (249, 140, 10), (249, 201, 50), (252, 255, 164)], dtype=np.float32)
#: opacity of the map where it is 1 (it is 0 where the map is 0)
MAX_ALPHA = 0.75
PANEL = 256            # the long side of a panel's picture, px
GAP, TITLE, BAR = 10, 22, 30
TOP = 30               # above the first row: where the page's component draws its own label
PER_ROW = 3
OUTLINE = 2            # px of the outline masks
HATCH = 4              # px between the diagonal lines that fill an overlap region


def colormap(values: np.ndarray) -> np.ndarray:
    """[...] values in [0, 1] -> [..., 3] float RGB 0-255 on :data:`INFERNO`, interpolated linearly."""
    x = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(INFERNO) - 1)
    lo = np.floor(x).astype(int).clip(0, len(INFERNO) - 2)
    t = (x - lo)[..., None]
    return INFERNO[lo] * (1 - t) + INFERNO[lo + 1] * t


def blend(image: np.ndarray, heat: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 image with ``heat`` [H, W] in [0, 1] laid over it: colour map at opacity MAX_ALPHA * heat."""
    alpha = (MAX_ALPHA * np.clip(np.nan_to_num(heat), 0.0, 1.0))[..., None]
    return (image.astype(np.float32) * (1 - alpha) + colormap(heat) * alpha).round().clip(0, 255).astype(np.uint8)


def fitted_size(size: tuple[int, int], long_side: int = PANEL) -> tuple[int, int]:
    """(W, H) of an image of ``size`` fitted to ``long_side`` px: aspect kept; a smaller image enlarged by the largest
    whole factor that fits (so its pixels stay square and sharp: a 64 px toy scene), a larger one scaled down."""
    w, h = size
    longest = max(w, h)
    if longest <= long_side:
        factor = max(1, long_side // longest)
        return w * factor, h * factor
    return max(1, round(w * long_side / longest)), max(1, round(h * long_side / longest))


panel_size = fitted_size  # a heatmap panel is the image fitted as a thumbnail is


def fit(image, long_side: int):
    """``image`` resized to :func:`fitted_size`: enlarged with nearest neighbour (sharp pixels), shrunk with
    Lanczos (antialiased). The app's thumbnails and heatmap panels."""
    from PIL import Image

    size = fitted_size(image.size, long_side)
    if size == image.size:
        return image
    return image.resize(size, Image.NEAREST if size[0] > image.size[0] else Image.LANCZOS)


def _font(size: int = 13):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _outline(mask: np.ndarray, x0: int, y0: int, x1: int, y1: int, width: int = OUTLINE) -> None:
    """Draw the outline of the box [x0, x1) x [y0, y1) into ``mask`` (1 on the outline)."""
    h, w = mask.shape
    x0, y0, x1, y1 = max(0, x0), max(0, y0), min(w, x1), min(h, y1)
    if x1 <= x0 or y1 <= y0:
        return
    mask[y0:y1, x0:x1] = 1.0
    mask[y0 + width:y1 - width, x0 + width:x1 - width] = 0.0


def _hatch(mask: np.ndarray, x0: int, y0: int, x1: int, y1: int, every: int = HATCH) -> None:
    """Outline the box [x0, x1) x [y0, y1) in ``mask`` and fill it with diagonal lines ``every`` px apart."""
    _outline(mask, x0, y0, x1, y1, width=1)
    h, w = mask.shape
    x0, y0, x1, y1 = max(0, x0), max(0, y0), min(w, x1), min(h, y1)
    if x1 <= x0 or y1 <= y0:
        return
    ys, xs = np.mgrid[y0:y1, x0:x1]
    mask[y0:y1, x0:x1] = np.maximum(mask[y0:y1, x0:x1], ((xs + ys) % every == 0).astype(np.float32))


def render(image, maps: Sequence, *, panel: int = PANEL) -> tuple:
    """(the PIL picture of every phrase's panel, [(outline mask [H, W] float, label)]) for ``image`` (RGB PIL at
    the maps' size) and its ``maps`` (serve.heatmap.PhraseMap): module docstring. Labels are unique."""
    from PIL import Image, ImageDraw

    if not maps:
        return image, []
    pw, ph = panel_size(image.size, panel)
    sx, sy = pw / image.size[0], ph / image.size[1]
    cols = min(PER_ROW, len(maps))
    rows = -(-len(maps) // cols)
    cell_w, cell_h = max(pw, 180), TITLE + ph + BAR
    width, height = GAP + cols * (cell_w + GAP), TOP + rows * (cell_h + GAP)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font, small = _font(13), _font(11)
    base = np.asarray(fit(image.convert("RGB"), panel))
    annotations, used = [], {}
    regions: dict[str, np.ndarray] = {}  # an overlap's label -> its hatching in every panel that shows it

    def unique(label: str) -> str:
        used[label] = used.get(label, 0) + 1
        return label if used[label] == 1 else f"{label} ({used[label]})"

    for k, m in enumerate(maps):
        left = GAP + (k % cols) * (cell_w + GAP) + (cell_w - pw) // 2
        top = TOP + (k // cols) * (cell_h + GAP)
        heat = np.asarray(Image.fromarray(np.asarray(m.heat, dtype=np.float32), mode="F").resize((pw, ph),
                                                                                                  Image.BILINEAR))
        canvas.paste(Image.fromarray(blend(base, heat)), (left, top + TITLE))
        draw.text((left, top + 3), _fit(f"{m.label} · peak {m.peak:.3f}", font, draw, cell_w), fill=(20, 20, 20),
                  font=font)
        bar_top = top + TITLE + ph + 6
        ramp = colormap(np.linspace(0, 1, pw)[None, :].repeat(10, 0)).astype(np.uint8)
        canvas.paste(Image.fromarray(ramp), (left, bar_top))
        draw.text((left, bar_top + 11), f"{m.low:.3f}", fill=(60, 60, 60), font=small)
        high = f"{m.peak:.3f}"
        draw.text((left + pw - draw.textlength(high, font=small), bar_top + 11), high, fill=(60, 60, 60), font=small)
        mask = np.zeros((height, width), np.float32)
        _outline(mask, left - OUTLINE, top + TITLE - OUTLINE, left + pw + OUTLINE, top + TITLE + ph + OUTLINE)
        annotations.append((mask, unique(m.label)))
        if m.box is not None:
            x0, y0, x1, y1 = m.box
            box = np.zeros((height, width), np.float32)
            _outline(box, left + int(np.floor(x0 * sx)), top + TITLE + int(np.floor(y0 * sy)),
                     left + int(np.ceil(x1 * sx)), top + TITLE + int(np.ceil(y1 * sy)))
            annotations.append((box, unique(f"{m.phrase}: {m.box_kind} box, score {m.box_score:.3f}")))
        for (x0, y0, x1, y1), label in getattr(m, "overlaps", ()):
            mask = regions.setdefault(label, np.zeros((height, width), np.float32))
            _hatch(mask, left + int(np.floor(x0 * sx)), top + TITLE + int(np.floor(y0 * sy)),
                   left + int(np.ceil(x1 * sx)), top + TITLE + int(np.ceil(y1 * sy)))
    annotations += [(mask, unique(label)) for label, mask in regions.items()]
    return canvas, annotations


def _fit(text: str, font, draw, width: int) -> str:
    """``text`` cut (with "...") to fit ``width`` px."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."
