"""``python -m train.demo``: the main job end to end on the embedded default, the toy world.

It checks the backbone (absent weights fail at once, naming the file), generates the toy world, pre-trains the
tiny backbone on it with CLIP's objective (``train.pretrain.pretrain``; a few minutes on a CPU) unless
``--pretrained`` names weights, then trains every registered adapter on that frozen base
(``train.adapter_compare.compare``: one shared feature cache, one ``train.adapter.train`` run per method and seed)
and prints the side-by-side table of the frozen base vs base + each adapter on the test split: retrieval R@k,
multi-positive retrieval (any-true R@k and mAP, by caption kind and object count: ``train.multipositive``) and
accuracy per hard-negative type, each adapter's difference from the base with its 95% paired bootstrap interval
over the test images (``*``: the interval excludes 0). ``--seeds N`` trains every adapter N times (mean ± sd over
seeds; the interval is that of the seed-averaged difference).

``--full`` is the long run (57 minutes on 2 CPU cores with ``--seeds 3``, measured): each method where its paper makes
its claim. It also trains a small YOLO on the toy world's train split (``extract.toy_detector``) and adds ComAlign
on those detected boxes and on random boxes next to its ground-truth ones (the oracle no user has), adds the
PowerCLIP head trained with its CLIP term alone (the control of its powerset loss), and it builds a
long-caption toy world (4-8 objects, dense descriptions of 100-250 tokens: ``extract.toyworld --long-captions``)
and prints a second table on its test split: the frozen base (77 tokens: long captions are cut), SmartCLIP's frozen
mask head, SmartCLIP fine-tuning the backbone with a 248-token context (``--unfreeze``, the paper's recipe) and
SmartCLIP trained on the short-caption world only.

It ends by serving the best adapter (the highest held-out T2I R@1, chosen on the validation split, not the test
split; with several seeds, the method with the best mean and its best seed): ``serve.index`` builds the search
index of the test split with it, and one example query shows the first-stage hits next to the adapter's own
re-ranking.

Everything lands in ``--out``: ``toyworld/``, ``base/`` (the pre-trained backbone, open_clip-loadable
``model.safetensors`` + ``model.json``, and its last checkpoint), ``adapters/`` (cache, one run folder per
method, ``results.{json,md,png}``), ``index/`` (the search index of the best adapter: ``python -m serve.query
OUT/index "..."`` searches it), ``demo_report.json`` and the resolved ``config.json``. Rerunning reuses the
toy world, the base and the feature cache when their settings are unchanged; the adapters are trained again.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from adapters.registry import ADAPTERS
from extract.cli import Parser, option, parse_options, run_job, say
from extract.cli import build_parser as build_cli
from extract.config import nonnegative_int, positive_int, save_config

PROG = "python -m train.demo"


@dataclass
class DemoOptions:
    """What the demo does, as data: ``demo(DemoOptions(n=500, epochs=2))``."""

    out: str = option("runs/demo", help="output folder (toy world, base, adapters, reports)")
    n: int = option(2000, type=positive_int, help="toy-world scenes to generate")
    seed: int = option(0, type=nonnegative_int, help="seeds the toy world, pre-training and adapters")
    base: str = option("tiny", help="backbone alias or open_clip model name")
    pretrained: str | None = option(None, help="weights of --base (tag, file or 'none'); without it the tiny base is "
                                               "pre-trained on the toy world first, other bases use the alias's default "
                                               "weights")
    pretrain_epochs: int = option(10, type=positive_int, help="epochs of CLIP pre-training of the tiny base")
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
                        help="the long run: also ComAlign on detected boxes (a YOLO trained on the toy world) and on "
                             "random boxes, the PowerCLIP head with its CLIP term alone (the control of its powerset "
                             "loss), and SmartCLIP on a long-caption toy world (frozen, --unfreeze with 248 tokens, "
                             "trained on short captions only); 57 min on 2 CPU cores with --seeds 3")
    detector_epochs: int = option(12, type=positive_int,
                                  help="--full: training epochs of the toy world's detector (python -m "
                                       "extract.toy_detector --epochs)")


def build_parser() -> Parser:
    return build_cli(DemoOptions, PROG, __doc__)


def parse_args(argv: Sequence[str] | None = None) -> DemoOptions:
    return parse_options(DemoOptions, build_parser(), argv)


def _pretrain_base(opts: DemoOptions, world: Path, out: Path) -> str:
    """CLIP pre-training of the tiny base on the toy world's train split; reused when ``out`` already holds one
    trained with these settings (its model.json says how it was trained)."""
    from train.pretrain import PretrainOptions, pretrain

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


def best_adapter(methods: dict) -> str | None:
    """The method with the highest held-out (validation) T2I R@1 in ``compare``'s results; None without any."""
    scored = {m: r["val"]["retrieval T2I R@1"] for m, r in methods.items()
              if r.get("checkpoint") and "retrieval T2I R@1" in (r.get("val") or {})}
    return max(scored, key=scored.get) if scored else None


