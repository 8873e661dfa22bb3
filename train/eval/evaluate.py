"""``python -m train.eval``: retrieval, zero-shot, compositional benchmarks and a linear probe, for one
model or several side by side, with JSON + Markdown + PNG reports.

Every model is an :class:`adapters.scoring.Scorer`: evaluation asks it for score matrices and never
re-implements a method's scoring. Data:

- ``--data TOYWORLD_DIR`` gives every task from the toy world: retrieval on the test split, zero-shot and
  zero-shot on its single-object scenes (class = "colour shape"), a linear probe on object counts (train
  split -> evaluated split), and the hard negatives per type.
- ``--retrieval-data SOURCE`` (CSV/TSV, COCO JSON, webdataset: any extract data source), ``--zeroshot-data``
  (image folder or ``filepath,label`` CSV, ``--labels`` for class names), ``--benchmark NAME=PATH`` (NAME a key
  of ``train.eval.datasets.READERS``: ``sugarcrepe``, ``aro-vg-relation``, ``aro-vg-attribution``, ``winoground``,
  ``svo-probes``, ``whatsup``, ...; images under ``--image-root``) and ``--probe-data`` (a classification set,
  split into train / test by ``--probe-test``).
- On a toy world the compositional task also reads its controlled test (``toyworld-controlled``: four arrangements
  of two objects, four-way choices both ways, chance 25) and, unless ``--no-text-only``, adds the text-only floor
  as a model of its own (``train.eval.text_only``: the first model's text tower and a probe fitted on the train
  split's captions vs their negatives), the row every binding figure is read against.

A benchmark item whose image is missing is excluded and counted; a malformed benchmark file stops the run
before any model is loaded, naming the file and line.
"""
from __future__ import annotations

import argparse
import json
import math
import time
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from adapters.eval.ranking import positive_ranks, rank_safe
from adapters.scoring import cat_reps, take_reps
from adapters.load import load_scorer
from extract.common.cli import Parser, check_options, option, parse_options, progress, run_job, say, warn_once
from extract.common.cli import build_parser as build_cli
from extract.common.config import fraction, nonnegative_int, positive_int, save_config
from extract.common.source_args import BoxOptions, SourceOptions
from extract.data.images import BadImage, decode_image
from adapters.eval.bootstrap import DEFAULT_RESAMPLES, PerQuery
from adapters.eval.retrieval import hits, retrieval_from_reps, run_retrieval_cached, scene_truth
from train.eval.zeroshot import (TEMPLATE_SETS, ClassificationSet, class_representations, class_scores,
                            read_classification, topk_accuracy)

from train.eval.report import bar_plot, comparison, markdown, result_warnings
#CROSS

TASKS = ("retrieval", "zeroshot", "compositional", "linear_probe")


def _benchmark_names() -> list[str]:
    from train.eval.datasets import READERS

    return list(READERS)


