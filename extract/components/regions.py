"""Visual component geometry: entity / relation boxes, random grid boxes, region masks on the patch grid,
region pooling and region crops.

Coordinate conventions (used by every function here)
    Pixel boxes are float ``[x0, y0, x1, y1]`` in the *original* image's pixels: origin top left, x right,
    y down, end-exclusive (the box covers x0 <= x < x1, y0 <= y < y1; a pixel (x, y) is the unit square
    [x, x + 1) x [y, y + 1)). ``image_size`` and ``input_size`` are ``(width, height)`` as PIL writes them.
    Grid boxes are int ``(r0, c0, r1, c1)`` in patch cells, end-exclusive (rows r0 <= r < r1, columns
    c0 <= c < c1); ``grid`` is ``(rows, cols)``. Masks over the grid are bool ``[..., rows, cols]``, in the
    row-major order of the backbone's patch tokens (token n = cell (n // cols, n % cols)).

From the original image to the patch grid
    The backbone's eval preprocess resizes the image and crops / pads it to the input size, and the ViT
    cuts the input into ``input // grid`` px patches (a remainder, if any, is dropped by the strided
    convolution). :func:`image_to_grid_transform` reproduces open_clip's three ``resize_mode`` s exactly,
    integer rounding included, as ``input_px = original_px * scale - offset``. A box or mask is then
    assigned the cells it covers by area (:func:`boxes_to_grid_masks`, :func:`masks_to_grid`).

Sources of the components
    ComAlign (paper sec. III-A): entity boxes from a detector or the annotations
    (:func:`gt_boxes`), relation boxes = the union of each pair scored by the product of the two confidences,
    top 10 (:func:`relation_boxes`); each component is cropped and embedded by the image encoder
    (:func:`crop_regions`). PowerCLIP (paper sec. 3.2): random boxes on the patch grid
    (:func:`random_grid_boxes`, PowerCLIP-R) or SAM2 masks (:func:`masks_to_grid`, PowerCLIP-S); a region
    embedding is the normalised mean of the patch tokens inside its mask (:func:`pool_regions`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

RESIZE_MODES = ("shortest", "longest", "squash")
# Covered fractions are sums of float products; a cell covered exactly min_fraction must not drop out
# because of rounding (e.g. a box edge on a cell's midline), so the comparison is this lenient.
_FRACTION_TOL = 1e-6
# masks_to_grid converts masks to float64 in chunks of at most this many pixels (64 MiB) to bound memory;
# float64 because a cell's share sums many pixels and must compare to min_fraction within _FRACTION_TOL.
_CHUNK_PIXELS = 1 << 23

__all__ = [
    "InputTransform",
    "RESIZE_MODES",
    "boxes_to_grid_masks",
    "crop_regions",
    "grid_boxes_to_masks",
    "gt_boxes",
    "image_to_grid_transform",
    "masks_to_grid",
    "pool_regions",
    "preprocess_geometry",
    "random_grid_boxes",
    "relation_boxes",
]


# --------------------------------------------------------------------------------------------- ComAlign boxes
def relation_boxes(boxes, scores, top_n: int | None = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate relation regions: the union box of every unordered pair of entity boxes.

    boxes: [M, 4] float pixel boxes (xyxy, end-exclusive); scores: [M] detector confidences.
    Returns ``(union [R, 4] float64, score [R] float64, pairs [R, 2] int64)`` with R = min(top_n, M(M-1)/2)
    (all pairs when top_n is None): the minimal box holding boxes i and j, ``score = scores[i] * scores[j]``,
    and ``pairs[r] = (i, j)`` with i < j. Rows are sorted by decreasing score; equal scores keep the pair
    order (0,1), (0,2), ..., (0,M-1), (1,2), ..., so the result is deterministic. M < 2 gives empty arrays
    of shapes [0, 4], [0], [0, 2].

    Ground-truth boxes all score 1, so every pair ties and the pair order alone picks the top_n: with more
    than top_n + 1 objects all the chosen pairs involve object 0. Callers with many annotated objects should
    order (or score) the entities before calling.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(scores) != len(boxes):
        raise ValueError(f"relation_boxes: {len(boxes)} boxes but {len(scores)} scores")
    i, j = np.triu_indices(len(boxes), k=1)  # row-major: exactly the documented pair order
    union = np.concatenate([np.minimum(boxes[i, :2], boxes[j, :2]), np.maximum(boxes[i, 2:], boxes[j, 2:])], axis=1)
    score = scores[i] * scores[j]
    order = np.argsort(-score, kind="stable")  # stable: ties stay in pair order
    if top_n is not None:
        order = order[:top_n]
    return union[order], score[order], np.stack([i, j], axis=1)[order].astype(np.int64)


def pair_rows(m: int, r: int) -> np.ndarray:
    """[r, 2] the first ``r`` pairs (i < j) of ``m`` entities in :func:`relation_boxes`' order for equal scores,
    cycling when there are fewer (padding rows of synthetic caches: benchmarks)."""
    pairs = [(i, j) for i in range(m) for j in range(i + 1, m)] or [(0, 0)]
    return np.array([pairs[k % len(pairs)] for k in range(r)], np.int16)


def gt_boxes(entry: dict) -> tuple[np.ndarray, list[str]]:
    """Annotated entity boxes of one image's entry in a box file (:mod:`extract.data.boxes`, which reads COCO
    instances as Visual-Genome-style entries): a toy-world scene or a Visual-Genome-style image entry.

    Toy world (``extract.worlds.toyworld``): ``entry["objects"][k]["box"]`` = [x0, y0, x1, y1] (end-exclusive px),
    label ``"{size} {colour} {shape}"`` (e.g. "small red circle"). Visual Genome: ``entry["objects"][k]``
    holds ``x, y, w, h`` (px; box = [x, y, x + w, y + h]) and ``names`` (the first one is the label) or
    ``name``. Returns ``(boxes [M, 4] float64, labels)`` in the entry's object order; M = 0 gives [0, 4].
    Annotations have no confidence: use 1 for each (see :func:`relation_boxes` on ties).
    """
    boxes, labels = [], []
    for obj in entry.get("objects", []):
        if "box" in obj:
            boxes.append(obj["box"])
            labels.append(" ".join(obj[k] for k in ("size", "colour", "shape") if k in obj))
        else:
            x, y, w, h = (obj[k] for k in ("x", "y", "w", "h"))
            boxes.append([x, y, x + w, y + h])
            names = obj.get("names") or [obj["name"]]
            labels.append(names[0])
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4), labels


# --------------------------------------------------------------------------------------------- PowerCLIP-R boxes
def grid_boxes_to_masks(grid_boxes, grid: tuple[int, int]) -> np.ndarray:
    """Grid boxes [M, 4] int (r0, c0, r1, c1), end-exclusive cells -> bool masks [M, rows, cols]."""
    b = np.asarray(grid_boxes, dtype=np.int64).reshape(-1, 4)
    rows, cols = grid
    r = np.arange(rows)[None, :, None]
    c = np.arange(cols)[None, None, :]
    return ((r >= b[:, 0, None, None]) & (r < b[:, 2, None, None])
            & (c >= b[:, 1, None, None]) & (c < b[:, 3, None, None]))


def random_grid_boxes(grid: tuple[int, int], m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """PowerCLIP-R region masks: ``m`` random boxes on a ``(rows, cols)`` patch grid.

    Distribution (all in cell units, independent per box): centre ``cy ~ U[0, rows)``, ``cx ~ U[0, cols)``
    (continuous); height ``h ~ U{1, ..., rows}``, width ``w ~ U{1, ..., cols}`` (integers). The box is the
    h x w span of cells whose centre is nearest (cy, cx): ``r0 = floor(cy - h/2 + 1/2)``, ``r1 = r0 + h``
    (columns alike), then clipped to the grid. Clipping keeps at least one cell (r0 <= floor(cy) < r1), and
    it is why boxes near the border come out smaller than their drawn h, w. Draws, in this order:
    rng.uniform (cy, m values), rng.uniform (cx), rng.integers (h), rng.integers (w), so a seeded
    ``np.random.default_rng(seed)`` always gives the same boxes.

    Returns ``(grid_boxes [m, 4] int64 (r0, c0, r1, c1), masks [m, rows, cols] bool)``.
    """
    rows, cols = grid
    if rows < 1 or cols < 1 or m < 0:
        raise ValueError(f"random_grid_boxes: need a non-empty grid and m >= 0, got grid={grid}, m={m}")
    cy = rng.uniform(0.0, rows, m)
    cx = rng.uniform(0.0, cols, m)
    h = rng.integers(1, rows + 1, m)
    w = rng.integers(1, cols + 1, m)
    r0 = np.floor(cy - h / 2 + 0.5).astype(np.int64)
    c0 = np.floor(cx - w / 2 + 0.5).astype(np.int64)
    boxes = np.stack([np.clip(r0, 0, rows), np.clip(c0, 0, cols),
                      np.clip(r0 + h, 0, rows), np.clip(c0 + w, 0, cols)], axis=1)
    return boxes, grid_boxes_to_masks(boxes, grid)


# --------------------------------------------------------------------------------------------- preprocess geometry
@dataclass(frozen=True)
class InputTransform:
    """Where the preprocess puts the original image: ``input_px = original_px * scale - offset``.

    scale: (sx, sy) = resized size / original size; offset: (ox, oy) = crop offset in resized px (negative
    where the preprocess pads instead); input_size: (width, height) of the network input. Original pixels
    that map outside [0, width) x [0, height) were cropped away; with padding ("longest"), the image maps
    onto only part of the input.
    """

    scale: tuple[float, float]
    offset: tuple[float, float]
    input_size: tuple[int, int]

    def boxes(self, boxes) -> np.ndarray:
        """Pixel boxes [M, 4] (original px) -> [M, 4] float64 in input px, not clipped."""
        b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        s = np.array([*self.scale, *self.scale])
        o = np.array([*self.offset, *self.offset])
        return b * s - o

    def clipped_boxes(self, boxes) -> np.ndarray:
        """Like :meth:`boxes`, clipped to the input; a box outside it gets zero width or height."""
        b = self.boxes(boxes)
        w, h = self.input_size
        return np.clip(b, 0.0, [w, h, w, h])


def _crop_offset(resized: int, target: int) -> int:
    """torchvision's center_crop (and open_clip's CenterCropOrPad) along one axis: pad (target - resized) // 2
    on the leading side when too small, else crop starting at round((resized - target) / 2)."""
    if target > resized:
        return -((target - resized) // 2)
    return int(round((resized - target) / 2.0))


def _resized_size(image_size: tuple[int, int], input_size: tuple[int, int], resize_mode: str) -> tuple[int, int]:
    """(width, height) after the resize step of open_clip's eval transform (open_clip.transform.image_transform)."""
    (w, h), (tw, th) = image_size, input_size
    if resize_mode == "squash":
        return tw, th
    if resize_mode == "shortest" and tw == th:
        # torchvision Resize(int): the short side becomes the size, the long side is *truncated*.
        if w <= h:
            return tw, int(tw * h / w)
        return int(th * w / h), th
    # open_clip ResizeKeepRatio (shortest with a non-square input, or longest): both sides *rounded*.
    ratio_h, ratio_w = h / th, w / tw
    ratio = max(ratio_h, ratio_w) if resize_mode == "longest" else min(ratio_h, ratio_w)
    return round(w / ratio), round(h / ratio)


