"""``python -m train.adapter.compare``: train every registered adapter method on the same data and backbone, then
write one side-by-side table: the frozen base vs base + each adapter (retrieval and per-type compositional
accuracy on the test split), through ``train.eval``.

    python -m extract.worlds.toyworld --out toy --n 2000 --seed 0
    python -m train.adapter.compare --data toy --out runs/compare --epochs 10
    python -m train.adapter.compare --data toy --out runs/compare --methods comalign,powerclip -- --lr 1e-4
    python -m train.adapter.compare --data toy --out runs/compare --seeds 3   # mean ± sd over 3 training seeds

Every method is trained by ``train.adapter``'s job (``train.adapter.train``) in ``OUT/<method>`` (its own logs,
checkpoint and history); the components of all methods are extracted into one shared cache (``--components`` =
their union), so the backbone runs over the data once for methods whose extraction options agree. Arguments after
``--`` are ``train.adapter`` flags for every run, parsed once (``train.adapter.options.parse_overrides``); every run's
settings are checked before the first one trains. Output: ``OUT/results.{json,md,png}`` (train.eval's report,
one column per model) and ``OUT/compare.json`` (per method: steps, training time, held-out metrics, fitted
inference parameters). Every adapter cell shows its difference from the frozen base with a 95% paired bootstrap
interval over the test images, ``*`` where the interval excludes 0 (``adapters.eval.bootstrap``). ``--seeds N`` trains each
adapter N times (seeds ``--seed`` .. ``--seed+N-1``, in ``OUT/<method>/seed-<s>``; the base, the data and the cache
stay the same): each cell is then mean ± sd over the seeds and the interval is that of the seed-averaged difference.

``--reference COLUMN`` compares every column with that one instead of the frozen base (a method, or a variant's
label): a fine-tune against its control, e.g. ``--variant "fine-tuned=powerclip --unfreeze" --variant "control=
powerclip --unfreeze --lam 0" --reference control``.

**Variants**: one more column for a method trained with other settings, e.g. ComAlign on detected or random boxes
next to its ground-truth ones: ``--variant "detector boxes=comalign --boxes yolo --detector best.pt"`` (repeatable;
``LABEL=METHOD`` then ``train.adapter`` flags, parsed as the flags after ``--`` are, and applied after them). The
column is ``<base> + <method> (<label>)`` and its runs go to ``OUT/<method>-<label as a slug>``.

From Python: ``compare(CompareOptions(data="toy", methods=["comalign"], overrides={"extract_batch_size": 64},
variants=[Variant("random boxes", "comalign", {"extract_options": {"boxes": "random"}})]))``.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from adapters.registry import ADAPTERS
from adapters.eval.bootstrap import DEFAULT_RESAMPLES
from extract.common.cli import Parser, check_options, from_namespace, option, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, parse_with_config, positive_int, save_config
from extract.common.source_args import SourceOptions

PROG = "python -m train.adapter.compare"


@dataclass(frozen=True)
class Variant:
    """One more column of the table: ``method`` trained with ``overrides`` (``train.adapter.options.AdapterOptions`` fields,
    as :attr:`CompareOptions.overrides`, applied after them; ``head_config`` / ``extract_options`` merge key by
    key), shown as ``<base> + <method> (<label>)``."""

    label: str
    method: str
    overrides: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Its name in compare.json and its run folder under OUT: ``<method>-<label as a slug>``."""
        return f"{self.method}-" + (re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-") or "variant")


def parse_variant(text: str) -> Variant:
    """``--variant "LABEL=METHOD [train.adapter flags]"`` as a :class:`Variant` (the flags through
    ``train.adapter.options.parse_overrides``, which exits with status 2 on a bad one)."""
    import shlex

    from train.adapter.options import parse_overrides

    label, sep, rest = str(text).partition("=")
    words = shlex.split(rest)
    if not sep or not label.strip() or not words:
        raise ValueError(f"--variant {text!r}: expected LABEL=METHOD [flags], e.g. "
                         "\"random boxes=comalign --boxes random\"")
    method = words[0]
    if method not in ADAPTERS.names():
        raise ValueError(f"--variant {text!r}: unknown method {method!r}; choose from {', '.join(ADAPTERS.names())}")
    return Variant(label.strip(), method, parse_overrides(words[1:], [method], prog=PROG) if words[1:] else {})


def merge_overrides(first: dict, then: dict) -> dict:
    """``first`` updated by ``then``; their ``head_config`` and ``extract_options`` dicts merge key by key."""
    out = {**first, **then}
    for nested in ("head_config", "extract_options"):
        if nested in first and nested in then:
            out[nested] = {**first[nested], **then[nested]}
    return out


@dataclass
class CompareOptions(SourceOptions):
    """What ``python -m train.adapter.compare`` does, as data. ``methods``: "all", a comma string or a list of
    registered names (a list after construction). ``overrides``: ``train.adapter.options.AdapterOptions`` fields set in
    every run (the command line's arguments after ``--``), e.g. ``{"lr": 1e-4, "head_config": {"dropout": 0.0},
    "extract_options": {"max_entities": 5}}``; they win over the fields this job sets."""

    data: str | None = option(None, help="training data, required (a toy-world folder gives train/val/test splits)")
    out: str = option("runs/compare", help="output folder: one run folder per method, the table, compare.json")
    methods: Any = option("all", help=f"comma list from {', '.join(ADAPTERS.names())}, all, or none (only the "
                                      "--variant columns)")
    base: str = option("tiny", help="backbone alias or open_clip model name")
    pretrained: str | None = option(None, help="tag, checkpoint path or 'none' (default: the alias's weights)")
    epochs: int = option(10, type=positive_int, help="training epochs of every adapter")
    batch_size: int = option(256, type=positive_int, help="contrastive batch of every adapter")
    val_data: str | None = option(None, help="held-out data (see python -m train.adapter)")
    test_data: str | None = option(None, help="data of the table (default: the toy world's test split, else "
                                              "--val-data)")
    benchmark: list = option(default_factory=list, action="append", metavar="NAME=PATH",
                             help="compositional benchmark of the table (repeatable)")
    image_root: str | None = option(None, help="folder relative image paths start from (CSV/COCO/benchmarks)")
    cache_dir: str | None = option(None, help="shared feature caches (default: OUT/cache)")
    eval_tasks: str = option("retrieval,compositional", help="train.eval tasks of the table")
    device: str | None = option(None, help="torch device (default: cuda when present, else cpu)")
    workers: int | None = option(None, type=nonnegative_int,
                                 help="extraction: image decoding processes (default: python -m extract's)")
    seed: int = option(0, type=nonnegative_int, help="training seed (the first one with --seeds)")
    seeds: int = option(1, type=positive_int,
                        help="train every adapter this many times, with seeds --seed .. --seed+N-1 (the base and the "
                             "data stay the same); the table shows mean ± sd over seeds and the bootstrap interval of "
                             "the seed-averaged difference from the base")
    bootstrap: int = option(DEFAULT_RESAMPLES, type=nonnegative_int,
                            help="bootstrap resamples of the test images for every interval (0: none)")
    reference: str | None = option(None, metavar="COLUMN",
                                   help="the column every other is compared with (paired intervals): a method or a "
                                        "variant's label (default: the frozen base), e.g. a fine-tune's control")
    variant: list = option(default_factory=list, action="append", metavar="LABEL=METHOD FLAGS",
                           help="one more column: METHOD trained with these train.adapter flags, shown as METHOD "
                                "(LABEL), e.g. \"random boxes=comalign --boxes random\" (repeatable)")
    overrides: dict = field(default_factory=dict)
    variants: list = field(default_factory=list)

    def __post_init__(self):
        names = ADAPTERS.names()
        methods = self.methods
        if isinstance(methods, str):
            named = {"all": names, "none": []}
            methods = named[methods] if methods in named else [m.strip() for m in methods.split(",") if m.strip()]
        self.methods = list(methods)
        self.variants = [*self.variants, *(parse_variant(v) for v in self.variant)]
        self.variant = []  # parsed into variants (once)
        unknown = [m for m in self.methods if m not in names]
        if unknown or not (self.methods or self.variants):
            raise ValueError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from "
                             f"{', '.join(names)} (none: only the --variant columns, at least one)")
        keys = [*self.methods, *(v.key for v in self.variants)]
        clash = sorted({k for k in keys if keys.count(k) > 1})
        if clash:
            raise ValueError(f"two columns would share the run folder {clash[0]!r}: give the variants other labels")
        if self.reference is not None and self.reference_key() is None:
            raise ValueError(f"--reference {self.reference!r}: no such column; the columns are the methods "
                             f"({', '.join(self.methods)}) and the variants' labels "
                             f"({', '.join(v.label for v in self.variants) or 'none'})")

    def reference_key(self) -> str | None:
        """The run folder key of ``reference`` (a method's name, a variant's label or key), None if it names none."""
        for v in self.variants:
            if self.reference in (v.label, v.key):
                return v.key
        return self.reference if self.reference in self.methods else None


