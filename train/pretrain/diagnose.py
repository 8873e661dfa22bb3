"""``python -m train.pretrain.diagnose``: what PowerCLIP and CLIP-PGS actually see on a toy world, measured -- the
questions to answer before calling a missing effect a property of the data.

    python -m train.pretrain.diagnose                        # the embedded toy world
    python -m train.pretrain.diagnose --data runs/compare/toyworld
    python -m train.pretrain.diagnose --data WORLD --run runs/compare/steps/powerclip-S/seed-0 --json diag.json

Sections (``--json`` writes every figure):

1. **Regions** (PowerCLIP §3.2): on ``--n`` train images, the object cells on the model's patch grid (the toy world's
   exact masks, ``extract.components.toy_segmenter``), against the regions each variant gives the powerset:
   PowerCLIP-R's ``--num-masks`` random boxes (``extract.components.regions.random_grid_boxes``) and PowerCLIP-S's
   object masks. Per region: the share that holds a whole object (all its cells), that *isolates* one (all its cells,
   no cell of another object), that holds no object cell at all. Per powerset term (every non-empty subset of the
   image's regions, the unions NLA-T1 / NLA-T2 aggregate over): the share whose union isolates one object, and the
   share of objects that some term isolates -- a phrase node naming one object can only match a term that holds it
   alone.
2. **Patch selection** (CLIP-PGS §3.2): the share of object cells and of background cells that CLIP-PGS_0.5 keeps,
   against FLIP's uniform 0.5 (which keeps half of each in expectation), with the pixel similarity of the first
   epoch (alpha 0) and the patch features of ``--pretrained`` (default: random initialisation) at alpha 1.
3. **Phrase trees** (PowerCLIP §3.3): a few toy captions' leaves and nodes as the data path builds them.
4. **Loss share** (``--run`` run folders): from each run's ``log.csv``, the mean over its last quarter of the
   contrastive term and of lambda x triplet (PowerCLIP's powerset term), and the ratio between them.
5. **Hard negatives scored several ways** (``--score`` weights, repeatable): on up to ``--n-items`` test-split items
   of each hard-negative type, the share where the positive caption beats the negative by the global cosine (what
   ``train.eval`` and the papers' benchmarks score) and by PowerCLIP's own powerset similarity S (§3.3: NLA-T1 and
   NLA-T2 over the image's exact object masks and the caption's phrase-tree nodes, the triplet term's S). Where S
   tells a negative apart and the cosine does not, the powerset term learnt what the global embedding was never
   asked for. On a ViT also by the cosine of the image seen through the tokens CLIP-PGS_0.5 and FLIP 0.5 keep in
   training: a model that scores higher there than on whole images suffers a train/test shift (FLIP's §3 answers
   it with unmasked tuning; CLIP-PGS evaluates on whole images too).
6. **Batch mates**: what the in-batch loss can contrast. In ``--batches`` random batches of ``--batch-size`` train
   images, each with one of its captions drawn as ``train.pretrain`` draws it, the share of captions naming two or
   more objects whose batch holds another caption with the same colours and shapes bound differently (an attribute
   swap: the only in-batch contrast that asks for binding) or with the same objects in another relation or order
   (the contrast replace-rel and swap-obj ask for). Where these are rare, neither CLIP's softmax nor PowerCLIP's
   hardest-negative triplet meets them; NegCLIP's hard negatives (``--hard-negatives``) add them to every batch.
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from extract.common.cli import Parser, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int


@dataclass
class DiagnoseOptions:
    """What ``python -m train.pretrain.diagnose`` measures, as data."""

    data: str | None = option(None, help="a toy-world folder (default: the embedded toy world runs/toy, generated on "
                                         "first use)")
    model: str = option("tiny", help="the pre-training model (its patch grid and preprocessing)")
    pretrained: str | None = option(None, help="weights whose patch features CLIP-PGS selects with (default: random "
                                               "initialisation)")
    n: int = option(400, type=positive_int, help="train-split images measured")
    num_masks: int = option(10, type=positive_int, help="PowerCLIP's M: regions per image")
    seed: int = option(0, help="seeds the random boxes and CLIP-PGS's seed patches")
    run: list = option(default_factory=list, action="append", metavar="RUN_DIR",
                       help="a train.pretrain run folder whose log.csv gives the loss share (repeatable)")
    score: list = option(default_factory=list, action="append", metavar="WEIGHTS",
                         help="weights of --model whose test-split hard negatives are scored by the global cosine "
                              "and by the powerset similarity (repeatable; 'none': random initialisation)")
    n_items: int = option(500, type=positive_int, help="test items per hard-negative type that --score scores")
    batches: int = option(1000, type=positive_int, help="random train batches the batch-mates section draws")
    batch_size: int = option(64, type=positive_int, help="images per batch, batch-mates section")
    json: str | None = option(None, help="write every figure here")


def build_parser() -> Parser:
    return build_cli(DiagnoseOptions, "python -m train.pretrain.diagnose", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> DiagnoseOptions:
    return parse_options(DiagnoseOptions, build_parser(), argv)


# --------------------------------------------------------------------------------------------- 1. regions
def object_cells(world: Path, n: int, backbone) -> tuple[list[str], list[np.ndarray]]:
    """The first ``n`` train images: (their paths, each one's object cells [objects, rows * cols] bool on the
    backbone's patch grid, from the exact masks)."""
    from PIL import Image

    scenes = [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if s["split"] == "train"][:n]
    files = [str(world / s["file_name"]) for s in scenes]
    return files, [grid_cells(Image.open(f).convert("RGB"), backbone) for f in files]


def grid_cells(image, backbone) -> np.ndarray:
    """The image's exact object masks (``extract.components.toy_segmenter``) on the backbone's patch grid:
    [objects, rows * cols] bool."""
    from extract.components.regions import masks_to_grid, preprocess_geometry
    from extract.components.toy_segmenter import ToySegmenter

    masks = ToySegmenter().generate(image).masks
    input_size, mode = preprocess_geometry(backbone)
    return masks_to_grid(masks, image.size, input_size, tuple(backbone.grid), resize_mode=mode).reshape(len(masks), -1)


def region_stats(objects: np.ndarray, regions: np.ndarray) -> dict[str, float]:
    """Counts for one image: objects [K, N] bool cells, regions [M, N] bool (non-empty). Returns sums (not shares)
    of regions holding / isolating an object / holding none, of powerset terms isolating one, and of objects some
    term isolates, with the totals to divide by."""
    obj = objects.astype(np.int64)
    m = len(regions)
    subsets = np.array(list(itertools.product([0, 1], repeat=m))[1:], dtype=np.int64)  # [2^M - 1, M]
    unions = (subsets @ regions.astype(np.int64)) > 0  # [T, N]

    def isolated(sets: np.ndarray) -> np.ndarray:  # [S, K]: set s holds all of object k and no cell of another
        covered = (sets.astype(np.int64) @ obj.T) == obj.sum(1)[None, :]
        touched = (sets.astype(np.int64) @ obj.T) > 0
        others = touched.sum(1, keepdims=True) - touched
        return covered & (others == 0)

    whole = ((regions.astype(np.int64) @ obj.T) == obj.sum(1)[None, :]).any(1)
    terms = isolated(unions)
    return {"regions": m, "terms": len(unions), "objects": len(objects),
            "region_holds_object": int(whole.sum()), "region_isolates_object": int(isolated(regions).any(1).sum()),
            "region_background_only": int(((regions.astype(np.int64) @ obj.T) == 0).all(1).sum()),
            "term_isolates_object": int(terms.any(1).sum()), "object_isolated_by_a_term": int(terms.any(0).sum())}


def regions_section(cells: list[np.ndarray], grid: tuple[int, int], m: int, seed: int) -> dict[str, dict]:
    from extract.components.regions import random_grid_boxes

    rng = np.random.default_rng(seed)
    out = {}
    for name in ("powerclip-R (random boxes)", "powerclip-S (object masks)"):
        total: dict[str, int] = {}
        for objects in cells:
            if name.startswith("powerclip-R"):
                regions = random_grid_boxes(grid, m, rng)[1].reshape(m, -1)
            else:
                regions = objects[:m]
            for k, v in region_stats(objects, regions).items():
                total[k] = total.get(k, 0) + v
        out[name] = {
            "regions per image": total["regions"] / len(cells),
            "regions holding a whole object %": 100 * total["region_holds_object"] / total["regions"],
            "regions isolating one object %": 100 * total["region_isolates_object"] / total["regions"],
            "regions with no object cell %": 100 * total["region_background_only"] / total["regions"],
            "powerset terms isolating one object %": 100 * total["term_isolates_object"] / total["terms"],
            "objects some term isolates %": 100 * total["object_isolated_by_a_term"] / total["objects"]}
    return out


# --------------------------------------------------------------------------------------------- 2. CLIP-PGS
def selection_section(files: list[str], cells: list[np.ndarray], model, preprocess, seed: int) -> dict[str, dict]:
    import torch
    from PIL import Image

    from adapters.objectives.clip_pgs import PGSConfig, pgs_select
    from adapters.objectives.towers import patch_embed

    images = torch.stack([preprocess(Image.open(f).convert("RGB")) for f in files])
    on_object = torch.from_numpy(np.stack([c.any(0) for c in cells]))  # [B, N]
    visual = model.visual
    grid, patch = tuple(visual.grid_size), tuple(visual.patch_size)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(on_object.shape, generator=gen)
    with torch.no_grad():
        features = patch_embed(model, images)
    out = {}
    for label, alpha in (("clip-pgs 0.5, alpha 0 (pixels: the first epoch)", 0.0),
                         ("clip-pgs 0.5, alpha 1 (patch features)", 1.0)):
        keep, padding, _ = pgs_select(images, features, noise, PGSConfig(min_ratio=0.5, max_ratio=0.5), alpha,
                                      grid, patch)
        kept = torch.zeros_like(on_object)
        valid = torch.ones_like(keep, dtype=torch.bool) if padding is None else ~padding
        kept.scatter_(1, keep, valid)
        out[label] = {"object cells kept %": 100 * float((kept & on_object).sum() / on_object.sum()),
                      "background cells kept %": 100 * float((kept & ~on_object).sum() / (~on_object).sum())}
    out["flip 0.5 (uniform)"] = {"object cells kept %": 50.0, "background cells kept %": 50.0}
    out["object cells per image (of the grid)"] = {"mean": float(on_object.sum(1).float().mean()),
                                                   "grid": grid[0] * grid[1]}
    return out


def chooses_patches(model) -> bool:
    """Whether CLIP-PGS can run on ``model``'s image tower (a ViT: it chooses which patches enter it)."""
    from adapters.objectives.towers import UnsupportedModelError, check_model

    try:
        check_model(model, chooses_patches=True)
    except UnsupportedModelError:
        return False
    return True


# --------------------------------------------------------------------------------------------- 3, 4
def trees_section(captions: Sequence[str]) -> list[dict]:
    from extract.components.text import TextComponentExtractor

    extractor = TextComponentExtractor(max_entities=0, max_relations=0, max_leaves=16, max_nodes=16)
    out = []
    for caption, comp in zip(captions, extractor.extract(list(captions))):
        leaves = [leaf.text for leaf in comp.tree.leaves]
        nodes = [" + ".join(leaves[i] for i in node) for node in comp.tree.nodes]
        out.append({"caption": caption, "leaves": leaves, "nodes": nodes})
    return out


def loss_section(runs: Sequence[str]) -> dict[str, dict]:
    out = {}
    for run in runs:
        config = json.loads((Path(run) / "config.json").read_text())
        lam = config.get("powerclip_lambda")
        with open(Path(run) / "log.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("triplet")]
        if not rows or lam is None:
            out[run] = {"note": "no triplet column (not a powerclip run)"}
            continue
        tail = rows[len(rows) * 3 // 4:]
        clip = float(np.mean([float(r["clip"]) for r in tail]))
        trip = float(np.mean([float(r["triplet"]) for r in tail])) * float(lam)
        out[run] = {"contrastive": clip, "lambda x triplet": trip, "lambda": lam, "share of the loss %": 100 * trip /
                    (clip + trip), "steps averaged": len(tail)}
    return out


# --------------------------------------------------------------------------------------------- 5. two scores
def grid_object_masks(image, backbone, m: int) -> np.ndarray:
    """:func:`grid_cells`, the first ``m``, padded with empty rows to [m, rows * cols]."""
    cells = grid_cells(image, backbone)[:m]
    out = np.zeros((m, cells.shape[1]), dtype=bool)
    out[:len(cells)] = cells
    return out


def image_views(model, images, seed: int = 0, whole=None) -> dict:
    """The pooled image embeddings a hard-negative item is scored with: the whole image (what ``train.eval`` and the
    benchmarks use) and, on a ViT, the tokens that CLIP-PGS_0.5 (alpha 1: the patch features, as at the end of
    training) and FLIP 0.5 (seeded uniform drop) let into the transformer during training -- a model scored higher
    on its own training view than on whole images has learnt something the whole image hides (a train/test shift).
    ``whole``: the whole image's pooled embedding where the caller has it already (it is not computed again)."""
    import torch

    from adapters.objectives.clip_pgs import PGSConfig, pgs_select
    from adapters.objectives.towers import encode_image, keep_count, patch_embed, random_keep

    views = {"global cosine": encode_image(model, images).pooled if whole is None else whole}
    if chooses_patches(model):
        visual = model.visual
        embedded = patch_embed(model, images)
        n = embedded.shape[1]
        noise = torch.rand(len(images), n, generator=torch.Generator().manual_seed(seed))
        keep, padding, _ = pgs_select(images, embedded, noise, PGSConfig(min_ratio=0.5, max_ratio=0.5), 1.0,
                                      tuple(visual.grid_size), tuple(visual.patch_size))
        views["cosine, CLIP-PGS 0.5 tokens"] = encode_image(model, embedded=embedded, keep=keep,
                                                            key_padding=padding).pooled
        views["cosine, FLIP 0.5 tokens"] = encode_image(model, embedded=embedded,
                                                        keep=random_keep(noise, keep_count(n, 0.5))).pooled
    return {k: torch.nn.functional.normalize(v, dim=-1) for k, v in views.items()}


def score_items(backbone, items, m: int = 10, batch: int = 64) -> dict[str, np.ndarray]:
    """For each (image, (positive, negative)) item: whether the positive scores above the negative by the global
    cosine, by PowerCLIP's powerset similarity S over the exact object masks (the triplet term's S, with the
    objective's default settings) and, on a ViT, by the cosine on CLIP-PGS's and FLIP's training tokens
    (:func:`image_views`). Returns a bool array per way, keyed by its name."""
    import torch
    from PIL import Image

    from adapters.losses.nla import combined_similarity, leaf_embeddings, node_embeddings, region_embeddings
    from adapters.objectives.powerclip import PowerCLIPObjective
    from adapters.objectives.towers import encode_image, encode_text

    objective = PowerCLIPObjective()
    model, tokenizer = backbone.model, backbone.tokenizer
    right: dict[str, list] = {}
    for a in range(0, len(items), batch):
        chunk = items[a:a + batch]
        pil = [Image.open(it.images[0]).convert("RGB") for it in chunk]
        images = torch.stack([backbone.preprocess(im) for im in pil])
        masks = torch.from_numpy(np.stack([grid_object_masks(im, backbone, m) for im in pil]))
        with torch.no_grad():
            image = encode_image(model, images, patches=True)
            views = image_views(model, images, seed=a, whole=image.pooled)
            regions, region_mask = region_embeddings(image.patches, masks)
            scores: dict[str, list] = {}
            for k in (0, 1):  # the positive, then the negative
                trees = objective.trees([it.texts[k] for it in chunk], tokenizer)
                text = encode_text(model, trees["text"], tokens=True)
                leaves, leaf_valid = leaf_embeddings(text.tokens, trees["leaf_tokens"])
                node_leaves = trees["node_leaves"].bool() & leaf_valid[:, None, :]
                nodes = node_embeddings(leaves, node_leaves)
                s = combined_similarity(regions, region_mask, nodes, node_leaves.any(-1), objective.loss_cfg,
                                        node_leaves.sum(-1).float())
                pooled_text = torch.nn.functional.normalize(text.pooled, dim=-1)
                for name, pooled in views.items():
                    scores.setdefault(name, []).append((pooled * pooled_text).sum(-1))
                scores.setdefault("powerset S", []).append(s.diagonal())
        for name, (pos, neg) in scores.items():
            right.setdefault(name, []).append((pos > neg).numpy())
    return {name: np.concatenate(v) for name, v in right.items()}


def scores_section(world: Path, model: str, weights: Sequence[str], n_items: int) -> dict[str, dict]:
    from extract.models.backbone import load_backbone
    from train.eval.datasets import read_toyworld

    if not weights:  # nothing asked: the test split is not read
        return {}
    by_type: dict[str, list] = {}
    for it in read_toyworld(world, "test").items:
        if len(by_type.setdefault(it.subtype, [])) < n_items:
            by_type[it.subtype].append(it)
    out = {}
    for w in weights:
        backbone = load_backbone(model, w, device="cpu")
        row = {}
        for kind, items in sorted(by_type.items()):
            right = score_items(backbone, items)
            row[kind] = {"items": len(items), **{f"{name} %": 100 * float(r.mean()) for name, r in right.items()}}
        out[w] = row
    return out


def batch_mates_section(scenes: Sequence[dict], batch_size: int, batches: int, seed: int) -> dict[str, dict]:
    """Per caption kind naming two or more objects: in random batches of ``batch_size`` train scenes with one caption
    each, the share of such captions whose batch holds another caption with the same colours and shapes bound
    otherwise ("attribute swap in the batch %") or the same colour-shape objects and other words ("same objects,
    another relation or order %"). Captions are compared by their ``struct`` (the world's own record of them)."""
    rng = np.random.default_rng(seed)
    train = [s for s in scenes if s.get("split") == "train" and s["captions"]]
    if len(train) < 2:
        return {}
    size = min(batch_size, len(train))

    def key(caption: dict) -> tuple:
        objects = caption["struct"]["objects"]
        return (tuple(sorted((o["colour"], o["shape"]) for o in objects)),
                tuple(sorted(o["colour"] for o in objects)), tuple(sorted(o["shape"] for o in objects)))

    counts: dict[str, list[int]] = {}
    for _ in range(batches):
        captions = [train[i]["captions"][rng.integers(len(train[i]["captions"]))]
                    for i in rng.choice(len(train), size, replace=False)]
        keys = [key(c) for c in captions]
        for i, c in enumerate(captions):
            if len(c["struct"]["objects"]) < 2:
                continue
            others = [j for j in range(size) if j != i]
            swap = any(keys[j][1:] == keys[i][1:] and keys[j][0] != keys[i][0] for j in others)
            moved = any(keys[j][0] == keys[i][0] and captions[j]["text"] != c["text"] for j in others)
            row = counts.setdefault(c["kind"], [0, 0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + swap, row[2] + moved
    return {kind: {"captions": n, "attribute swap in the batch %": 100 * swap / n,
                   "same objects, another relation or order %": 100 * moved / n}
            for kind, (n, swap, moved) in sorted(counts.items())}


def diagnose(opts: DiagnoseOptions) -> dict:
    from extract.worlds.toyworld import is_toyworld
    from extract.models.backbone import load_backbone

    if opts.data is None:
        from extract.worlds import toyworld

        opts = dataclasses.replace(opts, data=str(toyworld.ensure(say=say)))
    world = Path(opts.data)
    if not is_toyworld(world):
        raise ValueError(f"--data {world}: not a toy-world folder (python -m extract.worlds.toyworld makes one)")
    backbone = load_backbone(opts.model, opts.pretrained or "none", device="cpu")
    files, cells = object_cells(world, opts.n, backbone)
    grid = tuple(backbone.grid)
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    by_kind: dict[str, str] = {}  # one caption of each kind the world writes (one-object, relation, ...)
    for s in scenes:
        for c in s["captions"]:
            by_kind.setdefault(c["kind"], c["text"])
    captions = list(by_kind.values())
    report = {"images": len(files), "grid": list(grid),
              "regions": regions_section(cells, grid, opts.num_masks, opts.seed),
              "selection": selection_section(files, cells, backbone.model, backbone.preprocess, opts.seed)
              if chooses_patches(backbone.model) else {},
              "trees": trees_section(captions), "loss": loss_section(opts.run),
              "scores": scores_section(world, opts.model, opts.score, opts.n_items),
              "batch_mates": batch_mates_section(scenes, opts.batch_size, opts.batches, opts.seed)}
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def render(report: dict) -> str:
    lines = [f"{report['images']} train images, patch grid {report['grid'][0]} x {report['grid'][1]}", "",
             "1. regions (PowerCLIP §3.2)"]
    for name, row in report["regions"].items():
        lines.append(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
    lines += ["", "2. patch selection (CLIP-PGS §3.2)" + ("" if report["selection"] else
                                                             ": not on this model (CLIP-PGS needs a ViT)")]
    for name, row in report["selection"].items():
        lines.append(f"  {name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in row.items()))
    lines += ["", "3. phrase trees (PowerCLIP §3.3)"]
    for t in report["trees"]:
        lines.append(f"  {t['caption']!r}: leaves {t['leaves']}, nodes {t['nodes']}")
    if report["loss"]:
        lines += ["", "4. loss share (last quarter of each run)"]
        for run, row in report["loss"].items():
            lines.append(f"  {run}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in row.items()))
    if report.get("scores"):
        lines += ["", "5. test hard negatives: positive above negative (%), by each score"]
        for w, row in report["scores"].items():
            lines.append(f"  {w}:")
            for kind, v in row.items():
                lines.append(f"    {kind} ({v['items']} items): " + ", ".join(
                    f"{k.removesuffix(' %')} {x:.1f}" for k, x in v.items() if k != "items"))
    if report.get("batch_mates"):
        lines += ["", "6. batch mates (captions naming two or more objects: the share whose batch holds each contrast)"]
        for kind, row in report["batch_mates"].items():
            lines.append(f"  {kind} ({row['captions']} captions): " + "; ".join(
                f"{k.removesuffix(' %')}: {v:.2f}%" for k, v in row.items() if k != "captions"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: DiagnoseOptions) -> None:
        print(render(diagnose(opts)))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