def image_to_grid_transform(image_size: tuple[int, int], input_size: tuple[int, int],
                            resize_mode: str = "shortest") -> InputTransform:
    """The map from original to input pixels of open_clip's eval preprocess.

    image_size: original (width, height); input_size: network input (width, height); resize_mode:
    "shortest" (resize the short side to the input, centre-crop: open_clip's default), "longest" (resize the
    long side, centre-pad) or "squash" (resize to the input, aspect ratio not kept). Rounding follows
    torchvision / open_clip exactly, so the mapped boxes land where the preprocess draws them (to within the
    resampling filter's blur).
    """
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"unknown resize_mode {resize_mode!r}; expected one of {RESIZE_MODES}")
    (w, h), (tw, th) = image_size, input_size
    if min(w, h, tw, th) < 1:
        raise ValueError(f"image_to_grid_transform: sizes must be positive, got {image_size} -> {input_size}")
    rw, rh = _resized_size((w, h), (tw, th), resize_mode)
    return InputTransform(scale=(rw / w, rh / h), offset=(float(_crop_offset(rw, tw)), float(_crop_offset(rh, th))),
                          input_size=(int(tw), int(th)))


def preprocess_geometry(backbone) -> tuple[tuple[int, int], str]:
    """``(input_size (width, height), resize_mode)`` of a :class:`extract.models.backbone.FrozenBackbone`'s preprocess.

    open_clip records the preprocessing it built on ``model.visual.preprocess_cfg`` (size as (height, width)).
    """
    cfg = backbone.model.visual.preprocess_cfg
    h, w = cfg["size"] if isinstance(cfg["size"], (tuple, list)) else (cfg["size"], cfg["size"])
    return (int(w), int(h)), cfg.get("resize_mode", "shortest")


