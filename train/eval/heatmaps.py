"""``python -m train.eval.heatmaps``: are the per-phrase heatmaps of serve.heatmap right, or decorative? On toy-world
images, where every object's box is known, it measures how much of the map of a phrase naming one object lies
inside that object's box.

    python -m train.eval.heatmaps                                    # the tiny base of python -m train.demo --base tiny
    python -m train.eval.heatmaps --model tiny --pretrained none     # random weights: what chance looks like
    python -m train.eval.heatmaps --model runs/pretrain-tiny-filip --model runs/demo/base --images 300

For every object of the first ``--images`` scenes of ``--split``, the phrase naming it ("a small red circle") is
looked up among the noun phrases (:meth:`serve.heatmap.Heatmapper.phrases`) of a query: the scene's long caption
(``long``: "three objects: a small red circle, a large blue square and ...; the red circle is ...", which names
every object once with its size) or the object's own caption (``single``: "a small red circle", one phrase). Per
model, query and method (``--methods``):

- **localisation rate**: the share of objects whose map puts more of its mass inside the object's box than the box's
  share of the image (mass share > area share), and the mean / median of mass share / area share (1: no better
  than a uniform map);
- **specificity**: over every pair (object, another object of the same image), the share where the phrase's map is
  denser (mean heat per pixel) in its own object's box than in the other's box. The toy world's background is
  black, so a map that lights up every shape (saliency, not the phrase) passes the localisation rate easily but
  scores about 50% here;
- a control row, ``brightness``: the image's own luminance used as the map, no model and no phrase -- what saliency
  alone scores on both figures;
- for a ComAlign adapter, **box right**: the share of objects whose phrase's winning entity box (the box that
  explains the re-ranked score, :meth:`serve.heatmap.Heatmapper.explain`) is that object's (IoU >= 0.5).

Intervals are 95% percentile intervals of a bootstrap over images (objects of one image are not independent).
Writes ``OUT/results.json`` (every figure, with the settings) and prints the table.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from extract.common.cli import Parser, check_options, option, parse_options, progress, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_int
from serve.heatmap import METHODS, TEXT_SOURCES

PROG = "python -m train.eval.heatmaps"
QUERIES = ("long", "single")
#: the tiny ViT base the demo pre-trains (python -m train.demo --base tiny): the default model
DEMO_BASE = Path("runs/demo/base/model.safetensors")
DEMO_WORLD = Path("runs/demo/toyworld")
CONTROL = "brightness"
BOOTSTRAP = 2000


def _comma_list(value: Any, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"{what}: expected a comma list from {', '.join(allowed)}, got {value!r}")
    return items


@dataclass
class HeatmapEvalOptions:
    """What ``python -m train.eval.heatmaps`` measures, as data: ``evaluate_heatmaps(HeatmapEvalOptions(model=["tiny"],
    pretrained=["none"]))``. ``pretrained`` pairs with ``model`` in order (missing entries: the alias's default)."""

    model: list = option(default_factory=list, action="append", metavar="MODEL",
                         help="backbone alias / open_clip name, pre-trained checkpoint (file or run folder) or "
                              "adapter checkpoint; repeat for several (default: the demo's pre-trained tiny base, "
                              f"{DEMO_BASE})")
    pretrained: list = option(default_factory=list, action="append", metavar="WEIGHTS",
                              help="weights of the --model at the same position: tag, file or 'none' (random)")
    data: str | None = option(None, help="toy-world folder (default: the demo's, runs/demo/toyworld, when it exists, "
                                         "else the embedded toy world runs/toy, generated on first use)")
    split: str = option("test", help="toy-world split whose images are measured")
    images: int = option(200, type=nonnegative_int, help="measure the first N scenes of the split (0: all)")
    methods: Any = option(",".join(METHODS), help=f"comma list of heatmap methods from {', '.join(METHODS)}")
    queries: Any = option(",".join(QUERIES), help="comma list: long (each object's phrase within the scene's long "
                                                  "caption), single (the object's own one-phrase caption)")
    text: str = option("phrase", choices=list(TEXT_SOURCES),
                       help="phrase embedding: the phrase encoded alone, or its tokens in the whole query (context)")
    surgery_depth: int | None = option(None, type=positive_int,
                                       help="blocks on CLIP Surgery's v-v path (default: min(6, layers))")
    out: str = option("runs/heatmap-eval", help="folder for results.json")
    device: str = option("cpu", help="torch device")
    seed: int = option(0, type=nonnegative_int, help="seeds the bootstrap over images")

    def __post_init__(self):
        self.methods = _comma_list(self.methods, METHODS, "methods")
        self.queries = _comma_list(self.queries, QUERIES, "queries")
        self.model, self.pretrained = list(self.model or []), list(self.pretrained or [])
        if len(self.pretrained) > len(self.model):
            raise ValueError("more --pretrained than --model values")
        self.pretrained += [None] * (len(self.model) - len(self.pretrained))


def build_parser() -> Parser:
    return build_cli(HeatmapEvalOptions, PROG, __doc__)


def parse_args(argv: Sequence[str] | None = None) -> HeatmapEvalOptions:
    return parse_options(HeatmapEvalOptions, build_parser(), argv)


# --------------------------------------------------------------------------------------------- measures
@dataclass
class ObjectScore:
    """One object's figures: mass share of its phrase's map inside its box, the box's area share, per other object
    of the image whether the map is denser in this object's box than in that one's, and (ComAlign) whether the
    box that won the phrase's entity component is this object's."""

    image: int
    phrase: str
    mass_share: float
    area_share: float
    denser_than_others: list[bool]
    box_hit: bool | None = None  # ComAlign: the phrase's winning entity box is this object's (IoU >= 0.5)

    @property
    def hit(self) -> bool:
        return self.mass_share > self.area_share


def box_figures(heat: np.ndarray, box: Sequence[float],
                others: Sequence[Sequence[float]]) -> tuple[float, float, list[bool]]:
    """(mass share inside ``box``, area share of ``box``, [denser in ``box`` than in each of ``others``]) for a
    map heat [H, W] >= 0 and pixel boxes (x0, y0, x1, y1, end-exclusive). A map without mass has share 0."""
    h, w = heat.shape

    def cut(b):
        x0, y0, x1, y1 = (int(round(v)) for v in b)
        return heat[max(0, y0):min(h, y1), max(0, x0):min(w, x1)]

    inside = cut(box)
    total = float(heat.sum())
    mass = float(inside.sum()) / total if total > 0 else 0.0
    density = float(inside.mean()) if inside.size else 0.0
    return mass, inside.size / float(h * w), [density > (float(cut(o).mean()) if cut(o).size else 0.0) for o in others]


def summarise(scores: list[ObjectScore], n_images: int, seed: int, resamples: int = BOOTSTRAP) -> dict:
    """Rates with 95% bootstrap intervals over images: ``localisation_rate``, ``specificity`` (over pairs), the mean
    and median of mass share / area share, and the counts."""
    if not scores:
        return {"objects": 0}
    ratios = np.array([s.mass_share / s.area_share for s in scores])
    images = sorted({s.image for s in scores})
    where = {img: k for k, img in enumerate(images)}
    per = np.zeros((len(images), 6))  # hits, objects, denser pairs, pairs, right boxes, boxes
    for s in scores:
        per[where[s.image]] += (s.hit, 1, sum(s.denser_than_others), len(s.denser_than_others), bool(s.box_hit),
                                s.box_hit is not None)
    rng = np.random.default_rng(seed)
    sample = per[rng.integers(0, len(images), size=(resamples, len(images)))].sum(axis=1)  # [resamples, 4]

    def rate(num: int, den: int) -> dict:
        total = per[:, [num, den]].sum(axis=0)
        if total[1] == 0:
            return {"rate": None, "ci95": None, "n": 0}
        boot = sample[:, num] / np.maximum(sample[:, den], 1)
        return {"rate": float(total[0] / total[1]), "ci95": [float(np.percentile(boot, 2.5)),
                                                              float(np.percentile(boot, 97.5))], "n": int(total[1])}

    return {"objects": len(scores), "images": len(images), "images_measured": n_images,
            "localisation_rate": rate(0, 1), "specificity": rate(2, 3), "box_accuracy": rate(4, 5),
            "mean_ratio": float(ratios.mean()), "median_ratio": float(np.median(ratios))}


def _phrase_of(obj: dict) -> str:
    """The phrase naming a toy-world object, as its one-object caption has it ("a small red circle")."""
    from extract.worlds.toyworld import render

    return render({"objects": [{k: obj[k] for k in ("size", "colour", "shape") if k in obj}], "relations": []})


def _queries(scene: dict, kind: str) -> list[tuple[str, list[int]]]:
    """(query text, the objects it names) for one scene: the long caption naming all, or one caption each."""
    phrases = [_phrase_of(o) for o in scene["objects"]]
    if kind == "single":
        return [(p, [k]) for k, p in enumerate(phrases)]
    long = next((c["text"] for c in scene.get("captions", []) if c.get("kind") == "long"), None)
    return [(long or ", ".join(phrases), list(range(len(phrases))))]


def brightness(image) -> np.ndarray:
    """The control map: the image's luminance in [0, 1] (no model, no phrase)."""
    return np.asarray(image.convert("L"), dtype=np.float32) / 255.0


def iou(a: Sequence[float] | None, b: Sequence[float]) -> float:
    """Intersection over union of two pixel boxes (x0, y0, x1, y1); 0 when ``a`` is None."""
    if a is None:
        return 0.0
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0


def measure_model(heatmapper, world: Path, scenes: list[dict], methods: Sequence[str], queries: Sequence[str],
                  desc: str = "") -> tuple[dict[tuple[str, str], list[ObjectScore]], int]:
    """Every object's :class:`ObjectScore` per (query, method) for one model, and the number of phrases the parse
    did not find (those objects are left out and counted). A ComAlign model's winning boxes are checked too."""
    from PIL import Image

    explain = heatmapper.explains()

    out: dict[tuple[str, str], list[ObjectScore]] = {(q, m): [] for q in queries for m in methods}
    missing = 0
    for scene in progress(scenes, desc=desc, unit="image"):
        with Image.open(world / scene["file_name"]) as f:
            image = f.convert("RGB")
        boxes = [o["box"] for o in scene["objects"]]
        for kind in queries:
            for text, named in _queries(scene, kind):
                by_method = heatmapper.maps_by_method(image, text, methods, explain=explain,
                                                      image_id=scene["file_name"])
                for k in named:
                    wanted = _phrase_of(scene["objects"][k]).lower()
                    index = next((i for i, pm in enumerate(by_method[methods[0]]) if pm.phrase.lower() == wanted), None)
                    if index is None:
                        missing += 1
                        continue
                    others = [b for j, b in enumerate(boxes) if j != k]
                    for method in methods:
                        pm = by_method[method][index]
                        mass, area, denser = box_figures(pm.heat, boxes[k], others)
                        hit = iou(pm.box, boxes[k]) >= 0.5 if explain else None
                        out[(kind, method)].append(ObjectScore(scene["image_id"], pm.phrase, mass, area, denser, hit))
    return out, missing


def measure_control(world: Path, scenes: list[dict]) -> list[ObjectScore]:
    """The ``brightness`` control: the same figures with the image's luminance as every phrase's map."""
    from PIL import Image

    out = []
    for scene in scenes:
        with Image.open(world / scene["file_name"]) as f:
            heat = brightness(f)
        boxes = [o["box"] for o in scene["objects"]]
        for k, obj in enumerate(scene["objects"]):
            mass, area, denser = box_figures(heat, boxes[k], [b for j, b in enumerate(boxes) if j != k])
            out.append(ObjectScore(scene["image_id"], _phrase_of(obj), mass, area, denser))
    return out


# --------------------------------------------------------------------------------------------- the job
def resolve_data(data: str | None) -> Path:
    """The toy world to measure on (``HeatmapEvalOptions.data``); ValueError when it is not one."""
    from extract.worlds import toyworld

    if data is None:
        world = DEMO_WORLD if (DEMO_WORLD / "annotations.json").is_file() else \
            toyworld.ensure(toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED, say=say)
    else:
        world = Path(data)
    if not (world / "annotations.json").is_file():
        raise ValueError(f"--data {world}: not a toy-world folder (no annotations.json); its object boxes are the "
                         "ground truth this measures against (python -m extract.worlds.toyworld --out DIR makes one)")
    return world


def resolve_models(opts: HeatmapEvalOptions) -> list[tuple[str, str | None]]:
    """(model, pretrained) pairs; the demo's base when none is given (ValueError saying how to get one)."""
    if opts.model:
        return list(zip(opts.model, opts.pretrained))
    if not DEMO_BASE.is_file():
        raise ValueError(f"no --model given and the default, the demo's pre-trained tiny base {DEMO_BASE}, is absent: "
                         "build it with python -m train.demo --base tiny (or python -m train.pretrain --method clip --model tiny "
                         "--data runs/demo/toyworld --epochs 10 --out runs/demo/base), or name a model, e.g. "
                         "--model tiny --pretrained none (random weights)")
    return [(str(DEMO_BASE), None)]


def evaluate_heatmaps(opts: HeatmapEvalOptions) -> dict:
    """Measure (module docstring); returns the report written to ``OUT/results.json``, with ``markdown``."""
    from adapters.load import load_scorer
    from extract.worlds import toyworld
    from serve.heatmap import Heatmapper

    check_options(opts, build_parser())
    models = resolve_models(opts)
    world = resolve_data(opts.data)
    scenes = [s for s in toyworld.load(world)["scenes"] if s["split"] == opts.split and s["objects"]]
    if not scenes:
        raise ValueError(f"{world} has no scene with objects in split {opts.split!r}")
    scenes = scenes[:opts.images] if opts.images else scenes
    started = time.perf_counter()
    rows = [{"model": CONTROL, "pretrained": None, "name": "image luminance (no model)", "query": "-",
             "method": CONTROL, **summarise(measure_control(world, scenes), len(scenes), opts.seed)}]
    for model, pretrained in models:
        say(f"model {model}" + (f" ({pretrained})" if pretrained else ""))
        scorer = load_scorer(model, pretrained, device=opts.device, annotations=str(world))
        mapper = Heatmapper(scorer, device=opts.device, surgery_depth=opts.surgery_depth, text=opts.text)
        methods = [m for m in opts.methods if m in mapper.methods]
        if len(methods) < len(opts.methods):
            say(f"  {scorer.name}: {', '.join(m for m in opts.methods if m not in methods)} needs a ViT image tower; "
                f"measuring {', '.join(methods) or 'nothing'}")
        found, missing = measure_model(mapper, world, scenes, methods, opts.queries, desc=Path(model).name)
        for (query, method), scores in found.items():
            rows.append({"model": model, "pretrained": pretrained, "name": scorer.name, "query": query,
                         "method": method, "surgery_depth": mapper.depth, "phrases_not_found": missing,
                         **summarise(scores, len(scenes), opts.seed)})
    report = {"data": str(world), "split": opts.split, "images": len(scenes), "options": asdict(opts), "rows": rows,
              "seconds": time.perf_counter() - started}
    report["markdown"] = table(rows)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _pct(fig: dict) -> str:
    if not fig or fig.get("rate") is None:
        return "-"
    lo, hi = fig["ci95"]
    return f"{100 * fig['rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def table(rows: list[dict]) -> str:
    """The report's rows as a Markdown table (rates in %, 95% bootstrap intervals over images)."""
    lines = ["| model | query | method | objects | localisation rate % [95% CI] | mean (median) mass/area | "
             "specificity % [95% CI] | ComAlign box right % [95% CI] |", "|---|---|---|---:|---|---|---|---|"]
    for r in rows:
        name = r["model"] if r["pretrained"] is None else f"{r['model']} ({r['pretrained']})"
        lines.append(f"| {name} | {r['query']} | {r['method']} | {r.get('objects', 0)} | "
                     f"{_pct(r.get('localisation_rate'))} | {r.get('mean_ratio', float('nan')):.2f} "
                     f"({r.get('median_ratio', float('nan')):.2f}) | {_pct(r.get('specificity'))} | "
                     f"{_pct(r.get('box_accuracy'))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: HeatmapEvalOptions) -> None:
        report = evaluate_heatmaps(opts)
        print(f"heatmap localisation on {report['data']} ({report['split']}, {report['images']} images; "
              f"{report['seconds']:.0f} s):")
        print(report["markdown"])
        say(f"written to {Path(opts.out) / 'results.json'}")

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