class Steps:
    """The numbered progress lines: ``[k/N] what``."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __call__(self, text: str) -> None:
        self.done += 1
        say(f"[{self.done}/{self.total}] {text}")


def toy_detector(opts: DemoOptions, world: Path, out: Path) -> dict:
    """A YOLO trained on the toy world's train split (``extract.toy_detector``; reused when trained before with the
    same world and settings): what ComAlign's detected-boxes column uses."""
    from extract.toy_detector import ToyDetectorOptions, summary, train_toy_detector

    result = train_toy_detector(ToyDetectorOptions(data=str(world), out=str(out), epochs=opts.detector_epochs,
                                                   seed=opts.seed, device=opts.device, workers=opts.workers))
    for line in summary(result).splitlines()[1:3]:
        say("  " + line.strip())
    return result


def full_variants(methods: list[str], detector: str | None) -> list:
    """The long run's extra columns. ComAlign on boxes a user can have, next to its ground-truth column: a
    detector's, and random ones (the control: components that know nothing of the objects). The PowerCLIP head
    with its CLIP term alone (``lam`` 0, the control: what the powerset loss adds is the difference)."""
    from train.adapter_compare import Variant

    out = []
    if "comalign" in methods and detector:
        out += [Variant("detector boxes", "comalign", {"extract_options": {"boxes": "yolo", "detector": detector}}),
                Variant("random boxes", "comalign", {"extract_options": {"boxes": "random"}})]
    if "powerclip" in methods:
        out.append(Variant("CLIP loss only", "powerclip", {"head_config": {"lam": 0.0}}))
    return out


#: SmartCLIP's claim (paper §6.1): long, multi-concept captions, with the text context stretched to 248 tokens
LONG_CONTEXT = 248


def long_captions(opts: DemoOptions, pretrained: str | None, world: Path, out: Path) -> dict:
    """SmartCLIP where its claim lives: a long-caption toy world (same size and seed) and the comparison on its test
    split of the frozen base, the frozen mask head, the mask head fine-tuning the backbone with a 248-token context
    (``--unfreeze``) and the mask head trained on the short-caption ``world`` only."""
    from extract import toyworld
    from train.adapter_compare import CompareOptions, Variant, columns, compare

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


def serve_best(opts: DemoOptions, result: dict, world: Path, out: Path, step=say) -> dict | None:
    """Index the toy world's test split with the best adapter (``serve.index``) and run :data:`EXAMPLE_QUERY`
    with re-ranking; returns what it did, with the hits, for the report."""
    from serve.index import IndexOptions, build_index
    from serve.query import table
    from serve.search import Searcher

    method = best_adapter(result["methods"])
    if method is None:
        step("serving skipped: no adapter with held-out figures")
        return None
    checkpoint = result["methods"][method]["checkpoint"]
    step(f"serving {method}, the best held-out T2I R@1: its index of the test split -> {out / 'index'}")
    manifest = build_index(IndexOptions(model=checkpoint, data=str(world), out=str(out / "index"), kind="flat",
                                        cache_dir=str(out / "adapters" / "cache"), device=opts.device,
                                        workers=opts.workers, seed=opts.seed))
    searcher = Searcher.open(out / "index", device=opts.device or "cpu")
    hits = searcher.search_text(EXAMPLE_QUERY, k=5, rerank=50)
    return {"method": method, "index": str(out / "index"), "images": manifest["collection"]["images"],
            "captions": manifest["collection"]["captions"], "query": EXAMPLE_QUERY,
            "hits": hits.to_dict(), "table": table(searcher, hits)}


