"""``python -m train.demo``: the main job end to end on the embedded default, the toy world.

It checks the backbones (absent weights fail at once, naming the file), generates the toy world (holding out of its
train split the colour-shape combinations the bases' own pre-training held out, ``extract.models.backbone.trained_holdout``,
so its held-out rows test combinations no model saw), pre-trains a base that has no weights of its own (``--base
tiny``: CLIP's objective, ``train.pretrain.engine.pretrain``) and trains every registered adapter on each frozen base
(``train.adapter.compare.compare``: one shared feature cache, one ``train.adapter.train`` run per method and seed).
The default base is the toy CLIP pre-trained with hard negatives (NegCLIP's recipe) that ships with plugvlm
(``extract/models/bases``); ``--base toy-clip,toy-negclip`` adds its twin without them and compares the two (the
binding table of train/README is measured so). Each base gets its full table of the frozen base vs base + each adapter on the test split:
retrieval R@k, multi-positive retrieval (any-true R@k and mAP, by caption kind and object count:
``adapters.eval.multipositive``) and accuracy per hard-negative type (held-out combinations as their own rows), each
adapter's difference from its base with its 95% paired bootstrap interval over the test images (``*``: the interval
excludes 0). The frozen bases are compared with each other the same way, and the binding table gathers the rows
that matter for binding (:func:`binding_table`). ``--seeds N`` trains every adapter N times (mean ± sd over seeds;
the interval is that of the seed-averaged difference).

``--full`` is the long run: each method where its paper makes its claim, on the last base. It also trains a small YOLO
on the toy world's train split (``extract.components.toy_detector``) and adds ComAlign and the grounded head on those
detected boxes, and ComAlign on random boxes, next to their ground-truth ones (the oracle no user has), adds the PowerCLIP head trained with its CLIP term alone (the control of its powerset
loss), compares PowerCLIP fine-tuning the backbone (``--unfreeze``) with the same fine-tune without its powerset loss
(:func:`powerclip_fine_tune`, paired intervals against that control) on the toy world (not on a hard world: there it
shows no effect through the head, and its tokens localise every object before it; train/adapter/powerclip.md, "The fine-tune on the
hard world"), pre-trains CLIP-PGS against FLIP, PowerCLIP-R against CLIP and, with hard negatives, PowerCLIP-S
against CLIP on a hard world (the tiny ViT from scratch, ``--hard-pretrain-n`` scenes: :mod:`train.demo_pretrain`), and it builds a
long-caption toy world (4-8 objects, dense descriptions of 100-250 tokens: ``extract.worlds.toyworld
--long-captions``) and prints a second table on its test split: the frozen base (77 tokens: long captions are cut),
SmartCLIP's frozen mask head, SmartCLIP fine-tuning the backbone with a 248-token context (``--unfreeze``, the
paper's recipe) and SmartCLIP trained on the short-caption world only. Last, it renders a path-traced 3D world
(``--world3d-n`` scenes) and reads its Controlled-A / -B analogues with the grounded head on ``toy-clip-3d-mixed``
(:mod:`train.demo_3d`).

It ends with support and depth in clutter, which the version-2 world has not (:mod:`train.demo_hard`): a hard world
(``--hard-n`` scenes), the grounded relation head trained on it on a hard base with the world's own boxes, and the
table of the frozen hard bases, the text-only floor and the head on both controlled tests (What'sUp's Controlled-A /
-B analogues) and the test split's object swaps and replaced relations. It serves that head: ``serve.index`` builds
the search index of the hard world's test split with it, one example query shows the first-stage hits next to the
head's own re-ranking, and the caption probe's graded swaps (``serve.service.grade_examples``: attribute swaps,
object swaps, replaced relations) show one the served model gets right and, if any, one it gets wrong. With
``--hard-n 0`` there is no hard world, and the demo serves the adapter that binds best over every base on the
version-2 world instead (the mean of swap-att, swap-obj and replace-rel on the validation split, not the test split:
:data:`SELECTION`). The hard world's two steps need nothing of the version-2 world's adapters: on a machine with two
or more cores, with one base and one seed, they start before them (after a base's pre-training, which has the whole
machine) and run beside them in a process of their own, each half with its share of the CPU threads
(``--jobs``: :func:`default_jobs`; :class:`train.demo_hard.HardSteps`), and the demo prints their output when it
reaches them.

Every table has the text-only floor under each base (``train.eval.text_only``: the base's text tower and a probe
fitted on the training captions against their negatives, no image), and the binding table the controlled test
(``toyworld-controlled``: four arrangements of the same two objects, four-way choices both ways, chance 25).

Everything lands in ``--out``: ``toyworld/``, ``base/`` (one base to pre-train; ``bases/<base>/`` for several: the
pre-trained backbone, open_clip-loadable ``model.safetensors`` + ``model.json``, and its last checkpoint),
``adapters/`` (one base) or ``adapters/<base>/`` (several: ``results.{json,md,png}``, one run folder per method;
``adapters/cache`` is shared), ``bases-compared/``, ``binding.md``, ``hardworld/`` (the hard world),
``hard/`` (the head's run folder ``grounded/`` and its feature cache), ``hardworld-eval/`` (its table), ``index/``
(the search index of the served model: ``python -m serve.query OUT/index "..."`` searches it, ``python -m serve``
serves it), ``demo_report.json`` and the resolved ``config.json``; with ``--full`` also the long run's folders (``pretrain-hard/``: the hard world and one
``train.pretrain.compare`` folder per comparison). Rerunning reuses the toy world, a pre-trained base, the feature
caches and the finished hard-world pre-training runs when their settings are unchanged; the adapters and the
hard world's head are trained again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from adapters.registry import ADAPTERS
from extract.common.cli import Parser, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_int, save_config
from train.demo_3d import BASE_3D, WORLD3D_N
from train.demo_hard import HARD_BASES, HARD_N, HardSteps, example_query
from train.demo_pretrain import (HARD_PRETRAIN_JOBS, HARD_PRETRAIN_N, HARD_PRETRAIN_STEPS, NEGATIVES, PLAIN,
                                  hard_pretraining, tuning_steps)

PROG = "python -m train.demo"
#: the demo's frozen base on the version-2 world: CLIP + hard negatives, shipped (extract/models/bases). One base, so
#: that the hard world's head fits the demo's 7 minutes beside every method on it (each base costs about 3 minutes
#: here); ``--base toy-clip,toy-negclip`` adds the twin without hard negatives (the first named is the reference)
DEFAULT_BASES = ("toy-negclip",)


@dataclass
class DemoOptions:
    """What the demo does, as data: ``demo(DemoOptions(n=500, epochs=2))``."""

    out: str = option("runs/demo", help="output folder (toy world, base, adapters, reports)")
    n: int = option(2000, type=positive_int, help="toy-world scenes to generate")
    seed: int = option(0, type=nonnegative_int, help="seeds the toy world, pre-training and adapters")
    base: Any = option(",".join(DEFAULT_BASES), metavar="BASES",
                       help="backbone aliases or open_clip model names, comma list: every adapter trains on each "
                            "(default: the shipped toy CLIP pre-trained with hard negatives, NegCLIP's recipe; "
                            "toy-clip,toy-negclip adds its twin without them and compares the two; "
                            "extract/models/bases)")
    pretrained: str | None = option(None, help="weights of a single --base (tag, file or 'none'); without it a base "
                                               "with no weights of its own (e.g. tiny) is pre-trained on the toy world "
                                               "first, the others use their alias's weights")
    holdout: str | None = option(None, metavar="COMBOS",
                                 help="(colour, shape) combinations held out of the toy world's train split (default: "
                                      "those the bases' own pre-training held out, so the held-out rows test "
                                      "combinations no model saw)")
    pretrain_epochs: int = option(10, type=positive_int, help="epochs of CLIP pre-training of a base without weights")
    pretrain_batch_size: int = option(64, type=positive_int, help="pre-training batch")
    methods: Any = option("all", help=f"adapters to train: comma list from {', '.join(ADAPTERS.names())}, or all")
    epochs: int = option(5, type=positive_int, help="adapter training epochs")
    seeds: int = option(1, type=positive_int,
                        help="train every adapter this many times (seeds --seed .. --seed+N-1; the toy world and the "
                             "base stay the same): the table shows mean ± sd over seeds")
    batch_size: int = option(128, type=positive_int, help="adapter training batch")
    device: str | None = option(None, help="torch device (default: cuda when available, else cpu)")
    workers: int = option(2, type=nonnegative_int, help="data-loading worker processes")
    full: bool = option(False, action="store_true",
                        help="the long run: also ComAlign and the grounded relation head on detected boxes (a YOLO "
                             "trained on the toy world), ComAlign on random boxes, the PowerCLIP head with its CLIP "
                             "term alone (the control of its powerset loss), PowerCLIP fine-tuning the backbone "
                             "against the same fine-tune without its powerset loss (on the toy world), SmartCLIP "
                             "on a long-caption toy world (frozen, --unfreeze with 248 tokens, trained on short "
                             "captions only), and CLIP-PGS against FLIP, "
                             "PowerCLIP-R and, with hard negatives, PowerCLIP-S against CLIP pre-trained on a hard "
                             "world (--hard-pretrain-n)")
    hard_n: int = option(HARD_N, type=nonnegative_int,
                         help="scenes of the hard world (support, depth, clutter) the grounded head is trained on, on "
                              f"{HARD_BASES[0]} with the world's own boxes, then scored beside the frozen hard bases "
                              "and the text-only floor on both controlled tests (What'sUp's Controlled-A / -B "
                              "analogues) and served (train/demo_hard.py; 0: no hard world, the best version-2 "
                              "adapter is served)")
    hard_epochs: int | None = option(None, type=positive_int,
                                     help="the hard world's head (and the 3D world's, --full): training epochs "
                                          "(default: until its held-out score "
                                          "stops improving, as python -m train.adapter without --epochs)")
    hard_batch_size: int | None = option(None, type=positive_int,
                                         help="the hard world's head (and the 3D world's): training batch "
                                              "(default: python -m "
                                              "train.adapter's)")
    hard_pretrain_n: int = option(HARD_PRETRAIN_N, type=nonnegative_int,
                                  help="--full: scenes of the hard world CLIP, FLIP, CLIP-PGS, PowerCLIP-R and, with "
                                       "hard negatives, CLIP and PowerCLIP-S are pre-trained on, the tiny ViT from "
                                       "scratch, one run per --seeds (train/demo_pretrain.py; 0: skip)")
    hard_pretrain_steps: int = option(HARD_PRETRAIN_STEPS, type=positive_int,
                                      help="--full: optimizer steps of each of those runs (batch "
                                           "--pretrain-batch-size; FLIP's unmasked tuning then runs 3/5 as many from "
                                           "each)")
    hard_pretrain_jobs: int = option(HARD_PRETRAIN_JOBS, type=positive_int,
                                     help="--full: those runs trained at once, each in its own process with its share "
                                          "of the CPU threads (python -m train.pretrain.compare --jobs; 1: one after "
                                          "another in this process)")
    world3d_n: int = option(WORLD3D_N, type=nonnegative_int,
                            help=f"--full: scenes of the path-traced 3D world the grounded head is trained on, on "
                                 f"{BASE_3D} with the world's own boxes, then scored beside the frozen base and the "
                                 "text-only floor on its Controlled-A / -B analogues (train/demo_3d.py; Mitsuba 3, "
                                 "the render3d extra, in all; 0: skip)")
    jobs: int | None = option(None, type=positive_int,
                              help="processes the demo runs at once: with 2, the hard world's steps run beside the "
                                   "version-2 world's adapters, each process with its share of the CPU threads "
                                   "(default: 2 for one base and one seed on a machine with two or more cores, "
                                   "else 1; --full: 1)")
    detector_epochs: int = option(12, type=positive_int,
                                  help="--full: training epochs of the toy world's detector (python -m "
                                       "extract.components.toy_detector --epochs)")


def build_parser() -> Parser:
    return build_cli(DemoOptions, PROG, __doc__)


def parse_args(argv: Sequence[str] | None = None) -> DemoOptions:
    return parse_options(DemoOptions, build_parser(), argv)


def _pretrain_base(opts: DemoOptions, world: Path, out: Path) -> str:
    """CLIP pre-training of the tiny base on the toy world's train split; reused when ``out`` already holds one
    trained with these settings (its model.json says how it was trained)."""
    from train.pretrain.options import PretrainOptions
    from train.pretrain.engine import pretrain

    popts = PretrainOptions(method="clip", model=opts.base, data=str(world), epochs=opts.pretrain_epochs,
                            batch_size=opts.pretrain_batch_size, seed=opts.seed, out=str(out), workers=opts.workers,
                            eval_every_n_epochs=0, save_every_n_steps=0, tensorboard=False, device=opts.device)
    weights = out / "model.safetensors"
    wanted = {k: getattr(popts, k) for k in ("method", "model", "data", "epochs", "batch_size", "seed")}
    if weights.is_file() and (out / "model.json").is_file():
        done = json.loads((out / "model.json").read_text()).get("args", {})
        if all(done.get(k) == v for k, v in wanted.items()):
            say(f"  reusing {weights} (same settings)")
            return str(weights)
    if out.exists():  # the demo's own base, trained with other settings: replaced, and said so
        say(f"  {out} holds a base trained with other settings; training a new one there")
        shutil.rmtree(out)
    t0 = time.perf_counter()
    path = pretrain(popts)["weights"]
    say(f"  base: {path} ({time.perf_counter() - t0:.0f} s)")
    return str(path)


#: the demo's example query: a relation caption of the toy world, where binding attributes and order matters
EXAMPLE_QUERY = "a purple circle to the right of a red circle"


#: what "binds best" means when the demo picks the model it serves: the mean of these held-out (validation) figures,
#: who has which attribute and who is where (the test split never chooses)
SELECTION = ("toyworld swap-att", "toyworld swap-obj", "toyworld replace-rel")


def binding_score(val: dict | None) -> float | None:
    """The mean of :data:`SELECTION` in an adapter run's held-out figures (None without them)."""
    figures = [val[k] for k in SELECTION if k in (val or {})]
    return sum(figures) / len(figures) if figures else None


