"""Who owns the overlap: pixel evidence of which of two overlapping boxes is in front (``ventity_overlap``).

Why. Where two objects overlap, the one in front owns the shared pixels: the overlap region looks like the front
object and not like the one behind. Boxes cannot say it (the hard world's Controlled-B draws "X in front of Y" and
"X behind Y" with the same two boxes), and the backbone's crop embeddings hardly do: on the hard world's
overlapping renderings toy-negclip's embeddings of the two tight crops told the front object 51-69% of the time,
the crop of the overlap 51-57% (issue 53). The pixels do, and they cost no forward pass.

For every ordered pair of entity boxes (b, c) of one image, with O = b ∩ c and each object's colour the histogram
bin (HIST_LEVELS levels per RGB channel) that its box fills most beyond the image's border colours (read outside the
other box where enough of it is left, OWN_SHARE), the FEATURES = 18 are

    [overlaps, seen_b, seen_c, seen_b - seen_c, extent_b, extent_c, extent_b - extent_c,
     bite_b, bite_c, bite_c - bite_b, |O| / |b|, |O| / |c|,
     mirror_b, mirror_c, mirror_b - mirror_c, flip_b, flip_c, flip_b - flip_c]

seen_x: the share of O showing x's colour over the share of its own box it fills (the front object owns the
overlap, Swain & Ballard's histogram intersection in spirit); extent_x: the bounding box of x's colour pixels over
its box (a hidden part often takes an extreme point with it); bite_x: the share of the convex hull of x's pixels
that shows the other's colour inside the other's box (the bite the front object takes out of the one behind);
mirror_x / flip_x: how symmetric x's colour pixels are (around its box, SYMMETRY_MARGIN px wider) about their own
centre, left-right / up-down, as the IoU of the pixels with their mirror image: an object in front shows its whole
shape, symmetric where the shape is (every shape of the toy world is left-right, most of them up-down, and so are many
things people photograph), while the one behind shows its shape with a piece cut away (a Gestalt cue of occlusion that
holds for boxes of any tightness: a detector's box of a hidden object hugs what shows of it, so its extent says little,
and a star's or a triangle's convex hull takes in its neighbour's colour whether in front or not). On the named
in-front / behind pairs of Controlled-B of a 2,000-scene hard world (seed 43) with a detector's boxes, a logistic
regression on the twelve features before these read the front object at 94.1%, on all eighteen at 97.0% (an MLP:
93.0 -> 98.4; ``python -m train.eval.overlap_probe``). Each difference says "b is in front" by its sign: the rules of
:data:`RULES`, defined here for every reader (the
grounded head's explanations; ``python -m train.eval.overlap_probe``, which measures each rule alone and fitted). A
pair whose boxes share fewer than MIN_OVERLAP pixels gets zeros. A function of the image and its boxes alone. The
grounded head reads it next to the pair's geometry (``adapters/heads/grounded.py``), so what "in front of" means is
still learned from captions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

FEATURES = 18
HIST_LEVELS = 4  # per channel: 64 bins; a muted background and a saturated object fall in different bins
MIN_OVERLAP = 4  # px
BORDER = 2  # px of the image's edge: its context colours
OWN_SHARE = 0.15  # of a box outside the other: enough to read its colour there
SYMMETRY_MARGIN = 2  # px around a box where its object's pixels are read for symmetry: a detector's box may clip them
MIN_PIXELS = 3  # of an object's colour, to read its symmetry (fewer: 0)


@dataclass(frozen=True)
class Rule:
    """One rule of who is in front, read from a pair's FEATURES: ``column`` holds a difference whose value times
    ``sign`` is positive where box b of the pair (b, c) is in front, negative where c is, 0 where it says nothing."""

    name: str  # short: the key of a rule's vote and difference in explanations
    label: str  # in words: a row of the probe's table
    column: int
    sign: int = 1

    def difference(self, features):
        """The signed difference, positive for b, of features [..., FEATURES] (numpy array or torch tensor)."""
        return self.sign * features[..., self.column]


#: the rules, in column order: b's colour seen in the overlap (seen_b - seen_c), b's colour spanning its box
#: (extent_b - extent_c), the bite b takes out of c's hull (bite_c - bite_b), b's pixels mirror-symmetric left-right
#: (mirror_b - mirror_c; up-down is a feature, not a rule: a whole triangle or star is not symmetric that way)
RULES = (Rule("seen", "own colour seen in the overlap", 3), Rule("extent", "own colour spans its box", 6),
         Rule("bite", "bite out of the other's hull", 9), Rule("mirror", "own colour mirror-symmetric", 14))


def _histogram(bins: np.ndarray) -> np.ndarray:
    counts = np.bincount(bins.ravel(), minlength=HIST_LEVELS ** 3).astype(np.float32)
    return counts / max(1.0, float(counts.sum()))


def _hull(points: np.ndarray) -> list[tuple[float, float]]:
    """Convex hull of [n, 2] points (Andrew's monotone chain), counter-clockwise."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) < 3:
        return pts

    def half(seq):
        out = []
        for p in seq:
            while len(out) >= 2 and ((out[-1][0] - out[-2][0]) * (p[1] - out[-2][1])
                                     - (out[-1][1] - out[-2][1]) * (p[0] - out[-2][0])) <= 0:
                out.pop()
            out.append(p)
        return out

    lower, upper = half(pts), half(reversed(pts))
    return lower[:-1] + upper[:-1]


def _hull_mask(mask: np.ndarray) -> np.ndarray:
    """The convex hull of a boolean mask's pixels (each pixel's four corners), as a mask of the same shape.

    Only each row's first and last pixel can be a hull vertex (the corners of the pixels between lie on the
    segments joining theirs), so only their corners enter the hull: the same polygon from a few dozen points
    instead of four per pixel (tests/extract/test_overlap.py checks it against every pixel's corners)."""
    rows = np.flatnonzero(mask.any(1))
    if len(rows) == 0:
        return mask.copy()
    first = mask[rows].argmax(1)
    last = mask.shape[1] - 1 - mask[rows, ::-1].argmax(1)
    xs, ys = np.concatenate([first, last]), np.concatenate([rows, rows])
    corners = np.concatenate([np.stack([xs + dx, ys + dy], 1) for dx in (0, 1) for dy in (0, 1)])
    image = Image.new("L", (mask.shape[1], mask.shape[0]), 0)
    ImageDraw.Draw(image).polygon([(x - 0.5, y - 0.5) for x, y in _hull(corners)], fill=255)
    return (np.asarray(image) > 0) | mask


def ownership(raw: np.ndarray, boxes: np.ndarray, slots: int) -> np.ndarray:
    """[slots, slots, FEATURES] float32 for an image ``raw`` (H x W x 3 uint8) and its entity ``boxes`` ([k, 4] xyxy
    px in that image, k <= slots; module docstring); entry (b, c) describes box b against box c."""
    out = np.zeros((slots, slots, FEATURES), np.float32)
    h, w = raw.shape[:2]
    q = (raw[..., :3].astype(np.int32) * HIST_LEVELS) // 256
    bins = q[..., 0] * HIST_LEVELS * HIST_LEVELS + q[..., 1] * HIST_LEVELS + q[..., 2]
    border = np.concatenate([bins[:BORDER].ravel(), bins[-BORDER:].ravel(), bins[:, :BORDER].ravel(),
                             bins[:, -BORDER:].ravel()])
    context = _histogram(border)  # what the image looks like around its objects
    rects = []
    for x0, y0, x1, y1 in np.asarray(boxes, np.float32)[:slots]:
        a, b = int(np.clip(np.floor(x0), 0, w)), int(np.clip(np.floor(y0), 0, h))
        rects.append((a, b, max(a, int(np.clip(np.ceil(x1), 0, w))), max(b, int(np.clip(np.ceil(y1), 0, h)))))

    def own(r, other, taken: int | None = None):
        """(the object's colour bin, its share of box ``r`` outside box ``other``, the extent of its pixels): the
        bin its own pixels fill most beyond the image's context, read outside the other box where enough of the box
        is left (OWN_SHARE), else in the whole box; never ``taken`` (the other object's colour)."""
        x0, y0, x1, y1 = r
        keep = np.ones((y1 - y0, x1 - x0), bool)
        keep[max(0, other[1] - y0):max(0, other[3] - y0), max(0, other[0] - x0):max(0, other[2] - x0)] = False
        region = bins[y0:y1, x0:x1]
        hist = _histogram(region[keep] if keep.sum() >= OWN_SHARE * keep.size else region)
        lift = hist - context
        if taken is not None:
            lift[taken] = -np.inf
        colour = int(np.argmax(lift))
        ys, xs = np.nonzero(region == colour)
        extent = ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)) / max(1, region.size) if len(xs) else 0.0
        return colour, float(hist[colour]), float(extent)

    for i, r in enumerate(rects):
        for j, s in enumerate(rects):
            if i >= j:
                continue
            ox0, oy0, ox1, oy1 = max(r[0], s[0]), max(r[1], s[1]), min(r[2], s[2]), min(r[3], s[3])
            area = max(0, ox1 - ox0) * max(0, oy1 - oy0)
            if area < MIN_OVERLAP:
                continue
            shared = _histogram(bins[oy0:oy1, ox0:ox1])
            ci, fi, ei = own(r, s)
            cj, fj, ej = own(s, r, taken=ci)
            # how much of its own colour each shows in the overlap, against how much of its own box it fills
            seen_i = min(2.0, float(shared[ci]) / max(fi, 1e-3))
            seen_j = min(2.0, float(shared[cj]) / max(fj, 1e-3))
            size_i = max(1, (r[2] - r[0]) * (r[3] - r[1]))
            size_j = max(1, (s[2] - s[0]) * (s[3] - s[1]))
            bite_i, bite_j = _bite(bins, r, ci, s, cj), _bite(bins, s, cj, r, ci)
            (mi, fi_), (mj, fj_) = _symmetry(bins, r, ci), _symmetry(bins, s, cj)
            out[i, j] = (1.0, seen_i, seen_j, seen_i - seen_j, ei, ej, ei - ej, bite_i, bite_j, bite_j - bite_i,
                         area / size_i, area / size_j, mi, mj, mi - mj, fi_, fj_, fi_ - fj_)
            out[j, i] = (1.0, seen_j, seen_i, seen_j - seen_i, ej, ei, ej - ei, bite_j, bite_i, bite_i - bite_j,
                         area / size_j, area / size_i, mj, mi, mj - mi, fj_, fi_, fj_ - fi_)
    return out