def _cell_sizes(input_size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """Patch (cell) width and height in input px: the ViT's strided convolution drops any remainder."""
    (tw, th), (rows, cols) = input_size, grid
    if rows < 1 or cols < 1 or tw < cols or th < rows:
        raise ValueError(f"grid {grid} does not fit the input size {input_size}")
    return tw // cols, th // rows


def _fractions_to_masks(fraction: np.ndarray, min_fraction: float) -> np.ndarray:
    """fraction [M, rows, cols] covered share of each cell -> masks; a region covering any part of the grid
    but no cell by min_fraction keeps its best-covered cell (first in row-major order on ties)."""
    masks = fraction >= min_fraction - _FRACTION_TOL
    n = fraction.shape[1] * fraction.shape[2]
    flat, flat_masks = fraction.reshape(-1, n), masks.reshape(-1, n)  # views: writing flat_masks writes masks
    best = flat.max(axis=1, initial=0.0)
    idx = np.flatnonzero((best > 0) & ~flat_masks.any(axis=1))
    # first cell within rounding of the best, so equally covered cells tie-break the same way on every path
    first_best = (flat[idx] >= best[idx, None] - _FRACTION_TOL).argmax(axis=1)
    flat_masks[idx, first_best] = True
    return masks


# --------------------------------------------------------------------------------------------- boxes / masks -> grid
def boxes_to_grid_masks(boxes, image_size: tuple[int, int], input_size: tuple[int, int], grid: tuple[int, int],
                        min_fraction: float = 0.5, *, resize_mode: str = "shortest") -> np.ndarray:
    """Region masks on the patch grid for pixel boxes of the original image.

    boxes: [M, 4] float px in the original image (xyxy, end-exclusive); image_size, input_size: (width, height)
    of the original image and of the network input; grid: (rows, cols); resize_mode: the preprocess's
    (:func:`image_to_grid_transform`). After clipping to the image, mapping to input px and clipping to the
    input, cell (r, c) is in
    box m's mask when the box covers at least ``min_fraction`` of the cell's area; a box that covers part of
    the grid but no cell that much gets its best-covered cell, so small objects never vanish.
    Returns bool [M, rows, cols]. A box entirely outside the crop (or of zero area) gets an empty mask: the
    caller drops it (:func:`pool_regions` marks it invalid either way).
    """
    t = image_to_grid_transform(image_size, input_size, resize_mode)
    w, h = image_size
    # Clip to the image first: with padding ("longest") the input extends beyond it, and padding is not object.
    b = t.clipped_boxes(np.clip(np.asarray(boxes, dtype=np.float64).reshape(-1, 4), 0.0, [w, h, w, h]))
    cw, ch = _cell_sizes(input_size, grid)
    rows, cols = grid
    # The covered area of a cell is separable: (x overlap / cell width) * (y overlap / cell height).
    x_edges = np.arange(cols + 1) * cw
    y_edges = np.arange(rows + 1) * ch
    fx = np.clip(np.minimum(b[:, 2:3], x_edges[1:]) - np.maximum(b[:, 0:1], x_edges[:-1]), 0, None) / cw
    fy = np.clip(np.minimum(b[:, 3:4], y_edges[1:]) - np.maximum(b[:, 1:2], y_edges[:-1]), 0, None) / ch
    return _fractions_to_masks(fy[:, :, None] * fx[:, None, :], min_fraction)


def _pixel_cell_overlap(n_pixels: int, scale: float, offset: float, cell: int, n_cells: int) -> np.ndarray:
    """[n_pixels, n_cells]: the share of each cell's extent (along one axis) covered by each original pixel
    [p, p + 1) once mapped to input px [p * scale - offset, (p + 1) * scale - offset)."""
    p = np.arange(n_pixels, dtype=np.float64)
    lo, hi = p * scale - offset, (p + 1) * scale - offset
    edges = np.arange(n_cells + 1, dtype=np.float64) * cell
    return np.clip(np.minimum(hi[:, None], edges[1:]) - np.maximum(lo[:, None], edges[:-1]), 0, None) / cell


def masks_to_grid(masks, image_size: tuple[int, int], input_size: tuple[int, int], grid: tuple[int, int],
                  min_fraction: float = 0.5, *, resize_mode: str = "shortest") -> np.ndarray:
    """Pixel masks (e.g. SAM2's) of the original image -> region masks on the patch grid.

    masks: bool [M, H, W] with (W, H) == image_size; the rest as :func:`boxes_to_grid_masks`. Each mask
    pixel is a unit square mapped by the preprocess; cell (r, c) is in the mask when the mapped pixels cover
    at least ``min_fraction`` of its area, and a mask with any pixel inside the crop keeps at least its
    best-covered cell. A mask entirely outside the crop (or empty) stays empty: the caller drops it.
    Returns bool [M, rows, cols].
    """
    masks = np.asarray(masks, dtype=bool)
    w, h = image_size
    if masks.ndim != 3 or masks.shape[1:] != (h, w):
        raise ValueError(f"masks_to_grid: expected masks [M, {h}, {w}] for image_size {image_size}, got {masks.shape}")
    t = image_to_grid_transform(image_size, input_size, resize_mode)
    cw, ch = _cell_sizes(input_size, grid)
    rows, cols = grid
    ax = _pixel_cell_overlap(w, t.scale[0], t.offset[0], cw, cols)  # [W, cols]
    ay = _pixel_cell_overlap(h, t.scale[1], t.offset[1], ch, rows)  # [H, rows]
    # covered share of cell (r, c) = sum over pixels of mask * ay[y, r] * ax[x, c] = ay^T @ mask @ ax
    fraction = np.empty((len(masks), rows, cols), dtype=np.float64)
    step = max(1, _CHUNK_PIXELS // max(1, h * w))
    for s in range(0, len(masks), step):
        chunk = masks[s:s + step].astype(np.float64)
        fraction[s:s + step] = ay.T @ (chunk @ ax)
    return _fractions_to_masks(fraction, min_fraction)


# --------------------------------------------------------------------------------------------- embeddings
def pool_regions(patches: torch.Tensor, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """Region embeddings r_m = normalise(mean of the patch tokens inside mask m) (PowerCLIP §3.2, eq. 2).

    patches: [..., N, D] patch tokens (``ImageFeatures.patches``, N = rows * cols, row-major); masks: bool
    [..., M, rows, cols] (numpy or torch); leading dims broadcast, so one set of masks can serve a batch.
    Returns ``(region_emb [..., M, D], valid [..., M] bool)``: L2-normalised means in the patches' dtype,
    and valid = the mask holds at least one cell. Invalid (empty / padding) masks give exact zeros, never
    NaN; consumers must mask them through ``valid`` rather than treat the zeros as embeddings.
    """
    masks = torch.as_tensor(masks, device=patches.device).bool()
    rows, cols = masks.shape[-2:]
    if rows * cols != patches.shape[-2]:
        raise ValueError(f"pool_regions: masks are {rows}x{cols} cells but patches hold {patches.shape[-2]} tokens")
    flat = masks.flatten(-2)  # [..., M, N]
    counts = flat.sum(-1)  # [..., M]
    sums = flat.to(patches.dtype) @ patches  # [..., M, D]
    mean = sums / counts.clamp(min=1).unsqueeze(-1).to(patches.dtype)
    # F.normalize divides by max(norm, eps): an empty mask's zero sum stays exactly zero.
    valid = (counts > 0).expand(mean.shape[:-1])  # broadcast like the embeddings when masks are shared
    return F.normalize(mean, dim=-1), valid


def crop_regions(image: Image.Image, boxes, transform: Callable[[Image.Image], torch.Tensor],
                 fit: str = "pad", fill: int | Sequence[int] = 0, scale: float = 1.0) -> torch.Tensor:
    """Crop each box and preprocess it for the image encoder (ComAlign sec. III-B: crops are resized and
    embedded by the frozen image encoder).

    image: PIL image; boxes: [M, 4] float px (xyxy, end-exclusive); transform: the backbone's preprocess
    (``FrozenBackbone.preprocess``, PIL -> [3, S, S]). Each crop is the smallest whole-pixel rectangle
    holding the box, clipped to the image and at least 1 x 1 px (a box outside the image becomes the nearest
    edge pixel: drop such boxes beforehand). fit: "pad" centres the crop on a square canvas of ``fill``
    before the transform, so the whole box survives the preprocess's centre crop (a wide relation box would
    otherwise lose both of its objects' outer parts); "none" hands the crop to the transform as it is.
    scale (with "pad"): the canvas side is ``scale`` x the crop's longer side, so the object fills 1/scale of
    what the encoder sees, as objects do in the images it was trained on, instead of all of it (1: the tight
    crop). Returns [M, 3, S, S] (M = 0 gives [0, 3, S, S]).
    """
    if fit not in ("pad", "none"):
        raise ValueError(f"crop_regions: unknown fit {fit!r}; expected 'pad' or 'none'")
    if not scale >= 1:
        raise ValueError(f"crop_regions: scale must be >= 1, got {scale!r}")
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    w, h = image.size
    x0 = np.clip(np.floor(b[:, 0]), 0, w - 1).astype(int)
    y0 = np.clip(np.floor(b[:, 1]), 0, h - 1).astype(int)
    x1 = np.clip(np.ceil(b[:, 2]), x0 + 1, w).astype(int)
    y1 = np.clip(np.ceil(b[:, 3]), y0 + 1, h).astype(int)
    crops = []
    for box in zip(x0, y0, x1, y1):
        crop = image.crop(tuple(int(v) for v in box))
        side = max(max(crop.size), int(round(max(crop.size) * scale)))
        if fit == "pad" and (crop.width != side or crop.height != side):
            canvas = Image.new(crop.mode, (side, side), fill if isinstance(fill, int) else tuple(fill))
            canvas.paste(crop, ((side - crop.width) // 2, (side - crop.height) // 2))
            crop = canvas
        crops.append(transform(crop))
    if not crops:  # the transform decides S; run it once on a 1 x 1 crop to learn the shape
        return torch.empty((0, *transform(image.crop((0, 0, 1, 1))).shape))
    return torch.stack(crops)