def best_adapter(methods: dict) -> str | None:
    """The method that binds best on the validation split (:func:`binding_score`; the higher held-out T2I R@1 breaks
    a tie) in ``compare``'s results; None without any."""
    scored = {m: (binding_score(r["val"]), r["val"].get("retrieval T2I R@1", 0.0)) for m, r in methods.items()
              if r.get("checkpoint") and binding_score(r.get("val")) is not None}
    return max(scored, key=scored.get) if scored else None


def default_jobs(opts: DemoOptions, bases: int, cores: int) -> int:
    """``--jobs`` when not given: 2 (the hard world's steps beside the version-2 world's adapters) where there are two
    cores or more and the two halves take about as long, i.e. one base and one seed (the default); else 1. With
    several bases or seeds the adapters' half is several times the hard world's, and on two cores it is faster with
    both threads than beside it with one (``--base toy-clip,toy-negclip --seeds 3``: 13 min 23 s one after another,
    21 min 44 s beside, measured); ``--full`` runs its stages one after another (as its figures were measured)."""
    return 2 if cores >= 2 and bases == 1 and opts.seeds == 1 and not opts.full else 1


class Steps:
    """The numbered progress lines: ``[k/N] what``."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __call__(self, text: str) -> None:
        self.done += 1
        say(f"[{self.done}/{self.total}] {text}")


def toy_detector(opts: DemoOptions, world: Path, out: Path) -> dict:
    """A YOLO trained on the toy world's train split (``extract.components.toy_detector``; reused when trained before with the
    same world and settings): what ComAlign's detected-boxes column uses."""
    from extract.components.toy_detector import ToyDetectorOptions, summary, train_toy_detector

    result = train_toy_detector(ToyDetectorOptions(data=str(world), out=str(out), epochs=opts.detector_epochs,
                                                   seed=opts.seed, device=opts.device, workers=opts.workers))
    for line in summary(result).splitlines()[1:3]:
        say("  " + line.strip())
    return result