def build_parser() -> Parser:
    return build_cli(CompareOptions, PROG, __doc__)


def parse_args(argv: Sequence[str] | None = None) -> CompareOptions:
    """The command line as CompareOptions; arguments after ``--`` become ``overrides``."""
    from train.adapter.options import parse_overrides

    argv = list(argv if argv is not None else sys.argv[1:])
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = build_parser()
    ns = parse_with_config(p, argv)
    if not ns.data:
        p.error("--data is required (a toy-world folder, CSV/TSV, COCO JSON or .tar shards)")
    try:
        opts = from_namespace(CompareOptions, ns)
    except ValueError as e:
        p.error(str(e))
    opts.overrides = parse_overrides(extra, opts.methods, prog=PROG) if extra else {}
    return opts


def run_folder(opts: CompareOptions, key: str, seed: int) -> Path:
    """``OUT/<key>`` (a method's name or a variant's key), or ``OUT/<key>/seed-<s>`` with ``--seeds`` > 1."""
    folder = Path(opts.out) / key
    return folder if opts.seeds == 1 else folder / f"seed-{seed}"


def columns(opts: CompareOptions) -> list[tuple[str, str, dict, str | None]]:
    """The adapter columns in table order: ``(key, method, overrides, label)``, the methods (label None) then the
    variants."""
    return [*((m, m, {}, None) for m in opts.methods),
            *((v.key, v.method, v.overrides, v.label) for v in opts.variants)]