@dataclass
class EvaluateOptions(SourceOptions, BoxOptions):
    """What ``python -m train.eval`` does, as data: ``evaluate(EvaluateOptions(model=["tiny"], data="toy"))``
    runs the same evaluation as the command line with those flags. ``tasks`` may be a comma string or a list;
    ``pretrained`` pairs with ``model`` in order (missing entries: the alias's default)."""

    model: list = option(default_factory=list, action="append", metavar="MODEL",
                         help="backbone alias / open_clip name, a pre-trained checkpoint, or an adapter checkpoint "
                              "(RUN/adapter.safetensors or the run folder); repeat for a side-by-side comparison "
                              "(default: tiny)")
    pretrained: list = option(default_factory=list, action="append", metavar="WEIGHTS",
                              help="weights for each --model in order: tag, checkpoint path or 'none' (default: the "
                                   "alias's)")
    tasks: Any = option(",".join(TASKS), help=f"comma list from {', '.join(TASKS)}")
    data: str | None = option(None, group="data",
                              help="a toy-world folder: every task from it (default, when no other data option is "
                                   "given: the embedded toy world, runs/toy, generated on first use)")
    split: str = option("test", help="toy world split to evaluate", group="data")
    retrieval_data: str | None = option(None, help="any extract data source for retrieval (CSV/TSV, COCO JSON, "
                                                   "webdataset shards)", group="data")
    cache: str | None = option(None, group="data",
                               help="a python -m extract cache of the retrieval data, read instead of re-encoding "
                                    "it: a bare backbone reads its global features (same weights as the cache's), an "
                                    "adapter its head's arrays (a cache extracted with the adapter's own settings), a "
                                    "FILIP checkpoint its patch and token embeddings (--components patches,tokens)")
    zeroshot_data: str | None = option(None, help="image folder or filepath,label CSV", group="data")
    labels: str | None = option(None, help="class-name file for --zeroshot-data (txt or JSON)", group="data")
    templates: str = option("imagenet80", choices=sorted(TEMPLATE_SETS), group="data",
                            help="prompt templates for real data (the toy world uses its own caption style)")
    benchmark: list = option(default_factory=list, action="append", metavar="NAME=PATH", group="data",
                             help="a compositional benchmark file / folder, NAME one of "
                                  + ", ".join(_benchmark_names()) + " (repeatable)")
    image_root: str | None = option(None, group="data", help="folder relative image paths start from "
                                                            "(--retrieval-data CSV/COCO and --benchmark files)")
    text_only: bool = option(True, action=argparse.BooleanOptionalAction, group="data",
                             help="on a toy world: add the text-only floor (the first model's text tower and a probe "
                                  "fitted on the train split's captions vs their hard negatives; train/eval/text_only.py)")
    probe_data: str | None = option(None, help="classification set for the linear probe", group="data")
    probe_test: float = option(0.3, type=fraction, help="held-out fraction of --probe-data", group="data")
    out: str = option("runs/eval", help="report folder: results.{json,md,png}, config.json", group="run")
    device: str | None = option(None, help="torch device (default: cuda when available, else cpu)", group="run")
    batch_size: int = option(128, type=positive_int, help="images / captions encoded at once", group="run")
    seed: int = option(0, type=nonnegative_int, group="run",
                       help="seeds the --probe-data split, the probe and the bootstrap resamples")
    bootstrap: int = option(DEFAULT_RESAMPLES, type=nonnegative_int, group="run",
                            help="bootstrap resamples of the test images for the 95%% interval of every figure and of "
                                 "every delta vs the first model (paired; 0: no intervals)")
    # Not command-line options: how a comparison (train.adapter.compare --seeds N) groups models into columns.
    # One entry per --model, each may use "{name}" (the model's own name): ``columns`` names the column the model
    # belongs to (models sharing one are runs of it, e.g. training seeds: the table shows their mean +/- sd),
    # ``result_labels`` the model's key in results.json. Empty: each model is its own column, under its name.
    # (Not ``labels``: that is the --labels option above, which a field of the same name would silently replace.)
    columns: list = field(default_factory=list)
    result_labels: list = field(default_factory=list)

    def __post_init__(self):
        self.model = list(self.model or ["tiny"])
        self.pretrained = list(self.pretrained or [])
        if len(self.pretrained) > len(self.model):
            raise ValueError("more --pretrained than --model values")
        for what in ("columns", "result_labels"):
            if getattr(self, what) and len(getattr(self, what)) != len(self.model):
                raise ValueError(f"{what}: one entry per model ({len(self.model)}), got {len(getattr(self, what))}")
        self.pretrained += [None] * (len(self.model) - len(self.pretrained))
        if isinstance(self.tasks, str):
            self.tasks = [t.strip() for t in self.tasks.split(",") if t.strip()]
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(sorted(unknown))}; choose from {', '.join(TASKS)}")