def full_variants(methods: list[str], detector: str | None) -> list:
    """The long run's extra columns. ComAlign and the grounded relation head on boxes a user can have, next to their
    ground-truth columns: a detector's, and (ComAlign) random ones (the control: components that know nothing of the
    objects). The PowerCLIP head
    with its CLIP term alone (``lam`` 0, the control: what the powerset loss adds is the difference)."""
    from train.adapter.compare import Variant

    out = []
    if "comalign" in methods and detector:
        out += [Variant("detector boxes", "comalign", {"extract_options": {"boxes": "yolo", "detector": detector}}),
                Variant("random boxes", "comalign", {"extract_options": {"boxes": "random"}})]
    if "grounded" in methods and detector:  # who is where from the boxes a user can have
        out.append(Variant("detector boxes", "grounded", {"extract_options": {"boxes": "yolo", "detector": detector}}))
    if "powerclip" in methods:
        out.append(Variant("CLIP loss only", "powerclip", {"head_config": {"lam": 0.0}}))
    return out


#: --full: PowerCLIP fine-tuning the backbone (``--unfreeze``) with the powerset loss, PowerCLIP-S regions (the toy
#: world's exact object masks through the toy segmenter) and NegCLIP's hard negatives, against the same fine-tune with
#: the powerset term off (``lam`` 0): train/adapter/powerclip.md measures why these settings
POWERCLIP_FINE_TUNE = {"unfreeze": True, "backbone_lr": 1e-4, "hard_negatives": "swap-att,replace-obj",
                       "extract_options": {"regions": "sam2", "segmenter": "toy"}}