def adapter_runs(opts: CompareOptions) -> list:
    """``(column key, resolved train.adapter.options.AdapterOptions)`` per column and seed (:func:`columns` in order, seeds
    ``seed`` .. ``seed + seeds - 1``): shared data, backbone, schedule and cache (with the union of the methods'
    components; the seed changes no extraction setting, so every seed reads the same cache), then
    ``opts.overrides``, then a variant's own. Raises ValueError (naming the column) when any run's settings are
    refused, before anything trains."""
    from train.adapter.options import AdapterOptions, resolve

    out = Path(opts.out)
    components = sorted({c for _, m, _, _ in columns(opts) for c in ADAPTERS.get(m).components})
    shared = dict(data=opts.data, base=opts.base, pretrained=opts.pretrained, epochs=opts.epochs,
                  batch_size=opts.batch_size, val_data=opts.val_data, image_root=opts.image_root,
                  cache_dir=opts.cache_dir or str(out / "cache"), components=components, device=opts.device,
                  workers=opts.workers, seed=opts.seed, final_eval=False,
                  **{f.name: getattr(opts, f.name) for f in dataclasses.fields(SourceOptions)})
    for what, given in [("overrides", opts.overrides), *((f"variant {v.label!r}", v.overrides) for v in opts.variants)]:
        own = sorted({"method", "out"} & set(given)) + (["seed"] if opts.seeds > 1 and "seed" in given else [])
        if own:  # every run would train that method, or into that folder, or with that seed
            raise ValueError(f"{what} may not set {', '.join(own)}: each run's comes from --methods, --variant, --out "
                             "and --seeds")
    runs = []
    for key, method, overrides, _ in columns(opts):
        for seed in range(opts.seed, opts.seed + opts.seeds):
            settings = merge_overrides(opts.overrides, overrides)
            try:
                runs.append((key, resolve(AdapterOptions(**{**shared, "method": method, "seed": seed,
                                                           "out": str(run_folder(opts, key, seed)), **settings}))))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
    return runs


