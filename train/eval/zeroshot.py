"""Zero-shot classification: class names x prompt templates -> one text representation per class.

CLIP (Radford et al. 2021, sec. 3.1.4) ensembles 80 ImageNet prompt templates by averaging the normalised
text embeddings of each class; :class:`adapters.scoring.BackboneScorer` does exactly that through its
``ensemble``. A scorer without ``ensemble`` (an adapter whose score is not a dot product) gets the mean of
its scores over the templates instead: the same ranking for a dot-product model up to the per-class norm.

Datasets: an image folder (``root/<class>/*.jpg``, classes in sorted order, as torchvision's ImageFolder),
or a CSV with ``filepath`` and ``label`` columns; class names from an ImageNet-style label file (one name per
line in class-index order, or JSON ``{index or wnid: name}``), else the folder / label strings themselves.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from adapters.eval.ranking import positive_ranks, small_split_warning

# CLIP's 80 ImageNet templates (github.com/openai/CLIP, notebooks/Prompt_Engineering_for_ImageNet.ipynb)
IMAGENET_TEMPLATES = tuple(t + "." for t in (
    "a bad photo of a {}", "a photo of many {}", "a sculpture of a {}", "a photo of the hard to see {}",
    "a low resolution photo of the {}", "a rendering of a {}", "graffiti of a {}", "a bad photo of the {}",
    "a cropped photo of the {}", "a tattoo of a {}", "the embroidered {}", "a photo of a hard to see {}",
    "a bright photo of a {}", "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}",
    "a drawing of a {}", "a photo of my {}", "the plastic {}", "a photo of the cool {}",
    "a close-up photo of a {}", "a black and white photo of the {}", "a painting of the {}",
    "a painting of a {}", "a pixelated photo of the {}", "a sculpture of the {}", "a bright photo of the {}",
    "a cropped photo of a {}", "a plastic {}", "a photo of the dirty {}", "a jpeg corrupted photo of a {}",
    "a blurry photo of the {}", "a photo of the {}", "a good photo of the {}", "a rendering of the {}",
    "a {} in a video game", "a photo of one {}", "a doodle of a {}", "a close-up photo of the {}",
    "a photo of a {}", "the origami {}", "the {} in a video game", "a sketch of a {}", "a doodle of the {}",
    "a origami {}", "a low resolution photo of a {}", "the toy {}", "a rendition of the {}",
    "a photo of the clean {}", "a photo of a large {}", "a rendition of a {}", "a photo of a nice {}",
    "a photo of a weird {}", "a blurry photo of a {}", "a cartoon {}", "art of a {}", "a sketch of the {}",
    "a embroidered {}", "a pixelated photo of a {}", "itap of the {}", "a jpeg corrupted photo of the {}",
    "a good photo of a {}", "a plushie {}", "a photo of the nice {}", "a photo of the small {}",
    "a photo of the weird {}", "the cartoon {}", "art of the {}", "a drawing of the {}",
    "a photo of the large {}", "a black and white photo of a {}", "the plushie {}", "a dark photo of a {}",
    "itap of a {}", "graffiti of the {}", "a toy {}", "itap of my {}", "a photo of a cool {}",
    "a photo of a small {}", "a tattoo of the {}"))
SIMPLE_TEMPLATES = ("a photo of a {}.",)
TEMPLATE_SETS = {"imagenet80": IMAGENET_TEMPLATES, "simple": SIMPLE_TEMPLATES, "plain": ("{}",)}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


@dataclass
class ClassificationSet:
    """paths[n] -> labels[n] (class indices into ``classes``); ``skipped`` lists unreadable entries."""

    name: str
    paths: list[str]
    labels: list[int]
    classes: list[str]
    skipped: list[dict] = field(default_factory=list)


def read_label_file(path: str | Path) -> list[str] | dict[str, str]:
    """One class name per line (index order), or JSON: a list, or {index or wnid: name} (values may be
    [wnid, name] pairs as in ImageNet's ``imagenet_class_index.json``)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        if isinstance(data, list):
            return [str(x) for x in data]
        return {str(k): (v[-1] if isinstance(v, list) else str(v)) for k, v in data.items()}
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise ValueError(f"label file {path} holds no class names")
    return names


def read_classification(spec: str | Path, label_file: str | Path | None = None) -> ClassificationSet:
    """An image folder or a CSV (``filepath,label``; relative paths from the CSV's folder)."""
    spec = Path(spec)
    names = read_label_file(label_file) if label_file else None
    skipped: list[dict] = []
    if spec.is_dir():
        folders = sorted(p.name for p in spec.iterdir() if p.is_dir())
        if not folders:
            raise ValueError(f"{spec} has no class sub-folders (expected root/<class>/<image>)")
        paths, raw = [], []
        for c in folders:
            for f in sorted((spec / c).iterdir()):
                if f.suffix.lower() in IMAGE_SUFFIXES:
                    paths.append(str(f))
                    raw.append(c)
        classes_raw = folders
    else:
        paths, raw = [], []
        with open(spec, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"filepath", "label"} - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{spec}: missing column(s) {', '.join(sorted(missing))} (need filepath,label)")
            for line, row in enumerate(reader, start=2):
                p = Path(row["filepath"])
                p = p if p.is_absolute() else spec.parent / p
                if not p.is_file():
                    skipped.append({"item_id": row["filepath"], "reason": "missing image", "location": f"{spec}:{line}"})
                    continue
                paths.append(str(p))
                raw.append(row["label"].strip())
        classes_raw = sorted(set(raw), key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x))
    index = {c: k for k, c in enumerate(classes_raw)}
    classes = [_name(c, k, names) for k, c in enumerate(classes_raw)]
    return ClassificationSet(spec.name, paths, [index[r] for r in raw], classes, skipped)