#: the rows the demo prints of that comparison (the whole table is in its results.md)
FINE_TUNE_ROWS = (("swap-att", "toyworld swap-att"), ("replace-obj", "toyworld replace-obj"),
                  ("T2I R@1", "retrieval T2I R@1"), ("I2T R@1", "retrieval I2T R@1"),
                  ("swap-obj", "toyworld swap-obj"), ("replace-rel", "toyworld replace-rel"))


def powerclip_fine_tune(opts: DemoOptions, base: str, pretrained: str | None, world: Path, out: Path,
                        cache_dir: Path) -> dict:
    """The PowerCLIP fine-tune and its control on ``base`` (:data:`POWERCLIP_FINE_TUNE`, same seeds, steps and
    learning rates; every column compared with the control, paired), next to the frozen head: compare()'s result."""
    from train.adapter.compare import CompareOptions, Variant, columns, compare

    variants = [Variant("powerset loss", "powerclip", dict(POWERCLIP_FINE_TUNE)),
                Variant("CLIP loss only", "powerclip", {**POWERCLIP_FINE_TUNE, "head_config": {"lam": 0.0}})]
    copts = CompareOptions(data=str(world), out=str(out), base=base, pretrained=pretrained,
                           methods=["powerclip"],
                           variants=variants, reference="CLIP loss only", epochs=opts.epochs,
                           batch_size=opts.batch_size, seed=opts.seed, seeds=opts.seeds, workers=opts.workers,
                           device=opts.device, cache_dir=str(cache_dir), overrides={"eval_every": 0})
    for key, *_ in columns(copts):
        shutil.rmtree(out / key, ignore_errors=True)
    return compare(copts)


