"""The text-only floor: how well a caption can be told from its hard negative without looking at the image.

Every binding figure on the toy world is read against it. A hard negative that a model can reject from its words
alone (a predicate that negatives use more often than captions do, an attribute that only ever appears swapped)
measures a caption prior, not binding; SugarCrepe (Hsieh et al., NeurIPS 2023, §3) found exactly such priors in
ARO and CREPE, where text-only models beat every CLIP. On a world without a prior the floor sits at chance.

The floor is the strongest cheap blind model we can fit: the base's own text tower (frozen) and a logistic
regression on its caption embedding, trained on the toy world's *training* split to separate each caption from its
hard negatives (the same generator and types as the test items: whatever prior they share, it can learn). Scoring
gives every image the same score for a caption, so on a two-way item it is right exactly when the probe ranks the
true caption above its negative, and on a set item (one caption per image) never better than chance.

``train.eval`` adds it to every toy-world table as the row ``text only (BASE)`` (``--no-text-only`` leaves it out).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from adapters.scoring import CacheReadable, Reps, token_keys

# Ridge on the probe's weights (the embedding is unit-norm, 64-768 wide). Weaker, the probe leans on directions a few
# thousand captions cannot pin down: at 1e-4 its swap figures on the 2,000-scene world swung 8 points away from
# chance, and apart between the two toy bases' text towers, on test items that share those directions (measured);
# at 1e-2 they sit within 2-5 points of 50 while add-obj's real prior (a one-object caption never lists two) stays at 94-97.
L2 = 1e-2
MAX_CAPTIONS = 3000  # training captions the probe is fitted on (with all their negatives; ~14k texts on the toy world)
LBFGS_STEPS = 100
TIE_BREAK = 1e-6  # scale of the per-image draw that breaks a blind model's ties between images


def training_pairs(world: str | Path, split: str = "train", limit: int | None = None,
                   seed: int = 0) -> tuple[list[str], list[str]]:
    """(captions, hard negatives) of ``split`` from the world's ``negatives.json``: each caption that has a negative,
    and every negative of it; ``limit``: at most that many captions, a seeded draw (a 64-768-wide linear probe is
    fitted as well from 3,000 captions as from 7,000, in a quarter of the text-tower time)."""
    from extract.common.json_memo import read_json

    data = read_json(Path(world) / "negatives.json")
    items = [item for item in data["items"] if item.get("split") == split and item.get("negatives")]
    if limit is not None and len(items) > limit:
        keep = np.sort(np.random.default_rng(seed).choice(len(items), size=limit, replace=False))
        items = [items[k] for k in keep]
    positives = [item["positive"] for item in items]
    negatives = [n["text"] for item in items for n in item["negatives"]]
    return positives, negatives


@torch.no_grad()
def _embed(backbone, texts: Sequence[str], batch_size: int = 512) -> torch.Tensor:
    parts = [backbone.encode_texts(list(texts[a:a + batch_size])).embedding.float()
             for a in range(0, len(texts), batch_size)]
    return F.normalize(torch.cat(parts), dim=-1) if parts else torch.zeros(0, 1)


def fit_probe(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-balanced logistic regression (L-BFGS, ridge :data:`L2`): features [N, D], labels [N] in {0, 1} ->
    (weight [D], bias [])."""
    x, y = features.double(), labels.double()
    pos = y.mean().clamp(1e-6, 1 - 1e-6)
    weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))  # each class half of the loss
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=LBFGS_STEPS, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (weights * F.binary_cross_entropy_with_logits(x @ w + b, y, reduction="none")).mean() + L2 * (w @ w)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach().float(), b.detach().float()


class TextOnlyScorer(CacheReadable):
    """A scorer that never looks at the image: every image gets the probe's logit of the caption (module
    docstring). Images are still decoded (so the same items are scored), and encoded as nothing."""

    def __init__(self, backbone, weight: torch.Tensor, bias: torch.Tensor, name: str, seed: int = 0):
        self.backbone, self.name = backbone, name
        self.preprocess, self.device = backbone.preprocess, backbone.device
        self.weight, self.bias = weight.to(backbone.device), bias.to(backbone.device)
        self._draws = torch.Generator().manual_seed(seed)

    def encode_images(self, images: torch.Tensor) -> Reps:
        # A blind model has no preference between images: each gets a seeded random draw that only breaks the ties
        # among images (a caption choosing between n images is right 1/n of the time, chance, not never), far
        # below any difference between two captions' priors.
        return {"blind": torch.rand(len(images), generator=self._draws).to(self.device)}

    def encode_texts(self, texts: Sequence[str]) -> Reps:
        return {"prior": _embed(self.backbone, list(texts)).to(self.device) @ self.weight + self.bias}

    def score(self, image_reps: Reps, text_reps: Reps) -> torch.Tensor:
        return text_reps["prior"][None, :] + TIE_BREAK * image_reps["blind"][:, None]

    def text_input_keys(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        return token_keys(self.backbone, texts)

    def text_tower(self):
        return self.backbone


_FITTED: dict[str, tuple] = {}  # fits of this process: the demo asks for one base's floor more than once


def fit_text_only(backbone, world: str | Path, name: str, split: str = "train") -> tuple[TextOnlyScorer, dict]:
    """The floor for ``backbone`` on toy world ``world`` (module docstring): (scorer, fit summary with the number of
    captions and negatives and the probe's accuracy on them). Fitted once per backbone and world in a process."""
    negatives_file = Path(world).resolve() / "negatives.json"
    key = json.dumps([backbone.describe(), str(negatives_file), negatives_file.stat().st_mtime_ns, split],
                     sort_keys=True, default=str)
    if key not in _FITTED:
        _FITTED[key] = _fit(backbone, world, split)
    w, b, summary = _FITTED[key]
    return TextOnlyScorer(backbone, w, b, name), dict(summary)


def _fit(backbone, world: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    positives, negatives = training_pairs(world, split, limit=MAX_CAPTIONS)
    if not positives:
        raise ValueError(f"{world}: no {split} caption with a hard negative to fit the text-only floor on")
    x = _embed(backbone, positives + negatives)
    y = torch.cat([torch.ones(len(positives)), torch.zeros(len(negatives))])
    w, b = fit_probe(x.cpu(), y)
    fitted = ((x.cpu() @ w + b > 0).float() == y).float()
    summary = {"captions": len(positives), "negatives": len(negatives),
               "train accuracy (balanced)": 50 * float(fitted[y > 0].mean() + fitted[y == 0].mean())}
    return w, b, summary