def _symmetry(bins: np.ndarray, r, colour: int) -> tuple[float, float]:
    """(left-right, up-down): the IoU of the pixels of ``colour`` around box ``r`` (SYMMETRY_MARGIN px wider) with
    their mirror image about their own centre; 0, 0 with fewer than MIN_PIXELS of them."""
    h, w = bins.shape
    x0, y0 = max(0, r[0] - SYMMETRY_MARGIN), max(0, r[1] - SYMMETRY_MARGIN)
    x1, y1 = min(w, r[2] + SYMMETRY_MARGIN), min(h, r[3] + SYMMETRY_MARGIN)
    ys, xs = np.nonzero(bins[y0:y1, x0:x1] == colour)
    if len(xs) < MIN_PIXELS:
        return 0.0, 0.0
    # on a canvas three windows wide and high: a mirrored pixel lands within one window's size of the window
    hh, ww = y1 - y0, x1 - x0
    canvas = np.zeros((3 * hh, 3 * ww), bool)
    canvas[ys + hh, xs + ww] = True
    out = []
    across = np.rint(2 * xs.mean() - xs).astype(np.int64), np.rint(2 * ys.mean() - ys).astype(np.int64)
    for mx, my in ((across[0], ys), (xs, across[1])):
        mirror = np.zeros_like(canvas)
        mirror[my + hh, mx + ww] = True
        out.append(float((canvas & mirror).sum()) / max(1, int((canvas | mirror).sum())))
    return out[0], out[1]


def _bite(bins: np.ndarray, r, colour: int, other, other_colour: int) -> float:
    """Share of the convex hull of the object in box ``r`` (its ``colour``'s pixels there) that shows the other
    object's colour inside the other box: the bite the other one takes out of it when it is in front."""
    x0, y0, x1, y1 = r
    region = bins[y0:y1, x0:x1]
    hull = _hull_mask(region == colour)
    inside = np.zeros_like(hull)
    inside[max(0, other[1] - y0):max(0, other[3] - y0), max(0, other[0] - x0):max(0, other[2] - x0)] = True
    return float((hull & inside & (region == other_colour)).sum()) / max(1, int(hull.sum()))
