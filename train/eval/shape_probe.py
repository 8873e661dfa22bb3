"""``python -m train.eval.shape_probe``: does a backbone see shapes? Linear probes of its frozen features on the toy world.

    python -m train.eval.shape_probe --data runs/demo/toyworld --pretrained runs/demo/base/model.safetensors
    python -m train.eval.shape_probe --data WORLD --pretrained A.safetensors --pretrained B.safetensors   # side by side

Every binding result on the toy world is capped by what the frozen base encodes: a base that cannot tell a circle
from a square cannot tell "a red circle left of a blue square" from "a red square left of a blue circle", whatever
head sits on top. This measures the two halves of that separately, for each ``--pretrained`` (``none``: random
initialisation, the floor):

- image side: a logistic-regression probe of the object's shape, and of its colour, from the frozen global image
  embedding of single-object scenes (fit on up to ``--n-train`` train-split scenes, scored on up to ``--n-test``
  val/test scenes; chance is 1/6 for shape, 1/8 for colour);
- text side: the mean cosine between the text embeddings of captions that differ in the shape word only ("a small
  red circle" / "a small red square") and in the colour word only. A text tower whose shape-only cosine nears 1
  has collapsed the shape words: hard negatives that replace a shape then look like their positive, and no
  gradient asks the image tower for shape (the saddle a contrastive base can sit on; see train/adapter/README's "Hard
  negatives"); and the same for relations: a relation caption against its converse ("to the left of" / "to the
  right of") and against its objects swapped;
- position: whether the image side says which object is left. On two-object scenes (two colours), for each colour a
  probe of "the object of this colour is left of the other" (chance 50), from the global image embedding and from
  the patch tokens (the positions of the last feature map, concatenated), averaged over the colours. A base whose
  tokens know and whose embedding does not has pooled position away: a head that scores global embeddings of crops
  (ComAlign's relation components) cannot learn left from right from it;
- binding: whether the image side says which colour goes with which shape, the image half of swap-att. On
  two-object scenes of two colours and two shapes, for each colour a probe of the shape of the object of that colour,
  read as a choice between the scene's two shapes only (chance 50): a representation that holds the colours and the
  shapes present but not which goes with which scores 50. From the global embedding and from the patch tokens, as
  for position; its text half is the cosine of a caption with its attributes swapped ("a red circle ... a green
  square" / "a green circle ... a red square").
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from extract.common.cli import Parser, option, parse_options, progress, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int

PROG = "python -m train.eval.shape_probe"


@dataclass
class ShapeProbeOptions:
    data: str = option("runs/toy", help="toy-world folder (its single-object scenes are probed)")
    base: str = option("tiny", help="backbone alias or open_clip model name")
    pretrained: list = option(default_factory=list, action="append", metavar="WEIGHTS",
                              help="weights to probe (repeatable; 'none': random initialisation; default: none)")
    n_train: int = option(3000, type=positive_int, help="single-object train-split scenes the probes are fit on")
    n_test: int = option(1000, type=positive_int, help="single-object val/test scenes the probes are scored on")
    device: str = option("cpu", help="torch device")
    json_out: str | None = option(None, help="also write the figures to this JSON file")


def split_scenes(scenes: list[dict], keep, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """The scenes ``keep`` accepts: (train split, at most n_train; val/test, at most n_test)."""
    kept = [s for s in scenes if keep(s)]
    return [s for s in kept if s["split"] == "train"][:n_train], [s for s in kept if s["split"] != "train"][:n_test]


def single_object_scenes(world: Path, scenes: list[dict], n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    train, test = split_scenes(scenes, lambda s: len(s["objects"]) == 1, n_train, n_test)
    if len(train) < 20 or len(test) < 20:
        raise ValueError(f"{world}: only {len(train)} train / {len(test)} held-out single-object scenes; generate a "
                         "larger toy world (python -m extract.worlds.toyworld --n 5000)")
    return train, test


def two_colour_pair(scene: dict) -> bool:
    """A scene of two objects of different colours (the left/right probe's)."""
    return len(scene["objects"]) == 2 and scene["objects"][0]["colour"] != scene["objects"][1]["colour"]


def image_features(backbone, world: Path, scenes: list[dict], batch: int = 256,
                   tokens: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The global image embeddings [n, D]; with ``tokens`` also the L2-normalised patch tokens, flattened [n, N*D]."""
    from PIL import Image

    out, toks = [], []
    for a in range(0, len(scenes), batch):
        ims = torch.stack([backbone.preprocess(Image.open(world / s["file_name"]).convert("RGB"))
                           for s in scenes[a:a + batch]])
        with torch.no_grad():
            f = backbone.encode_images(ims.to(backbone.device))
        out.append(f.embedding.float().cpu())
        if tokens:
            toks.append(torch.nn.functional.normalize(f.patches.float(), dim=-1).flatten(1).cpu())
    return (torch.cat(out).numpy(), torch.cat(toks).numpy()) if tokens else torch.cat(out).numpy()


def left_labels(scenes: list[dict], colour: str, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(scene indices, 1 where the object of ``colour`` is left of the other, 0 where it is right of it) over the
    scenes holding one object of that colour, by the toy world's own rule (``extract.worlds.toyworld.relation_holds`` in a
    ``side``-px image: centres far enough apart; scenes where neither holds are left out)."""
    from extract.worlds.toyworld import relation_holds

    idx, left = [], []
    for i, s in enumerate(scenes):
        mine = [o for o in s["objects"] if o["colour"] == colour]
        if len(mine) != 1:
            continue
        other = next(o for o in s["objects"] if o is not mine[0])
        for answer, predicate in ((1, "left of"), (0, "right of")):
            if relation_holds(mine[0]["box"], predicate, other["box"], side):
                idx.append(i)
                left.append(answer)
    return np.asarray(idx, dtype=np.int64), np.asarray(left, dtype=np.int64)


def left_right_probe(xtr: np.ndarray, train: list[dict], xte: np.ndarray, test: list[dict],
                     side: int) -> float | None:
    """Held-out accuracy (%) of "the object of colour c is left of the other", one probe per colour, averaged over
    the colours with both answers among >= 5 train scenes each and >= 10 held-out scenes; None without any."""
    from extract.worlds.toyworld import COLOURS

    scores = []
    for colour in COLOURS:
        itr, ytr = left_labels(train, colour, side)
        ite, yte = left_labels(test, colour, side)
        if min(int(ytr.sum()), int(len(ytr) - ytr.sum())) < 5 or len(yte) < 10:
            continue
        scores.append(probe(xtr[itr], ytr.tolist(), xte[ite], yte.tolist()))
    return float(np.mean(scores)) if scores else None


def binding_scene(scene: dict) -> bool:
    """A scene of two objects of different colours and different shapes (the binding probe's)."""
    return two_colour_pair(scene) and scene["objects"][0]["shape"] != scene["objects"][1]["shape"]


def binding_probe(xtr: np.ndarray, train: list[dict], xte: np.ndarray, test: list[dict]) -> float | None:
    """Held-out accuracy (%) of "which of the scene's two shapes has colour c", one probe per colour (a 6-way shape
    probe whose answer is read as the likelier of the two shapes present: chance 50), averaged over the colours with
    >= 20 train and >= 10 held-out scenes; None without any."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from extract.worlds.toyworld import COLOURS

    def of(scenes, colour):
        idx, mine, other = [], [], []
        for i, s in enumerate(scenes):
            objs = s["objects"]
            if binding_scene(s) and colour in (objs[0]["colour"], objs[1]["colour"]):
                k = 0 if objs[0]["colour"] == colour else 1
                idx.append(i)
                mine.append(objs[k]["shape"])
                other.append(objs[1 - k]["shape"])
        return np.asarray(idx, dtype=np.int64), mine, other

    scores = []
    for colour in COLOURS:
        itr, ytr, _ = of(train, colour)
        ite, yte, ote = of(test, colour)
        if len(itr) < 20 or len(ite) < 10 or len(set(ytr)) < 2:
            continue
        scaler = StandardScaler().fit(xtr[itr])
        clf = LogisticRegression(max_iter=3000).fit(scaler.transform(xtr[itr]), ytr)
        logp = dict(zip(clf.classes_, clf.predict_log_proba(scaler.transform(xte[ite])).T))
        floor = np.full(len(ite), -np.inf)  # a shape the probe never saw as the answer: never chosen
        right = [logp.get(y, floor)[j] > logp.get(o, floor)[j] for j, (y, o) in enumerate(zip(yte, ote))]
        scores.append(100.0 * float(np.mean(right)))
    return float(np.mean(scores)) if scores else None


def probe(train_x: np.ndarray, train_y: list[str], test_x: np.ndarray, test_y: list[str]) -> float:
    """Held-out accuracy (%) of a logistic-regression probe."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(train_x)
    clf = LogisticRegression(max_iter=3000).fit(scaler.transform(train_x), train_y)
    return 100.0 * float(clf.score(scaler.transform(test_x), test_y))


CONVERSES = (("to the left of", "to the right of"), ("above", "below"))


def _unit_embeddings(backbone, texts: list[str]) -> torch.Tensor:
    with torch.no_grad():
        return torch.nn.functional.normalize(backbone.encode_texts(texts).embedding.float(), dim=-1)


def relation_cosines(backbone) -> dict[str, float]:
    """Mean cosine of a relation caption ("a red circle to the left of a green square") with its converse ("... to
    the right of ..."), with its objects swapped ("a green square to the left of a red circle") and with its
    attributes swapped ("a green circle to the left of a red square"), over 48 object pairs and both predicate
    pairs: near 1, the text tower cannot tell replace-rel / swap-obj / swap-att negatives apart."""
    from extract.worlds.toyworld import COLOURS, SHAPES

    colours, shapes = list(COLOURS), list(SHAPES)
    pairs = [((colours[c], shapes[s]), (colours[(c + 1) % len(colours)], shapes[(s + 1) % len(shapes)]))
             for c in range(len(colours)) for s in range(len(shapes))]
    base, converse, swapped, attributes = [], [], [], []
    for ((ca, sa), (cb, sb)), (p, q) in itertools.product(pairs, CONVERSES):
        base.append(f"a {ca} {sa} {p} a {cb} {sb}")
        converse.append(f"a {ca} {sa} {q} a {cb} {sb}")
        swapped.append(f"a {cb} {sb} {p} a {ca} {sa}")
        attributes.append(f"a {cb} {sa} {p} a {ca} {sb}")
    e = _unit_embeddings(backbone, base)
    return {"text cosine, predicate converse": float((e * _unit_embeddings(backbone, converse)).sum(-1).mean()),
            "text cosine, objects swapped": float((e * _unit_embeddings(backbone, swapped)).sum(-1).mean()),
            "text cosine, attributes swapped": float((e * _unit_embeddings(backbone, attributes)).sum(-1).mean())}


def text_collapse(backbone) -> dict[str, float]:
    """Mean cosine of caption pairs that differ in the shape word only, and in the colour word only, and
    :func:`relation_cosines`."""
    from extract.worlds.toyworld import COLOURS, SHAPES

    colours, shapes = list(COLOURS), list(SHAPES)
    e = _unit_embeddings(backbone, [f"a small {c} {s}" for c in colours for s in shapes])
    sims = (e @ e.T).view(len(colours), len(shapes), len(colours), len(shapes))
    shape_only = [float(sims[c, a, c, b]) for c in range(len(colours)) for a, b in itertools.combinations(range(len(shapes)), 2)]
    colour_only = [float(sims[a, s, b, s]) for s in range(len(shapes)) for a, b in itertools.combinations(range(len(colours)), 2)]
    return {"text cosine, shape differs": float(np.mean(shape_only)),
            "text cosine, colour differs": float(np.mean(colour_only)), **relation_cosines(backbone)}


def probe_weights(opts: ShapeProbeOptions, weights: str, train: list[dict], test: list[dict],
                  pairs: tuple[list[dict], list[dict]] = ([], []), side: int = 64,
                  bound: tuple[list[dict], list[dict]] = ([], [])) -> dict[str, float]:
    from extract.models.backbone import load_backbone

    world = Path(opts.data)
    backbone = load_backbone(opts.base, weights, device=opts.device)
    xtr, xte = image_features(backbone, world, train), image_features(backbone, world, test)
    out = {}
    for key in ("shape", "colour"):
        out[f"image probe: {key} %"] = probe(xtr, [s["objects"][0][key] for s in train],
                                             xte, [s["objects"][0][key] for s in test])
    ptr, pte = pairs
    if ptr and pte:
        (etr, ttr), (ete, tte) = (image_features(backbone, world, ptr, tokens=True),
                                  image_features(backbone, world, pte, tokens=True))
        for name, a, b in (("embedding", etr, ete), ("tokens", ttr, tte)):
            found = left_right_probe(a, ptr, b, pte, side)
            if found is not None:
                out[f"image probe: left/right from {name} %"] = found
    btr, bte = bound
    if btr and bte:
        (etr, ttr), (ete, tte) = (image_features(backbone, world, btr, tokens=True),
                                  image_features(backbone, world, bte, tokens=True))
        for name, a, b in (("embedding", etr, ete), ("tokens", ttr, tte)):
            found = binding_probe(a, btr, b, bte)
            if found is not None:
                out[f"image probe: colour-shape binding from {name} %"] = found
    out.update(text_collapse(backbone))
    return out


def shape_probe(opts: ShapeProbeOptions) -> dict[str, dict[str, float]]:
    from extract.worlds.toyworld import load

    world = load(opts.data)  # read once: annotations of a 20,000-scene world are tens of MB
    train, test = single_object_scenes(Path(opts.data), world["scenes"], opts.n_train, opts.n_test)
    pairs = split_scenes(world["scenes"], two_colour_pair, opts.n_train, opts.n_test)
    bound = split_scenes(world["scenes"], binding_scene, opts.n_train, opts.n_test)
    results = {}
    for weights in progress(opts.pretrained or ["none"], desc="probing", unit="model"):
        results[weights] = probe_weights(opts, weights, train, test, pairs, world["meta"]["size"], bound)
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    keys = list(next(iter(results.values())))
    lines = ["| weights | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, row in results.items():
        cells = [f"{row[k]:.1f}" if k.endswith("%") else f"{row[k]:.3f}" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> Parser:
    return build_cli(ShapeProbeOptions, PROG, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: ShapeProbeOptions) -> None:
        results = shape_probe(opts)
        print("single-object scenes: shape chance 16.7%, colour chance 12.5%; two-object scenes: left/right and "
              "binding chance 50%; text cosines near 1 = collapsed words")
        print(table(results))

    return run_job(job, parse_options(ShapeProbeOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