def demo(opts: DemoOptions) -> dict:
    """Run the demo (module docstring); returns its report (also written to ``OUT/demo_report.json``) with the
    table as ``markdown``."""
    from extract import toyworld
    from extract.backbone import load_backbone
    from train.adapter_compare import CompareOptions, columns, compare

    out = Path(opts.out)
    started = time.perf_counter()
    step = Steps(7 if opts.full else 5)
    pretrain_base = opts.pretrained is None and opts.base.startswith("tiny")
    # the backbone first: missing weights must fail before any other work
    step(f"backbone: {opts.base} (weights: "
         f"{'pre-trained on the toy world next' if pretrain_base else opts.pretrained or 'the alias default'})")
    backbone = load_backbone(opts.base, "none" if pretrain_base else opts.pretrained, device="cpu")
    info = backbone.describe()
    say(f"  {info['model']}: embed dim {info['embed_dim']}, {info['grid'][0]}x{info['grid'][1]} patches, "
        f"{info['context_length']} tokens")
    del backbone
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.asdict(opts), out / "config.json")

    step(f"toy world: {opts.n} scenes, seed {opts.seed}")
    world = toyworld.ensure(out / "toyworld", opts.n, opts.seed, say=lambda line: say("  " + line), replace=True)

    pretrained = opts.pretrained
    if pretrain_base:
        step(f"pre-training the {opts.base} base on the toy world (CLIP, {opts.pretrain_epochs} epochs)")
        pretrained = _pretrain_base(opts, world, out / "base")
    else:
        step("pre-training skipped: using the given weights")

    methods = opts.methods
    if isinstance(methods, str):
        methods = ADAPTERS.names() if methods == "all" else [m.strip() for m in methods.split(",") if m.strip()]
    variants, detector = [], None
    if opts.full and "comalign" in methods:
        step("a detector for ComAlign: YOLOv8n trained from scratch on the toy world's train split")
        detector = toy_detector(opts, world, out / "toy-detector")
    elif opts.full:
        step("detector skipped: ComAlign is not among --methods")
    if opts.full:
        variants = full_variants(methods, detector["weights"] if detector else None)
    step(f"adapters on the frozen base: {', '.join(methods)}"
         + "".join(f"; {v.method} ({v.label})" for v in variants))
    copts = CompareOptions(data=str(world), out=str(out / "adapters"), base=opts.base, pretrained=pretrained,
                           methods=methods, variants=variants, epochs=opts.epochs, batch_size=opts.batch_size,
                           seed=opts.seed, seeds=opts.seeds, workers=opts.workers, device=opts.device)
    for key, *_ in columns(copts):  # the demo retrains its adapters each time: its own earlier runs make way
        shutil.rmtree(out / "adapters" / key, ignore_errors=True)
    result = compare(copts)
    long_result = None
    if opts.full:
        step(f"SmartCLIP on long captions: a long-caption toy world ({opts.n} scenes of 4-8 objects)")
        long_result = long_captions(opts, pretrained, world, out / "long-captions")
    served = serve_best(opts, result, world, out, step)
    report = {"backbone": info, "pretrained": pretrained, "toyworld": str(world), "adapters": result,
              "detector": detector, "long_captions": long_result, "served": served,
              "seconds": time.perf_counter() - started}
    (out / "demo_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: DemoOptions) -> None:
        report = demo(opts)
        table = report["adapters"].get("markdown")
        if table:
            seeds = f"{opts.seeds} seeds, {opts.seed}..{opts.seed + opts.seeds - 1}" if opts.seeds > 1 else \
                f"seed {opts.seed}"
            print(f"\nfrozen base vs base + adapter (toy world test split, adapters trained with {seeds}; retrieval R@k, "
                  "multi-positive any-true R@k and mAP, hard-negative accuracy, %):")
            print(table)
        long_table = (report.get("long_captions") or {}).get("markdown")
        if long_table:
            print(f"\nSmartCLIP on long captions (long-caption toy world's test split, {seeds}; the base reads 77 tokens, "
                  f"the fine-tuned column {LONG_CONTEXT}; %):")
            print(long_table)
        if report.get("served"):
            served = report["served"]
            print(f"the best adapter, {served['method']}, serving the test split ({served['images']} images; "
                  f"first 50 re-ranked by its own score):")
            print(served["table"])
            print(f"search it yourself: python -m serve.query {served['index']} \"...\" --rerank 50")
        say(f"done in {report['seconds']:.0f} s; reports in {opts.out}: demo_report.json, "
            "adapters/results.{json,md,png}" + (", long-captions/results.{json,md,png}" if opts.full else ""))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