def compare(opts: CompareOptions) -> dict:
    """Train every method of ``opts`` (``train.adapter.train``, ``--seeds`` times each) and evaluate the frozen base
    next to each adapter (``train.eval.evaluate.evaluate``: one column per method, the base first; every adapter cell
    shows its difference from the base with a paired bootstrap interval over the test images, ``*`` where it
    excludes 0). Returns ``{"methods": {name: steps, seconds, val, inference, checkpoint}, "table": OUT/results.md
    or None, "markdown": the table or None}`` (the table is not printed here); writes ``OUT/compare.json``,
    ``OUT/config.json`` and train.eval's reports.

    With ``seeds`` > 1 each method's entry also holds ``runs`` (one entry per seed, as above, with its ``seed``);
    its ``val`` is the mean over seeds of each held-out figure, ``steps`` / ``inference`` / ``checkpoint`` are those
    of its run with the best held-out T2I R@1 (what a caller serves), ``seconds`` the total. The table's cells are
    mean ± sd over seeds; the interval is that of the seed-averaged difference (``adapters.eval.bootstrap``)."""
    from train.adapter.engine import train
    from train.adapter.data import final_table_data
    from train.eval.evaluate import EvaluateOptions, evaluate

    check_options(opts, build_parser())
    if not opts.data:
        raise ValueError("data is required (a toy-world folder, CSV/TSV, COCO JSON or .tar shards)")
    runs = adapter_runs(opts)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.asdict(opts), out / "config.json")
    by_key: dict[str, list[dict]] = {}
    for key, run in runs:
        say(f"== {key} ==" if opts.seeds == 1 else f"== {key}, seed {run.seed} ==")
        started = time.perf_counter()
        summary = train(run)
        by_key.setdefault(key, []).append({
            "seed": run.seed, "steps": summary["steps"], "seconds": time.perf_counter() - started,
            "val": summary.get("val"), "inference": summary.get("inference"), "checkpoint": summary.get("adapter")})
    results = {key: _method_entry(entries) for key, entries in by_key.items()}
    test = final_table_data(opts)
    report = None
    if test:
        order = [(key, label) for key, _, _, label in columns(opts)]
        names = {key: "{name}" + (f" ({label})" if label else "") for key, label in order}
        ref = opts.reference_key()
        if ref is not None:  # the reference column first: train.eval compares every other column with the first
            order = [o for o in order if o[0] == ref] + [o for o in order if o[0] != ref]
        checkpoints = [e["checkpoint"] for key, _ in order for e in by_key[key]]
        models, base_at = [opts.base, *checkpoints], 0
        grouping = {}
        if opts.seeds > 1 or opts.variants or ref is not None:
            # one column per method, its runs averaged; with several seeds each run's results under "<name> seed <s>"
            cols = [names[key] for key, _ in order for _ in by_key[key]]
            labels = [names[key] + (f" seed {e['seed']}" if opts.seeds > 1 else "") for key, _ in order
                      for e in by_key[key]]
            cols, labels = ["{name}", *cols], ["{name}", *labels]
            if ref is not None:  # the frozen base after the reference's runs
                n = len(by_key[ref])
                models, base_at = [*checkpoints[:n], opts.base, *checkpoints[n:]], n
                cols = [*cols[1:n + 1], cols[0], *cols[n + 1:]]
                labels = [*labels[1:n + 1], labels[0], *labels[n + 1:]]
            grouping = dict(columns=cols, result_labels=labels)
        report = evaluate(EvaluateOptions(
            model=models,
            pretrained=[opts.pretrained if k == base_at else None for k in range(len(models))],
            tasks=opts.eval_tasks, out=str(out),
            seed=opts.seed, device=opts.device, bootstrap=opts.bootstrap, **grouping, **test))
    else:
        say("note: no test data (--test-data or a toy world): no table")
    result = {"methods": results, "table": str(out / "results.md") if report else None}
    (out / "compare.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return {**result, "markdown": report["markdown"] if report else None,
            "reports": report["reports"] if report else []}


def _method_entry(runs: list[dict]) -> dict:
    """compare.json's entry of one method (see :func:`compare`): its only run, or the summary of its seeds."""
    if len(runs) == 1:
        return {k: v for k, v in runs[0].items() if k != "seed"}
    scored = [r for r in runs if "retrieval T2I R@1" in (r.get("val") or {})]
    best = max(scored, key=lambda r: r["val"]["retrieval T2I R@1"]) if scored else runs[0]
    keys = [k for k in (runs[0].get("val") or {}) if all(k in (r.get("val") or {}) for r in runs)]
    val = {k: sum(r["val"][k] for r in runs) / len(runs) for k in keys} if keys else None
    return {"steps": best["steps"], "seconds": sum(r["seconds"] for r in runs), "val": val,
            "inference": best["inference"], "checkpoint": best["checkpoint"], "best_seed": best["seed"], "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: CompareOptions) -> None:
        result = compare(opts)
        if result["markdown"]:
            print(result["markdown"])
            say("reports: " + ", ".join(result["reports"]))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