def paired_table(table: dict, rows=FINE_TUNE_ROWS) -> str:
    """A train.eval table with a reference column as markdown: the reference's figure, then each other column's
    mean and its paired difference from the reference [95% interval], ``*`` where it excludes 0."""
    names = list(table["metrics"])
    ref = table["reference"]
    order = [ref, *(n for n in names if n != ref and n != table.get("floor"))]
    lines = ["| model | " + " | ".join(h for h, _ in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name in order:
        cells = []
        for _, key in rows:
            m = table["metrics"][name].get(key)
            if not m:
                cells.append("")
            elif name == ref or m.get("delta") is None:
                cells.append(f"{m['mean']:.1f}")
            else:
                lo, hi = m["delta_ci"]
                cells.append(f"{m['mean']:.1f} ({m['delta']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
                             f"{'*' if m.get('significant') else ''})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: SmartCLIP's claim (paper §6.1): long, multi-concept captions, with the text context stretched to 248 tokens
LONG_CONTEXT = 248


def long_captions(opts: DemoOptions, pretrained: str | None, world: Path, out: Path) -> dict:
    """SmartCLIP where its claim lives: a long-caption toy world (same size and seed) and the comparison on its test
    split of the frozen base, the frozen mask head, the mask head fine-tuning the backbone with a 248-token context
    (``--unfreeze``) and the mask head trained on the short-caption ``world`` only."""
    from extract.worlds import toyworld
    from train.adapter.compare import CompareOptions, Variant, columns, compare

    long_world = toyworld.ensure(out / "toyworld", opts.n, opts.seed, say=lambda line: say("  " + line),
                                 replace=True, long_captions=True)
    # its column: "<base> fine-tuned + smartclip (248 tokens)"
    variants = [Variant(f"{LONG_CONTEXT} tokens", "smartclip",
                        {"unfreeze": True, "context_length": LONG_CONTEXT}),
                Variant("trained on short captions", "smartclip", {"data": str(world)})]
    copts = CompareOptions(data=str(long_world), out=str(out), base=opts.base, pretrained=pretrained,
                           methods=["smartclip"], variants=variants, epochs=opts.epochs, batch_size=opts.batch_size,
                           seed=opts.seed, seeds=opts.seeds, workers=opts.workers, device=opts.device)
    for key, *_ in columns(copts):
        shutil.rmtree(out / key, ignore_errors=True)
    return compare(copts)


def best_v2(results: dict[str, dict]) -> tuple[str, str, float] | None:
    """(base, method, binding score) of the adapter that binds best on the validation split over every base
    (:func:`binding_score`; the higher held-out T2I R@1 breaks a tie); None without any."""
    best = {(base, m): (binding_score(r["methods"][m]["val"]), r["methods"][m]["val"].get("retrieval T2I R@1", 0.0))
            for base, r in results.items() for m in [best_adapter(r["methods"])] if m is not None}
    if not best:
        return None
    base, method = max(best, key=best.get)
    return base, method, best[(base, method)][0]


def serve_model(opts: DemoOptions, checkpoint: str, world: Path, out: Path, cache_dir: Path, query: str) -> dict:
    """Index ``world``'s test split with ``checkpoint`` (``serve.index``, into ``out / "index"``) and run ``query``
    with re-ranking; returns what it did, with the hits, for the report, and the caption probe's examples there: a
    swap the served model gets right and one it gets wrong (``serve.service``)."""
    from serve.service import Served
    from serve.index import IndexOptions, build_index
    from serve.query import table
    from serve.search import Searcher

    manifest = build_index(IndexOptions(model=checkpoint, data=str(world), out=str(out / "index"), kind="flat",
                                        cache_dir=str(cache_dir), device=opts.device, workers=opts.workers,
                                        seed=opts.seed))
    searcher = Searcher.open(out / "index", device=opts.device or "cpu")
    hits = searcher.search_text(query, k=5, rerank=50)
    probes = [{"type": e.type, "verdict": e.verdict, "image_id": e.image_id, "positive": e.positive,
               "negative": e.negative} for e in Served(searcher).examples if e.verdict]
    return {"checkpoint": checkpoint, "index": str(out / "index"), "world": str(world),
            "images": manifest["collection"]["images"], "captions": manifest["collection"]["captions"],
            "query": query, "hits": hits.to_dict(), "table": table(searcher, hits), "probes": probes}


def bases_of(opts: DemoOptions) -> list[str]:
    """``--base`` as a list (the first is the reference of the bases' comparison); a ValueError says what is wrong."""
    bases = list(opts.base) if isinstance(opts.base, (list, tuple)) else [
        b.strip() for b in str(opts.base).split(",") if b.strip()]
    if not bases:
        raise ValueError("--base names no backbone: give one or more, e.g. --base toy-clip,toy-negclip")
    if len(set(bases)) != len(bases):
        raise ValueError(f"--base names a backbone twice: {','.join(bases)}")
    if opts.pretrained is not None and len(bases) > 1:
        raise ValueError(f"--pretrained names the weights of one --base; {len(bases)} are given ({','.join(bases)}): "
                         "each uses its alias's weights, or run the demo once per base")
    return bases


#: the binding table's columns: (heading, train.eval.evaluate metric); a column no row has is left out. Who has which
#: attribute (swap-att, and its same-shape subset where only colour and side tell the two apart), who is where
#: (swap-obj, replace-rel, and the controlled four-way test: a set's four arrangements of two objects, each image
#: choosing its caption of the four, each caption its image, group = the whole set right), what is there
BINDING_COLUMNS = (("swap-att", "toyworld swap-att"), ("same-shape swap-att", "toyworld swap-att [same shape]"),
                   ("swap-obj", "toyworld swap-obj"), ("replace-rel", "toyworld replace-rel"),
                   ("4-way: caption", "toyworld-controlled all text"),
                   ("4-way: image", "toyworld-controlled all image"),
                   ("4-way: group", "toyworld-controlled all group"),
                   ("replace-obj", "toyworld replace-obj"))
#: the second table: the same on combinations no model saw in training, and what binding must not cost (retrieval)
HELDOUT_COLUMNS = (("held-out swap-att", "toyworld held-out swap-att"),
                   ("held-out swap-obj", "toyworld held-out swap-obj"),
                   ("held-out replace-rel", "toyworld held-out replace-rel"),
                   ("held-out 4-way: caption", "toyworld-controlled held-out four-way text"),
                   ("held-out 4-way: image", "toyworld-controlled held-out four-way image"),
                   ("T2I R@1", "retrieval T2I R@1"), ("I2T R@1", "retrieval I2T R@1"),
                   ("T2I mAP", "retrieval T2I mAP"), ("I2T mAP", "retrieval I2T mAP"))


def _cell(m: dict | None, reference: bool) -> str:
    """A binding-table cell: the base's figure with its interval, an adapter's mean (± sd over seeds) with ``*``
    where its difference from its base has an interval excluding 0."""
    if not m:
        return ""
    if reference:
        lo, hi = m.get("ci") or (None, None)
        return f"{m['mean']:.1f}" + (f" [{lo:.1f}, {hi:.1f}]" if lo is not None else "")
    sd = f" ± {m['sd']:.1f}" if len(m.get("runs") or ()) > 1 else ""
    return f"{m['mean']:.1f}{sd}{' *' if m.get('significant') else ''}"


def binding_table(tables: dict[str, dict], versus: dict | None = None, columns=BINDING_COLUMNS) -> str:
    """One row per base and per base + adapter (``tables``: base -> the ``table`` of its train.eval.evaluate
    results.json; its text-only floor included) over ``columns``; ``versus`` (the bases' own comparison) adds a row
    per base after the first: its difference from the first with the paired interval."""
    keys = [(h, k) for h, k in columns if any(k in col for t in tables.values() for col in t["metrics"].values())]
    lines = ["| model | " + " | ".join(h for h, _ in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for t in tables.values():
        for name, metrics in t["metrics"].items():  # the base and the text-only floor with their own intervals
            cells = [_cell(metrics.get(k), name in (t["reference"], t.get("floor"))) for _, k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if versus:
        first = versus["reference"]
        for name, metrics in versus["metrics"].items():
            if name in (first, versus.get("floor")):
                continue
            cells = []
            for _, k in keys:
                m = metrics.get(k)
                cells.append("" if not m or m.get("delta") is None else
                             f"{m['delta']:+.1f} [{m['delta_ci'][0]:+.1f}, {m['delta_ci'][1]:+.1f}]"
                             f"{' *' if m.get('significant') else ''}")
            lines.append(f"| {name} − {first} (frozen) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_bases(opts: DemoOptions, bases: list[str], weights: dict[str, str | None], world: Path,
                  out: Path) -> dict:
    """The frozen bases side by side on the test split (``train.eval``, the first base the reference): what
    pre-training with hard negatives changed, with paired intervals. Returns train.eval's results.json."""
    from train.eval.evaluate import EvaluateOptions, evaluate

    given = [weights[b] for b in bases]
    models = [b if w is None else w for b, w in zip(bases, given)]
    report = evaluate(EvaluateOptions(model=models, data=str(world), split="test", tasks="retrieval,compositional",
                                      out=str(out), seed=opts.seed, device=opts.device))
    return json.loads(Path(report["reports"][0]).read_text())


def demo(opts: DemoOptions) -> dict:
    """Run the demo (module docstring); returns its report (also written to ``OUT/demo_report.json``) with the
    binding table as ``markdown`` and each base's full table under ``adapters``."""
    with contextlib.ExitStack() as cleanup:  # what runs beside the demo ends with it, failed or not
        return _demo(opts, cleanup)


def _demo(opts: DemoOptions, cleanup: contextlib.ExitStack) -> dict:
    from extract.worlds import toyworld
    from extract.models.backbone import load_backbone, resolve_spec, trained_holdout
    from train.adapter.compare import CompareOptions, columns, compare

    out = Path(opts.out)
    started = time.perf_counter()
    bases = bases_of(opts)
    several = len(bases) > 1
    methods = opts.methods
    if isinstance(methods, str):
        methods = ADAPTERS.names() if methods == "all" else [m.strip() for m in methods.split(",") if m.strip()]
    hard_pretrain = opts.full and opts.hard_pretrain_n > 0
    in_3d = opts.full and opts.world3d_n > 0
    step = Steps(4 + len(bases) + several + 2 * bool(opts.hard_n) + hard_pretrain + in_3d
                 + (1 + ("smartclip" in methods) + ("powerclip" in methods) if opts.full else 0))
    # a base without weights of its own (the tiny aliases) is pre-trained on the toy world first
    untrained = [b for b in bases if opts.pretrained is None and resolve_spec(b).pretrained is None]
    infos = {}
    # the backbones first: missing weights must fail before any other work
    step(f"backbone{'s' if several else ''}: " + ", ".join(
        f"{b} (weights: {'pre-trained on the toy world next' if b in untrained else opts.pretrained or 'the alias default'})"
        for b in bases))
    for b in bases:
        backbone = load_backbone(b, "none" if b in untrained else opts.pretrained, device="cpu")
        infos[b] = backbone.describe()
        say(f"  {b}: {infos[b]['model']}, embed dim {infos[b]['embed_dim']}, {infos[b]['grid'][0]}x"
            f"{infos[b]['grid'][1]} patches, {infos[b]['context_length']} tokens")
        del backbone
    if in_3d:  # the renderer is an extra: missing, it must fail now, not after the long run's first hour
        from extract.worlds.world3d import require_mitsuba

        require_mitsuba()
    hard_bases = [b for b in HARD_BASES if opts.hard_n and b not in bases]
    for b, world_name in [(b, "hard") for b in hard_bases] + [(BASE_3D, "3D")] * (in_3d and BASE_3D not in bases):
        infos[b] = load_backbone(b, None, device="cpu").describe()  # shipped, checked now all the same
        say(f"  {b} (the {world_name} world's): {infos[b]['model']}, embed dim {infos[b]['embed_dim']}, "
            f"{infos[b]['grid'][0]}x{infos[b]['grid'][1]} patches, {infos[b]['context_length']} tokens")
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.asdict(opts), out / "config.json")

    holdout = opts.holdout if opts.holdout is not None else sorted(
        {c for b in bases for c in trained_holdout(b, None if b in untrained else opts.pretrained)})
    step(f"toy world: {opts.n} scenes, seed {opts.seed}" + (
        f", holding out of its train split what the bases never saw: {', '.join(holdout)}"
        if holdout and opts.holdout is None else ""))
    world = toyworld.ensure(out / "toyworld", opts.n, opts.seed, say=lambda line: say("  " + line), replace=True,
                            holdout=holdout)

    weights = {b: opts.pretrained for b in bases}
    if untrained:
        step(f"pre-training {', '.join(untrained)} on the toy world (CLIP, {opts.pretrain_epochs} epochs)")
        for b in untrained:
            weights[b] = _pretrain_base(replace(opts, base=b), world, out / ("bases" if several else "") /
                                        (b if several else "base"))
    else:
        step("pre-training skipped: " + ("using the given weights" if opts.pretrained else "the bases come with "
                                         "weights"))
    hard_steps = None
    if opts.hard_n:  # needs nothing of the version-2 world's adapters: beside them where there are cores for it
        from train.child import cores  # (after a base's pre-training, which keeps the whole machine)

        hard_holdout = sorted(set(holdout) | {c for b in HARD_BASES for c in trained_holdout(b, None)})
        hard_steps = HardSteps(out, opts.hard_n, opts.seed, hard_holdout, epochs=opts.hard_epochs,
                               batch_size=opts.hard_batch_size, workers=opts.workers, device=opts.device,
                               jobs=opts.jobs or default_jobs(opts, len(bases), cores()), say=say)
        cleanup.callback(hard_steps.stop)

    variants, detector = [], None
    if opts.full and ("comalign" in methods or "grounded" in methods):
        step("a detector for ComAlign and the grounded head: YOLOv8n trained from scratch on the toy world's train "
             "split")
        detector = toy_detector(opts, world, out / "toy-detector")
    elif opts.full:
        step("detector skipped: neither ComAlign nor grounded is among --methods")
    if opts.full:  # the long run's extra columns go to the last base, the strongest by default
        variants = full_variants(methods, detector["weights"] if detector else None)
    results, tables = {}, {}
    for b in bases:
        extra = variants if b == bases[-1] else []
        step(f"adapters on the frozen {b}: {', '.join(methods)}" + "".join(f"; {v.method} ({v.label})"
                                                                           for v in extra))
        copts = CompareOptions(data=str(world), out=str(out / "adapters" / (b if several else "")), base=b,
                               pretrained=weights[b], methods=methods, variants=extra, epochs=opts.epochs,
                               batch_size=opts.batch_size, seed=opts.seed, seeds=opts.seeds, workers=opts.workers,
                               device=opts.device, cache_dir=str(out / "adapters" / "cache"),
                               # the held-out split once, after training: the demo reads the final figures only
                               overrides={"eval_every": 0})
        for key, *_ in columns(copts):  # the demo retrains its adapters each time: its own earlier runs make way
            shutil.rmtree(Path(copts.out) / key, ignore_errors=True)
        results[b] = compare(copts)
        if results[b].get("reports"):
            tables[b] = json.loads(Path(results[b]["reports"][0]).read_text())["table"]
    versus = None
    if several:
        step(f"the frozen bases compared: {', '.join(bases[1:])} against {bases[0]}")
        versus = compare_bases(opts, bases, weights, world, out / "bases-compared")["table"]
    long_result = None
    if opts.full and "smartclip" in methods:
        step(f"SmartCLIP on long captions: a long-caption toy world ({opts.n} scenes of 4-8 objects)")
        long_result = long_captions(replace(opts, base=bases[-1]), weights[bases[-1]], world,
                                    out / "long-captions")
    fine_tune = None
    if opts.full and "powerclip" in methods:
        step(f"PowerCLIP fine-tuning {bases[-1]} (--unfreeze) against the same fine-tune without its powerset loss")
        fine_tune = powerclip_fine_tune(opts, bases[-1], weights[bases[-1]], world, out / "powerclip-fine-tune",
                                        out / "adapters" / "cache")
        if fine_tune.get("reports"):
            fine_tune["paired"] = paired_table(json.loads(Path(fine_tune["reports"][0]).read_text())["table"])
    pretrain_hard = None
    if hard_pretrain:
        step(f"pre-training on a hard world ({opts.hard_pretrain_n} scenes): CLIP-PGS against FLIP, PowerCLIP-R "
             f"against CLIP, and PowerCLIP-S against CLIP with hard negatives (the tiny ViT from scratch, "
             f"{opts.hard_pretrain_steps} steps, {opts.seeds} run{'s' if opts.seeds > 1 else ''} each)")
        pretrain_hard = hard_pretraining(out / "pretrain-hard", n=opts.hard_pretrain_n,
                                         steps=opts.hard_pretrain_steps, seed=opts.seed, seeds=opts.seeds,
                                         batch_size=opts.pretrain_batch_size, workers=opts.workers,
                                         jobs=opts.hard_pretrain_jobs, device=opts.device, say=say)
    hard = served = None
    if hard_steps is not None:
        step(f"support and depth in clutter: a hard world of {opts.hard_n} scenes, seed {opts.seed}, and the "
             f"grounded head trained on it on the frozen {HARD_BASES[0]} with the world's own boxes"
             + (f" ({opts.hard_epochs} epochs)" if opts.hard_epochs else " (until its held-out score stops improving)"))
        done = hard_steps.head()
        hard_dir, head = Path(done["world"]), done["head"]
        step(f"the hard world's controlled tests and test split: {', '.join(HARD_BASES)} frozen, the text-only floor, "
             f"{HARD_BASES[0]} + grounded")
        hard = hard_steps.table()
        hard["head"] = {"checkpoint": head["adapter"], "steps": head["steps"], "seconds": head["seconds"],
                        "stopping": head.get("stopping")}
        step(f"serving {HARD_BASES[0]} + grounded, the head of the hard world: its index of the hard world's test "
             f"split -> {out / 'index'}")
        served = serve_model(opts, head["adapter"], hard_dir, out, out / "hard" / "cache",
                             example_query(hard_dir))
        served.update(base=HARD_BASES[0], method="grounded")
    else:
        best = best_v2(results)
        if best is None:
            step("serving skipped: no adapter with held-out figures")
        else:
            base, method, score = best
            step(f"serving {base} + {method}, the best binding on the validation split (mean of "
                 f"{', '.join(k.split(' ', 1)[1] for k in SELECTION)}: {score:.1f}): its index of the test "
                 f"split -> {out / 'index'}")
            served = serve_model(opts, results[base]["methods"][method]["checkpoint"], world, out,
                                 out / "adapters" / "cache", EXAMPLE_QUERY)
            served.update(base=base, method=method)
    world3d = None
    if in_3d:
        from train.demo_3d import stage

        step(f"the path-traced 3D world: {opts.world3d_n} scenes, seed {opts.seed}, the grounded head trained on it "
             f"on the frozen {BASE_3D} with the world's own boxes, scored beside the frozen base and the text-only "
             "floor on its Controlled-A / -B analogues")
        world3d = stage(out, opts.world3d_n, opts.seed, holdout=trained_holdout(BASE_3D, None),
                        epochs=opts.hard_epochs, batch_size=opts.hard_batch_size, workers=opts.workers,
                        device=opts.device, say=say)
    report = {"backbones": infos, "pretrained": weights, "toyworld": str(world), "holdout": holdout,
              "adapters": results, "bases_compared": versus, "detector": detector, "long_captions": long_result,
              "powerclip_fine_tune": fine_tune, "hard_world": hard, "world3d": world3d,
              "pretrain_hard": {k: pretrain_hard[k] for k in ("world", "tables")} if pretrain_hard else None,
              "served": served, "markdown": binding_table(tables, versus) if tables else None,
              "markdown_heldout": binding_table(tables, versus, HELDOUT_COLUMNS) if tables else None,
              "seconds": time.perf_counter() - started}
    (out / "demo_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "binding.md").write_text((report["markdown"] or "") + "\n\n" + (report["markdown_heldout"] or "") + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: DemoOptions) -> None:
        report = demo(opts)
        seeds = f"{opts.seeds} seeds, {opts.seed}..{opts.seed + opts.seeds - 1}" if opts.seeds > 1 else \
            f"seed {opts.seed}"
        results = report["adapters"]
        if report.get("markdown"):
            print(f"\nbinding: frozen base vs base + adapter (toy world test split, adapters trained with {seeds}; "
                  "accuracy %: a caption against its hard negative, chance 50;\n  4-way: the controlled test, "
                  "chance 25, group: a set's four images and captions all right; text only: the base's text tower "
                  "without the image, the floor;\n  base and text only: [95% bootstrap interval over test images]; "
                  "adapter: mean ± sd over seeds, * its difference from its base excludes 0):")
            print(report["markdown"])
            print("\non colour-shape combinations no model saw in training (held-out), and retrieval (R@1, mAP, %):")
            print(report["markdown_heldout"])
        if len(results) == 1 and next(iter(results.values())).get("markdown"):
            print(f"\nfrozen base vs base + adapter, every figure (toy world test split, adapters trained with "
                  f"{seeds}; retrieval R@k, multi-positive any-true R@k and mAP, hard-negative accuracy, %):")
            print(next(iter(results.values()))["markdown"])
        else:
            print("\nevery figure, per base: " + ", ".join(r["table"] for r in results.values() if r.get("table")))
        long_table = (report.get("long_captions") or {}).get("markdown")
        if long_table:
            print(f"\nSmartCLIP on long captions (long-caption toy world's test split, {seeds}; the base reads 77 "
                  f"tokens, the fine-tuned column {LONG_CONTEXT}; %):")
            print(long_table)
        paired = (report.get("powerclip_fine_tune") or {}).get("paired")
        if paired:
            print(f"\nPowerCLIP fine-tuning the backbone: the powerset loss against the same fine-tune without it "
                  f"(test split, {seeds}; %, difference from the CLIP-loss-only control [95% paired interval]):")
            print(paired)
        pretrain_hard = report.get("pretrain_hard")
        if pretrain_hard:
            tables = pretrain_hard["tables"]
            print(f"\npre-training on a hard world, where FLIP's uniform drop halves small objects: CLIP-PGS against "
                  f"FLIP (the clip-pgs vs flip rows; +tune: after {tuning_steps(opts.hard_pretrain_steps)} unmasked "
                  f"steps), PowerCLIP-R against CLIP (the tiny ViT, {opts.hard_pretrain_steps} steps; test split, "
                  f"{seeds}; %; the 3-seed tables: train/pretrain/compare_hard.md):")
            print(tables[PLAIN.folder])
            print("\nthe same world with NegCLIP's hard negatives for both: PowerCLIP-S against CLIP")
            print(tables[NEGATIVES.folder])
        hard = report.get("hard_world")
        if hard:
            head = hard["head"]
            print("\n" + textwrap.fill(
                f"support and depth in clutter, which the version-2 world has not: a hard world ({opts.hard_n} "
                f"scenes), the grounded head trained on it on the frozen {HARD_BASES[0]} with the world's own boxes "
                f"({head['steps']} steps, {head['seconds']:.0f} s); What'sUp's Controlled-A / -B analogues "
                "(four-way caption and image choice, group: a set's four images and captions all right) and the "
                "test split's swap-obj / replace-rel (%); detected boxes: train/adapter/README, the hard world:", 116))
            print(hard["markdown"])
        world3d = report.get("world3d")
        if world3d:
            print("\n" + textwrap.fill(
                f"the path-traced 3D world ({world3d['n']} scenes: perspective, light and shadow, objects resting on "
                f"objects), the grounded head trained on it on the frozen {BASE_3D} with the world's own boxes "
                f"({world3d['head']['steps']} steps, {world3d['head']['seconds']:.0f} s); the same tests (%); "
                "detected boxes: train/adapter/README, the 3D world:", 116))
            print(world3d["markdown"])
        if report.get("served"):
            served = report["served"]
            which = "the head of the hard world" if hard else "the best adapter"
            print(f"\n{which}, {served['base']} + {served['method']}, serving the test split "
                  f"({served['images']} images; first 50 re-ranked by its own score):")
            print(served["table"])
            for p in served.get("probes") or ():  # a hard world's captions run long: wrapped, one per line
                print(f"  {p['type']}, {p['verdict']}: image {p['image_id']}")
                for tag, text in (("true: ", p["positive"]), ("false:", p["negative"])):
                    print(textwrap.fill(f'{tag} "{text}"', 116, initial_indent="    ", subsequent_indent="           "))
            print(f"search it yourself: python -m serve.query {served['index']} \"...\" --rerank 50; the app, with "
                  f"the caption probe and the heatmaps: python -m serve")
        say(f"done in {report['seconds']:.0f} s; reports in {opts.out}: demo_report.json, binding.md, "
            "adapters/" + ("" if len(results) == 1 else "BASE/") + "results.{json,md,png}"
            + (", long-captions/results.{json,md,png}" if report.get("long_captions") else "")
            + (", powerclip-fine-tune/results.{json,md,png}" if report.get("powerclip_fine_tune") else "")
            + (", pretrain-hard/{plain,hard-negatives}/compare.{md,json}" if report.get("pretrain_hard") else "")
            + (", hardworld-eval/results.{json,md,png}, hard/grounded/" if report.get("hard_world") else "")
            + (", world3d-eval/results.{json,md,png}, 3d/grounded/" if report.get("world3d") else ""))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
