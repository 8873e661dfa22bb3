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
  gradient asks the image tower for shape (the saddle a contrastive base can sit on; see the README's "Hard
  negatives"); and the same for relations: a relation caption against its converse ("to the left of" / "to the
  right of") and against its objects swapped;
- position: whether the image side says which object is left. On two-object scenes (two colours), for each colour a
  probe of "the object of this colour is left of the other" (chance 50), from the global image embedding and from
  the patch tokens (the positions of the last feature map, concatenated), averaged over the colours. A base whose
  tokens know and whose embedding does not has pooled position away: a head that scores global embeddings of crops
  (ComAlign's relation components) cannot learn left from right from it.
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
                         "larger toy world (python -m extract.data.toyworld --n 5000)")
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
    scenes holding one object of that colour, by the toy world's own rule (``extract.data.toyworld.relation_holds`` in a
    ``side``-px image: centres far enough apart; scenes where neither holds are left out)."""
    from extract.data.toyworld import relation_holds

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
    from extract.data.toyworld import COLOURS

    scores = []
    for colour in COLOURS:
        itr, ytr = left_labels(train, colour, side)
        ite, yte = left_labels(test, colour, side)
        if min(int(ytr.sum()), int(len(ytr) - ytr.sum())) < 5 or len(yte) < 10:
            continue
        scores.append(probe(xtr[itr], ytr.tolist(), xte[ite], yte.tolist()))
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
    the right of ...") and with its objects swapped ("a green square to the left of a red circle"), over 48 object
    pairs and both predicate pairs: near 1, the text tower cannot tell replace-rel / swap-obj negatives apart."""
    from extract.data.toyworld import COLOURS, SHAPES

    colours, shapes = list(COLOURS), list(SHAPES)
    pairs = [(f"{colours[c]} {shapes[s]}", f"{colours[(c + 1) % len(colours)]} {shapes[(s + 1) % len(shapes)]}")
             for c in range(len(colours)) for s in range(len(shapes))]
    base, converse, swapped = [], [], []
    for (a, b), (p, q) in itertools.product(pairs, CONVERSES):
        base.append(f"a {a} {p} a {b}")
        converse.append(f"a {a} {q} a {b}")
        swapped.append(f"a {b} {p} a {a}")
    e = _unit_embeddings(backbone, base)
    return {"text cosine, predicate converse": float((e * _unit_embeddings(backbone, converse)).sum(-1).mean()),
            "text cosine, objects swapped": float((e * _unit_embeddings(backbone, swapped)).sum(-1).mean())}


def text_collapse(backbone) -> dict[str, float]:
    """Mean cosine of caption pairs that differ in the shape word only, and in the colour word only, and
    :func:`relation_cosines`."""
    from extract.data.toyworld import COLOURS, SHAPES

    colours, shapes = list(COLOURS), list(SHAPES)
    e = _unit_embeddings(backbone, [f"a small {c} {s}" for c in colours for s in shapes])
    sims = (e @ e.T).view(len(colours), len(shapes), len(colours), len(shapes))
    shape_only = [float(sims[c, a, c, b]) for c in range(len(colours)) for a, b in itertools.combinations(range(len(shapes)), 2)]
    colour_only = [float(sims[a, s, b, s]) for s in range(len(shapes)) for a, b in itertools.combinations(range(len(colours)), 2)]
    return {"text cosine, shape differs": float(np.mean(shape_only)),
            "text cosine, colour differs": float(np.mean(colour_only)), **relation_cosines(backbone)}


def probe_weights(opts: ShapeProbeOptions, weights: str, train: list[dict], test: list[dict],
                  pairs: tuple[list[dict], list[dict]] = ([], []), side: int = 64) -> dict[str, float]:
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
    out.update(text_collapse(backbone))
    return out


def shape_probe(opts: ShapeProbeOptions) -> dict[str, dict[str, float]]:
    from extract.data.toyworld import load

    world = load(opts.data)  # read once: annotations of a 20,000-scene world are tens of MB
    train, test = single_object_scenes(Path(opts.data), world["scenes"], opts.n_train, opts.n_test)
    pairs = split_scenes(world["scenes"], two_colour_pair, opts.n_train, opts.n_test)
    results = {}
    for weights in progress(opts.pretrained or ["none"], desc="probing", unit="model"):
        results[weights] = probe_weights(opts, weights, train, test, pairs, world["meta"]["size"])
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
        print("single-object scenes: shape chance 16.7%, colour chance 12.5%; two-object scenes: left/right chance "
              "50%; text cosines near 1 = collapsed words")
        print(table(results))

    return run_job(job, parse_options(ShapeProbeOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