def build_parser() -> Parser:
    return build_cli(EvaluateOptions, "python -m train.eval", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> EvaluateOptions:
    return parse_options(EvaluateOptions, build_parser(), argv)


# --------------------------------------------------------------------------------------------- data (before models)
def _toy_classification(world: Path, split: str) -> ClassificationSet:
    """Single-object scenes of a toy-world split (a hard world: its objects' crops), labelled "colour shape"."""
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    chosen = [(s["file_name"], s["objects"][0]) for s in scenes if s.get("split") == split and len(s["objects"]) == 1]
    # a hard world has no single-object scene: each object's crop, partly hidden ones included (its "crop" file)
    chosen += [(o["crop"], o) for s in scenes if s.get("split") == split for o in s["objects"] if "crop" in o]
    labels = [f"{o['colour']} {o['shape']}" for _, o in chosen]
    classes = sorted(set(labels))
    index = {c: k for k, c in enumerate(classes)}
    return ClassificationSet(f"toyworld:{split}", [str(world / f) for f, _ in chosen], [index[c] for c in labels],
                             classes)


def _toy_counting(world: Path, split: str) -> ClassificationSet:
    """Every scene of a toy-world split labelled by its object count (the linear probe's toy task: each
    count occurs in every split, unlike the colour x shape classes of single-object scenes)."""
    scenes = [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if s.get("split") == split]
    classes = [f"{n} object{'s' if n > 1 else ''}" for n in range(1, 1 + max((len(s["objects"]) for s in scenes),
                                                                             default=1))]
    return ClassificationSet(f"toyworld-count:{split}", [str(world / s["file_name"]) for s in scenes],
                             [len(s["objects"]) - 1 for s in scenes], classes)


def load_tasks(args: EvaluateOptions) -> dict:
    """Read every dataset and benchmark file first: a malformed file fails before any model loads."""
    from train.eval import datasets as bm

    tasks: dict = {}
    world = Path(args.data) if args.data else None
    if world is not None and not (world / "annotations.json").is_file():
        raise FileNotFoundError(f"--data {world} is not a toy-world folder (no annotations.json); generate one "
                                "with python -m extract.worlds.toyworld --out DIR")
    if "retrieval" in args.tasks:
        from extract.data.sources import open_source
        from extract.common.source_args import source_options

        spec = args.retrieval_data or (world if world else None)
        if args.cache:
            from extract.cache import FeatureCache

            tasks["retrieval"] = FeatureCache.open(args.cache)
            if world is not None:  # the truth of multi-positive retrieval, matched to the cache's ids
                tasks["scenes"] = {str(s["image_id"]): s for s in json.loads(
                    (world / "annotations.json").read_text())["scenes"] if s.get("split") == args.split}
        elif spec is not None:
            opts = {"split": args.split} if (world and spec == world) else (
                {"image_root": args.image_root} if args.image_root else {})
            tasks["retrieval"] = open_source(spec, **opts, **source_options(args))
    if "zeroshot" in args.tasks:
        if args.zeroshot_data:
            tasks["zeroshot"] = (read_classification(args.zeroshot_data, args.labels),
                                 TEMPLATE_SETS[args.templates])
        elif world:
            tasks["zeroshot"] = (_toy_classification(world, args.split), ("a {}.", "a picture of a {}."))
    if "compositional" in args.tasks:
        found = []
        if world:
            from extract.worlds.toyworld import controlled_tests

            found.append(bm.read_toyworld(world, split=args.split))
            # version 2's four-way test (written now for a world that predates it), a hard world's Controlled-A / -B
            for name, file in controlled_tests(world):
                found.append(bm.read_toyworld_controlled(world, file=file.name, name=name))
        for entry in args.benchmark:
            if "=" not in entry:
                raise ValueError(f"--benchmark {entry!r}: expected NAME=PATH with NAME one of {', '.join(bm.READERS)}")
            name, path = entry.split("=", 1)
            found.append(bm.read_benchmark(name.strip(), path, image_root=args.image_root))
        if found:
            tasks["compositional"] = found
    if "linear_probe" in args.tasks:
        if args.probe_data:
            full = read_classification(args.probe_data)
            tasks["linear_probe"] = _split(full, args.probe_test, args.seed)
        elif world:
            tasks["linear_probe"] = (_toy_counting(world, "train"), _toy_counting(world, args.split))
    missing = [t for t in args.tasks if t not in tasks]
    if missing:
        print(f"note: no data for {', '.join(missing)} (give --data TOYWORLD or the task's own flag); skipped")
    return tasks


def _split(full: ClassificationSet, test_fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(len(full.paths))
    n_test = max(1, int(round(len(order) * test_fraction)))
    parts = []
    for rows in (order[n_test:], order[:n_test]):
        parts.append(ClassificationSet(full.name, [full.paths[i] for i in rows], [full.labels[i] for i in rows],
                                       full.classes))
    return tuple(parts)


# --------------------------------------------------------------------------------------------- encoding
def _load(path: str, crop=None):
    image = decode_image(path).image
    if crop is not None:
        x, y, w, h = crop
        image = image.crop((int(x), int(y), int(math.ceil(x + w)), int(math.ceil(y + h))))
    return image


@torch.no_grad()
def encode_image_files(scorer, items: Sequence[tuple[str, object]], batch_size: int, desc: str):
    """(reps of the readable images, kept positions, skipped [(position, reason)]); items = (path, crop).

    Scorers get the decoded images and their ids (``encode_pil``: adapters crop or detect their components on the
    original image; the id is the path, and a cropped item's id names the crop, so annotated boxes of the whole image
    are not applied to it: a model that reads ground-truth boxes needs them from elsewhere)."""
    loaders = [(path if crop is None else f"{path}#crop={','.join(map(str, crop))}",
                lambda path=path, crop=crop: _load(path, crop)) for path, crop in items]
    return encode_loaded(scorer, loaders, batch_size, desc, total=len(items))


@torch.no_grad()
def encode_loaded(scorer, items: Iterable[tuple[str, Callable]], batch_size: int, desc: str, total: int | None = None):
    """:func:`encode_image_files` over ``(id, load)`` pairs, ``load()`` giving a PIL image or raising BadImage /
    OSError (skipped, with the reason): files, records of a data source, or samples a stream already decoded.

    A scorer that reads ground-truth boxes has its box file's coverage of the items counted (``box_coverage``): a
    list of items before any is encoded, a stream as it comes (judged at its end); the count goes to the log, and
    past ``--max-missing-boxes`` (or with no item matched) the run stops."""
    coverage = scorer.box_coverage(desc)
    streamed = not isinstance(items, Sequence)
    if coverage is not None and not streamed:
        coverage.add(item_id for item_id, _ in items)
        coverage.close()
    parts, kept, skipped, batch = [], [], [], []

    def flush():
        ids = [i for _, i in batch]
        if coverage is not None and streamed:
            coverage.add(ids)
        parts.append(scorer.encode_pil_bulk([im for im, _ in batch], ids,
                                            missing_boxes="error" if coverage is None else "empty"))
        batch.clear()

    for k, (item_id, load) in enumerate(progress(items, desc=desc, unit="img", total=total)):
        try:
            image = load()
            batch.append((image, item_id))
            kept.append(k)
        except (BadImage, OSError) as e:
            skipped.append((k, f"{type(e).__name__}: {e}"))
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if coverage is not None and streamed:
        coverage.close()
    return cat_reps(parts), kept, skipped


@torch.no_grad()
def encode_texts(scorer, texts: Sequence[str], batch_size: int):
    """An evaluation's texts in its batches (``encode_texts_bulk``: an adapter computes each batch together there)."""
    return cat_reps([scorer.encode_texts_bulk(list(texts[i:i + batch_size])) for i in range(0, len(texts), batch_size)])


# --------------------------------------------------------------------------------------------- tasks
def run_retrieval(scorer, source, batch_size: int, scenes: dict | None = None,
                  per_query: PerQuery | None = None) -> dict:
    """Retrieval over a data source: an indexed one (CSV/COCO/toy world) is decoded record by record with the
    source's own decoding options; a stream (webdataset) is encoded as it is read, never held in memory. Images
    the source cannot decode are skipped and counted (``skipped_images``), their captions with them.

    On a toy world (the source's own annotations, or ``scenes`` by image id) the result also holds
    ``multi_positive`` (:func:`multi_positive_report`). ``per_query`` receives every query's values for the
    bootstrap (:func:`retrieval_per_query`)."""
    scenes = source.annotations or scenes
    entries, total = source.entries()
    captions_of: list = []
    ids: list = []

    def listed():  # a stream's entries are read as they come, an indexed source's all at once
        for entry in entries:
            captions_of.append(entry.captions)
            ids.append(entry.image_id)
            yield entry.key, entry.load

    items = listed() if total is None else list(listed())
    image_reps, kept, skipped = encode_loaded(scorer, items, batch_size, "retrieval images", total=total)
    if not kept:
        raise ValueError(f"retrieval data {source.name}: no readable image "
                         f"({len(skipped) + len(source.report.skips)} skipped); check it with python -m extract.data.check")
    texts, caption_image, caption_ids = [], [], []
    for row, k in enumerate(kept):
        for c in captions_of[k]:
            texts.append(c.text)
            caption_image.append(row)
            caption_ids.append(c.id)
    text_reps = encode_texts(scorer, texts, batch_size)
    image_ids = [ids[k] for k in kept]
    out = retrieval_from_reps(scorer, image_reps, text_reps, torch.tensor(caption_image),
                              truth=scene_truth(scenes, image_ids, caption_ids), per_query=per_query, image_keys=image_ids)
    out.update(images=len(kept), captions=len(texts),
               skipped_images=len(skipped) + sum(1 for x in source.report.skips if x.kind == "image"))
    return out


def run_zeroshot(scorer, data: ClassificationSet, templates, batch_size: int,
                 per_query: PerQuery | None = None) -> dict:
    """Zero-shot top-k of ``data``; ``per_query`` receives each image's hits (family "zero-shot images")."""
    if not data.paths or not data.classes:
        # e.g. a small toy-world split without single-object scenes: nothing to classify, not an error
        return {"skipped": f"{data.name} has no labelled images"}
    image_reps, kept, skipped = encode_image_files(scorer, [(p, None) for p in data.paths], batch_size,
                                                   "zero-shot images")
    reps, groups = class_representations(scorer, data.classes, templates)
    scores = class_scores(scorer, image_reps, reps, groups)
    labels = torch.tensor([data.labels[k] for k in kept])
    out = topk_accuracy(scores, labels)
    if per_query is not None:
        rank = positive_ranks(scores, labels, dim=1)[0].cpu()
        per_query.add_family("zero-shot images", [data.paths[k] for k in kept])
        for k in (1, 5):
            if f"top{k}" in out:
                per_query.add(f"zero-shot top-{k}", "zero-shot images", hits(rank, k))
    out.update(classes=len(data.classes), templates=len(templates), skipped_images=len(skipped) + len(data.skipped))
    return out


def item_correct(kind: str, s: torch.Tensor, s_t2i: torch.Tensor | None = None) -> dict[str, bool]:
    """Correctness of one item from its score matrix s [n_images, n_texts]: the true candidate must rank first
    (``adapters.eval.ranking.positive_ranks``), so a tie is wrong and a non-finite true score is wrong; a
    non-finite wrong candidate never beats a finite true one.

    ``s_t2i`` (directional scorers): the text->image matrix, used where texts choose between images ("image"
    items, Winoground's image score); ``s`` is then the image->text matrix.

    A "set" item (n images, n captions, caption k true of image k alone) gives shares instead of booleans: ``text``
    the share of its images that rank their own caption first of the n, ``image`` the share of its captions that rank
    their own image first, ``group`` 1 when every one of both does (Winoground's group score over the set); every
    set has the same n, so their mean over items is the per-image / per-caption accuracy (chance 1/n)."""
    s_t2i = s if s_t2i is None else s_t2i

    def first(scores, positive, dim) -> bool:
        return bool((positive_ranks(scores, torch.as_tensor(positive), dim)[0] == 1).all())

    if kind == "text":  # one image, text 0 true
        return {"acc": first(s[:1], [0], 1)}
    if kind == "image":  # one text, image 0 true
        return {"acc": first(s_t2i[:, :1], [0], 0)}
    if kind == "group":  # Winoground (Thrush et al. 2022, sec. 3.3): c_k matches i_k
        text = first(s[:2, :2], [0, 1], 1)  # each image prefers its caption
        image = first(s_t2i[:2, :2], [0, 1], 0)  # each caption prefers its image
        return {"text": text, "image": image, "group": text and image}
    if kind == "set":  # n images, n captions, c_k true of i_k only (What'sUp's controlled sets): shares, not all-or-none
        n = s.shape[0]
        rows = positive_ranks(s[:, :n], torch.arange(n), 1)[0] == 1        # each image picks its caption of the n
        cols = positive_ranks(s_t2i[:, :n], torch.arange(n), 0)[0] == 1    # each caption picks its image of the n
        text, image = rows.float().mean().item(), cols.float().mean().item()
        return {"text": text, "image": image, "group": float(bool(rows.all() and cols.all()))}
    raise ValueError(f"unknown benchmark kind {kind!r}")


def run_compositional(scorer, bench, batch_size: int, per_query: PerQuery | None = None) -> dict:
    """Accuracy per sub-type of one benchmark (:func:`item_correct`); ``per_query`` receives each item's
    correctness under :func:`headline`'s row names (family "compositional NAME", unit = the item's images)."""
    # Items share images and texts (SugarCrepe reuses COCO images, the toy world has several negatives per
    # caption): each distinct (image, crop) and text is encoded once; scores are the same either way.
    refs = list(dict.fromkeys((p, item.crop) for item in bench.items for p in item.images))
    ref_index = {r: k for k, r in enumerate(refs)}
    image_reps, kept, skipped = encode_image_files(scorer, refs, batch_size, f"{bench.name} images")
    row_of = {k: r for r, k in enumerate(kept)}
    # Texts the model cannot tell apart (a long caption and a negative that differ only past the context, cut
    # away by truncation) must score exactly alike, a tie, which is wrong; encoded separately, batch-dependent
    # float rounding would break the tie at random. A scorer that knows its inputs (``text_input_keys``) makes
    # them one.
    texts = list(dict.fromkeys(t for item in bench.items for t in item.texts))
    keys = scorer.text_input_keys(texts)
    first_of = dict.fromkeys(keys)  # key -> row of its first text among the encoded ones
    for k, key in enumerate(keys):
        if first_of[key] is None:
            first_of[key] = k
    encoded = sorted(set(first_of.values()))
    row = {k: r for r, k in enumerate(encoded)}
    text_index = {t: row[first_of[key]] for t, key in zip(texts, keys)}
    text_reps = encode_texts(scorer, [texts[k] for k in encoded], batch_size)
    per_type: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    unreadable = n_bad = n_scores = 0
    scored: list[tuple[Any, str, dict[str, bool]]] = []  # (unit, subtype, correctness) per scored item
    for item in bench.items:
        rows = [row_of.get(ref_index[(p, item.crop)]) for p in item.images]
        cols = [text_index[t] for t in item.texts]
        if any(r is None for r in rows):
            unreadable += 1  # excluded from the denominator, counted
            continue
        # each distinct text scored once and its column repeated: two columns of one matmul can differ in the
        # last bit even for the same vector, and texts sharing a representation must tie exactly
        distinct, repeat = np.unique(cols, return_inverse=True)
        img, txt = take_reps(image_reps, rows), take_reps(text_reps, distinct.tolist())
        if scorer.directional:
            matrices = (scorer.score_directed(img, txt, "i2t"), scorer.score_directed(img, txt, "t2i"))
        else:
            matrices = (scorer.score(img, txt),)
        matrices = tuple(m[:, torch.as_tensor(repeat.reshape(-1), device=m.device)] for m in matrices)
        ok_by = item_correct(bench.kind, *matrices)
        n_bad += sum(rank_safe(m)[1] for m in matrices)  # item_correct ranks them last; counted for the report
        n_scores += sum(m.numel() for m in matrices)
        groups = (item.subtype, *item.tags)
        for metric, ok in ok_by.items():
            for group in (*groups, "all"):
                per_type[group][metric].append(ok)
        scored.append(((item.images, item.crop), groups, ok_by))
    table = {sub: {m: 100 * float(np.mean(v)) for m, v in ms.items()} | {"n": len(next(iter(ms.values())))}
             for sub, ms in sorted(per_type.items(), key=lambda kv: (kv[0] != "all", kv[0]))}
    if per_query is not None and scored:
        family = f"compositional {bench.name}"
        per_query.add_family(family, [unit for unit, _, _ in scored])
        for metric in scored[0][2]:
            ok = np.array([float(c[metric]) for _, _, c in scored])
            suffix = "" if metric == "acc" else f" {metric}"
            for sub in table:
                member = np.array([sub in groups for _, groups, _ in scored])
                per_query.add(f"{bench.name} {sub}{suffix}", family, ok if sub == "all" else
                              np.where(member, ok, np.nan))
    out = {"kind": bench.kind, "per_type": table, "excluded": len(bench.skipped) + unreadable,
           "excluded_items": bench.skipped[:50], "nonfinite_scores": n_bad, "n_scores": n_scores}
    if bench.summarize is not None and scored:  # e.g. What'sUp's pair and set accuracies, as its authors count them
        kept = [item for item in bench.items if all(row_of.get(ref_index[(p, item.crop)]) is not None
                                                    for p in item.images)]
        out["summary"] = bench.summarize(kept, [bool(c.get("acc", c.get("group"))) for _, _, c in scored])
    return out


def run_linear_probe(scorer, train_set: ClassificationSet, test_set: ClassificationSet, batch_size: int,
                     seed: int) -> dict:
    """The linear probe of the scorer's global image embeddings (train set -> test set).

    Non-finite embeddings (NaN / inf in any train or test row) cannot be fitted on, and dropping them would
    probe a different set of images: the probe is then *skipped* for this model, an entry naming the model and
    counting the rows (``nonfinite_embeddings``), which :func:`evaluate` prints as a warning; the other tasks
    and models still run."""
    from train.eval.linear_probe import linear_probe

    if not scorer.has_global_embedding:  # e.g. adapters: sets of components, not one vector
        return {"skipped": f"{scorer.name} has no single global image embedding to probe"}
    feats = []
    for data in (train_set, test_set):
        reps, kept, _ = encode_image_files(scorer, [(p, None) for p in data.paths], batch_size, "probe images")
        x = reps.get("embed")
        if x is None:
            raise ValueError(f"{scorer.name}: the linear probe needs a global image embedding ('embed')")
        feats.append((x.cpu(), [data.classes[data.labels[k]] for k in kept]))
    (tx, ty), (vx, vy) = feats
    bad = int((~torch.isfinite(tx)).any(1).sum() + (~torch.isfinite(vx)).any(1).sum())
    if bad:
        return {"skipped": f"{scorer.name} gave {bad} non-finite image embedding(s) (of {len(tx) + len(vx)}); "
                           "a linear probe cannot be fitted on them", "nonfinite_embeddings": bad,
                "train": len(ty), "test": len(vy)}
    known = set(ty)
    keep = [k for k, y in enumerate(vy) if y in known]  # a class absent from train cannot be predicted
    if not keep or len(set(ty)) < 2:
        return {"skipped": "needs >= 2 classes in train and test images of those classes", "train": len(ty),
                "test": len(keep)}
    result = linear_probe(tx, ty, vx[keep], [vy[k] for k in keep], seed=seed)
    return {k: v for k, v in result.items() if isinstance(v, (int, float, str))} | {
        "train": len(ty), "test": len(keep), "test_classes_unseen_in_train": len(vy) - len(keep)}


# --------------------------------------------------------------------------------------------- driver
def evaluate(opts: EvaluateOptions) -> dict:
    """Run the evaluation ``opts`` describes; returns ``{"config", "results", "table", "markdown", "reports",
    "per_query"}`` and writes ``results.{json,md,png}`` (``results.json``: config, results per model and the
    table of :func:`comparison`) and ``config.json`` under ``opts.out``. With several models the first is the
    reference: every other column shows its difference from it with a paired bootstrap interval over the test
    images (``--bootstrap`` resamples, seeded by ``--seed``; ``adapters.eval.bootstrap``). ``per_query``: each model's
    per-query values (``adapters.eval.bootstrap.PerQuery``), for callers that aggregate further. Warnings (non-finite
    scores, small splits) are printed once each; the table itself is left to the caller (the command line prints
    it)."""
    check_options(opts, build_parser())
    if not any((opts.data, opts.retrieval_data, opts.cache, opts.zeroshot_data, opts.benchmark, opts.probe_data)):
        from extract.worlds import toyworld  # the embedded default, as train.adapter.engine and train.pretrain.engine use it

        opts = dataclasses.replace(opts, data=str(toyworld.ensure(say=say)))
        say(f"data: the embedded toy world {opts.data} (no --data given)")
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tasks = load_tasks(opts)  # every file read and checked before a model loads
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    all_results: dict[str, dict] = {}
    per_query: dict[str, PerQuery] = {}
    columns: dict[str, list[str]] = {}
    floor_name = None
    for k, (model, pretrained) in enumerate(zip(opts.model, opts.pretrained)):
        started = time.perf_counter()
        # --annotations is a box source chosen for every adapter (it replaces a detector one was trained with);
        # --data's own boxes serve only adapters trained on ground-truth boxes
        scorer = load_scorer(model, pretrained, device=device, detector=opts.detector,
                             annotations=opts.annotations or (opts.data if opts.data else None),
                             max_missing_boxes=opts.max_missing_boxes, use_annotations=bool(opts.annotations))
        res: dict = {}
        if scorer.boxes_used:  # which boxes these figures were measured with
            res["boxes"] = scorer.boxes_used
        queries = PerQuery()
        if "retrieval" in tasks and opts.cache:  # the cached arrays, not the data decoded and encoded again
            res["retrieval"] = run_retrieval_cached(scorer, tasks["retrieval"], scenes=tasks.get("scenes"),
                                                    per_query=queries)
        elif "retrieval" in tasks:
            res["retrieval"] = run_retrieval(scorer, tasks["retrieval"], opts.batch_size, scenes=tasks.get("scenes"),
                                             per_query=queries)
        if "zeroshot" in tasks:
            res["zeroshot"] = run_zeroshot(scorer, *tasks["zeroshot"], opts.batch_size, per_query=queries)
        if "compositional" in tasks:
            res["compositional"] = {b.name: run_compositional(scorer, b, opts.batch_size, per_query=queries)
                                    for b in tasks["compositional"]}
        if "linear_probe" in tasks:
            res["linear_probe"] = run_linear_probe(scorer, *tasks["linear_probe"], opts.batch_size, opts.seed)
        res["seconds"] = time.perf_counter() - started
        res["warnings"] = result_warnings(scorer.name, res)
        for line in res["warnings"]:  # a split's warning once, not once per model (or per run of a comparison)
            warn_once(line)
        label = opts.result_labels[k].format(name=scorer.name) if opts.result_labels else scorer.name
        while label in all_results:
            label += "'"
        all_results[label] = res
        per_query[label] = queries
        columns.setdefault(opts.columns[k].format(name=scorer.name) if opts.columns else label, []).append(label)
        if k == 0 and opts.text_only and opts.data and tasks.get("compositional"):
            floor = text_only_floor(scorer, opts, tasks)
            if floor is not None:
                floor_name, res, queries = floor
                all_results[floor_name], per_query[floor_name] = res, queries
                columns.setdefault(floor_name, []).append(floor_name)
    config = dataclasses.asdict(opts)
    table = comparison(all_results, columns, per_query, opts.bootstrap, opts.seed)
    if floor_name is not None:
        table["floor"] = floor_name  # the text-only column: read against chance, not as a model
    text = markdown(all_results, table)
    report = {"config": config, "results": all_results, "table": table}
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    notes = list(dict.fromkeys(line for r in all_results.values() for line in r["warnings"]))
    (out / "results.md").write_text(text + "".join(f"\n- {line}" for line in notes) + ("\n" if notes else ""))
    save_config({k: v for k, v in config.items() if k not in ("columns", "result_labels")}, out / "config.json")
    png = bar_plot(all_results, out / "results.png", table)
    reports = [out / "results.json", out / "results.md"] + ([png] if png else [])
    return {**report, "markdown": text, "reports": [str(p) for p in reports], "per_query": per_query}


def text_only_floor(scorer, opts: EvaluateOptions, tasks: dict) -> tuple[str, dict, PerQuery] | None:
    """The text-only floor next to ``scorer`` (the first model) on the toy world's benchmarks
    (``train.eval.text_only``): (its name, its results, its per-query values), or None for a scorer without a text
    tower of its own to fit it on."""
    from train.eval.text_only import fit_text_only

    backbone = scorer.text_tower()
    if backbone is None:
        return None
    base = scorer.name.split(" + ")[0]
    started = time.perf_counter()
    floor, fit = fit_text_only(backbone, opts.data, f"text only ({base})")
    queries = PerQuery()
    res = {"compositional": {b.name: run_compositional(floor, b, opts.batch_size, per_query=queries)
                             for b in tasks["compositional"] if b.name.startswith("toyworld")},
           "text_only_fit": fit}
    res["seconds"] = time.perf_counter() - started
    res["warnings"] = []
    return floor.name, res, queries


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: EvaluateOptions) -> None:
        report = evaluate(opts)
        print(report["markdown"])
        say("reports: " + ", ".join(report["reports"]))

    return run_job(job, parse_args(argv))