def _name(raw: str, k: int, names) -> str:
    if names is None:
        return raw.replace("_", " ")
    if isinstance(names, list):
        i = int(raw) if raw.isdigit() else k
        return names[i]
    return names.get(raw, names.get(str(k), raw))


@torch.no_grad()
def class_representations(scorer, classes: Sequence[str], templates: Sequence[str], batch_size: int = 256):
    """(class reps, None) when the scorer ensembles, else (per-template reps, template->class index)."""
    from adapters.scoring import cat_reps

    texts = [t.format(c) for c in classes for t in templates]
    groups = torch.arange(len(classes)).repeat_interleave(len(templates))
    reps = cat_reps([scorer.encode_texts(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)])
    merged = scorer.ensemble(reps, groups)  # None: the scorer does not merge templates (scores are averaged)
    return (merged, None) if merged is not None else (reps, groups)


def class_scores(scorer, image_reps, class_reps, groups) -> torch.Tensor:
    """[I, C] scores of images against classes (template scores averaged when not ensembled)."""
    s = scorer.score(image_reps, class_reps).float()
    if groups is None:
        return s
    n = int(groups.max()) + 1
    total = torch.zeros(s.shape[0], n, device=s.device).index_add_(1, groups.to(s.device), s)
    return total / torch.bincount(groups, minlength=n).to(s.device)


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 5)) -> dict:
    """Top-k accuracy (percent) of scores [N, C] against labels [N]. Ties count against the model: the true
    class must beat every class tied with it that sits in the top k, i.e. rank = 1 + #{other classes scoring
    >= the true one}; a non-finite score is the worst score, so a NaN true-class score ranks last
    (``adapters.eval.ranking``). ``nonfinite_scores`` counts them (of ``n_scores`` = N x C); ``warning`` is set
    when a reported top-k is 100 by construction (k >= C)."""
    labels = labels.to(scores.device)
    rank, n_bad = positive_ranks(scores, labels, dim=1)  # rank includes the true class itself
    kept = [k for k in ks if k <= scores.shape[1]]
    out = {f"top{k}": float((rank <= k).double().mean() * 100) for k in kept}
    per_class = [float((rank[labels == c] <= 1).double().mean() * 100) for c in labels.unique()]
    out["mean_per_class_top1"] = sum(per_class) / len(per_class)
    out["n"] = int(len(labels))
    out.update(nonfinite_scores=n_bad, n_scores=int(scores.numel()))
    warning = small_split_warning(int(scores.shape[1]), kept, what="classes", metric="top", min_per_k=0)
    if warning:
        out["warning"] = warning
    return out
