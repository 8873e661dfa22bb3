"""``python -m serve.index``: build the search index of a collection for a model, or add another source to one: its
first-stage vectors in FAISS, the items' metadata in Arrow tables and a manifest (the index directory that
serve/__init__.py describes).

The collection is anything ``python -m extract`` reads -- a folder of images (no captions: then only the image
index is built), a toy world (its ``--split``, default test), a CSV/TSV table, COCO JSON or webdataset shards. Its
features come from the feature cache (``--cache-dir``), built once with the model's own extraction settings (an
adapter: those in its checkpoint's description; a bare backbone: global embeddings only; a FILIP pre-trained
checkpoint: patch and token embeddings too) and reused by fingerprint afterwards, never recomputed. The first-stage
vectors are computed from the cached arrays: per image ``scorer.first_stage_image(reps, "t2i")``, per caption
``scorer.first_stage_text(reps, "i2t")`` (a bare backbone: its cached global embeddings, fp16 -> float32; FILIP:
the mean of the item's unit patch / token embeddings, an approximation of its late-interaction score, which
re-ranking then computes on the candidates), in batches of ``--batch-size``.

The FAISS index type follows ``--kind`` (``auto``: :func:`serve.faiss_index.auto_keys`, chosen from the number of
vectors and the ``--max-memory`` / ``--max-latency-ms`` budgets), tuned to the latency budget on real queries (an
image index: caption vectors of the collection; a text index: image vectors), with its recall@10 against exact
search recorded in the manifest; IVF indices larger than ``--max-memory`` (or any with ``--ondisk on``) keep their
inverted lists on disk, memory-mapped. The build writes into a temporary folder and swaps it into place, under a
lock (:mod:`serve.layout`): killed at any moment, it leaves the previous index whole; a second build of the same
folder refuses at once. ``--add`` appends another source's images (and captions) to an existing index -- its own
cache, vectors and metadata appended, FAISS ids continuing, no retraining -- and is refused when the model is not
the one the index was built with.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from extract.common.cli import Parser, check_options, option, parse_options, progress, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import fraction, nonnegative_int, positive_float, positive_int
from extract.options import DEFAULT_WORKERS
from extract.common.source_args import BoxOptions, SourceOptions, open_options, source_flags
from extract.worlds.toyworld import is_toyworld
from serve.faiss_index import KINDS, import_faiss, memory_size, parse_memory
from serve.layout import write_table as layout_write_table
from serve.layout import (FORMAT, MANIFEST, METADATA_SUFFIX, VERSION, BuildDir, IndexDirError, build_lock, check_alignment, check_model,
                          check_replaceable, model_fingerprint, read_manifest, read_table,
                          recover, remove_leftovers)


# --------------------------------------------------------------------------------------------- options
@dataclass
class IndexOptions(SourceOptions, BoxOptions):
    """What ``python -m serve.index`` does, as data: ``build_index(IndexOptions(model="tiny", data="toy",
    out="runs/index"))`` builds the same index as the command line with those flags."""

    model: str | None = option(None, help="backbone alias / open_clip name (with --pretrained), a pre-trained "
                                          "checkpoint, or an adapter checkpoint (RUN/adapter.safetensors or the run "
                                          "folder)")
    pretrained: str | None = option(None, help="weights for --model: tag, checkpoint path or 'none' (default: the "
                                               "alias's)")
    data: str | None = option(None, help="the collection: a folder of images, a toy world, CSV/TSV, COCO JSON or "
                                         ".tar shards (anything python -m extract reads; default: the embedded toy "
                                         "world, runs/toy, generated on first use)")
    out: str | None = option(None, help="the index folder: replaced atomically by a build, extended by --add "
                                        "(default: runs/index-<model>)")
    add: bool = option(False, action="store_true",
                       help="add the images (and captions) of --data to the existing index --out, without rebuilding "
                            "it (same model only)")
    verify: str | None = option(None, metavar="INDEX_DIR",
                                help="build nothing: check every file of the index INDEX_DIR against the SHA-256 its "
                                     "build recorded (opening an index checks the files up to 256 MiB; this checks "
                                     "them all) and exit 2 naming the first damaged one")
    split: str | None = option(None, group="data", help="toy world split (default: test; other sources have none)")
    image_root: str | None = option(None, group="data", help="CSV/COCO: folder relative image paths start from "
                                                             "(default: the file's folder)")
    kind: str = option("auto", choices=["auto", *KINDS], group="index",
                       help="FAISS index type; auto picks from the collection's size and the two budgets "
                            "(autofaiss's rules) and falls back to the next candidate below --min-recall")
    max_memory: str = option("4G", type=memory_size, group="index", help="memory budget of each index, e.g. 4G, 512M")
    max_latency_ms: float = option(5.0, type=positive_float, group="index",
                                   help="search budget per query (ms, one thread): nprobe / efSearch are tuned to it")
    min_recall: float = option(0.95, type=fraction, group="index",
                               help="auto: try the next candidate index when recall@10 at build stays below this")
    ondisk: str = option("auto", choices=["auto", "on", "off"], group="index",
                         help="IVF inverted lists in a memory-mapped .ivfdata file: auto = when the index exceeds "
                              "--max-memory")
    refine: str = option("auto", choices=["auto", "on", "off"], group="index",
                         help="re-score a product-quantised index's shortlist exactly from the vectors kept on disk "
                              "as fp16 (2 d bytes per vector, memory-mapped: RAM holds the PQ codes alone); auto: "
                              "for ivf-pq, whose recall@10 without it is ~0.2 at 1M vectors")
    stage2: str = option("auto", choices=["auto", "stored", "encoded"], group="index",
                         help="re-ranking reads the candidates' head representations stored in the index (stored: "
                              "fast, costs disk) or encodes them from the feature cache per query (encoded); auto: "
                              "stored when they fit --stage2-max-bytes")
    stage2_max_bytes: str = option("8G", type=memory_size, group="index",
                                   help="auto: the most disk the stored re-ranking representations may take")
    recall_queries: int = option(1000, type=positive_int, group="index",
                                 help="queries drawn from the collection to measure recall@10 and latency at build")
    cache_dir: str = option("runs/cache", group="run", help="feature caches (one sub-folder per settings fingerprint)")
    device: str | None = option(None, group="run", help="torch device (default: cuda when available, else cpu)")
    batch_size: int = option(256, type=positive_int, group="run",
                             help="images / captions per backbone batch and per first-stage batch")
    workers: int = option(DEFAULT_WORKERS, type=nonnegative_int, group="run",
                          help="image decoding processes for the extraction (default: half the CPU cores)")
    seed: int = option(0, type=nonnegative_int, group="run", help="seeds the training sample and the recall queries")
    ondisk_shard_rows: int = option(1_000_000, type=positive_int, group="run",
                                    help="on-disk IVF: vectors added per block before the blocks are merged")


def build_parser() -> Parser:
    return build_cli(IndexOptions, "python -m serve.index", __doc__)


def _required(ns) -> None:
    if ns.verify is not None:
        given = [f"--{k}" for k in ("model", "data", "out", "add") if getattr(ns, k)]
        if given:
            raise ValueError(f"--verify checks an index that exists; it takes no {', '.join(given)}")
        return
    if not ns.model:
        raise ValueError("--model is required, e.g. python -m serve.index --model tiny (a backbone alias, a "
                         "pre-trained checkpoint or an adapter run folder)")
    if ns.add and not (ns.data and ns.out):
        raise ValueError("--add needs --data (the source to add) and --out (the index it goes into)")


def default_out(model: str) -> str:
    """``runs/index-<model>`` for a model alias, or for a checkpoint its run folder's name (``runs/demo/adapters/
    comalign/adapter.safetensors`` -> ``runs/index-comalign``)."""
    from extract.common.run_dir import default_out as run_folder

    path = Path(model)
    if path.suffix == ".safetensors":
        path = path.parent
    name = path.name if path.exists() else model
    return str(run_folder("index", name))


def with_defaults(opts: IndexOptions) -> IndexOptions:
    """``opts`` with the embedded defaults filled in: no ``data`` -> the toy world (generated on first use, the
    path said), no ``out`` -> :func:`default_out`."""
    if opts.data is None:
        from extract.worlds import toyworld

        toyworld.ensure(toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED, say=say)
        opts = dataclasses.replace(opts, data=str(toyworld.DEFAULT_PATH))
    if opts.out is None:
        opts = dataclasses.replace(opts, out=default_out(opts.model))
        say(f"index folder: {opts.out} (--out to choose another)")
    return opts


def parse_args(argv: Sequence[str] | None = None) -> IndexOptions:
    return parse_options(IndexOptions, build_parser(), argv, _required)


# --------------------------------------------------------------------------------------------- the model
def _model_kind(opts: IndexOptions, scorer) -> str:
    from adapters.load import is_adapter_path, pretrained_checkpoint
    from extract.models.weights import checkpoint_sidecar

    weights = scorer.backbone.weights
    if getattr(scorer, "head", None) is not None:
        return "adapter"
    if pretrained_checkpoint(opts.model) or (weights.kind == "file" and checkpoint_sidecar(weights.path)):
        return "pretrain"
    return "adapter" if is_adapter_path(opts.model) else "backbone"


def load_model(opts: IndexOptions):
    """(scorer, the manifest's ``model`` entry) for ``opts.model``; refuses a scorer without first-stage vectors."""
    import torch

    from adapters.load import load_scorer

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the user's --annotations replace a detector the adapter was trained with; a toy world's own boxes do not
    annotations = opts.annotations or (opts.data if is_toyworld(opts.data) else None)
    scorer = load_scorer(opts.model, opts.pretrained, device=device, annotations=annotations, detector=opts.detector,
                         max_missing_boxes=opts.max_missing_boxes, use_annotations=bool(opts.annotations))
    if not (hasattr(scorer, "first_stage_image") and hasattr(scorer, "first_stage_text")):
        raise ValueError(f"{scorer.name} ({type(scorer).__name__}) gives no first-stage vectors (first_stage_image / "
                         "first_stage_text), so it cannot be searched with an index")
    _check_indexable(scorer)
    entry = {"model": opts.model, "pretrained": opts.pretrained, "kind": _model_kind(opts, scorer),
             "name": scorer.name, "fingerprint": model_fingerprint(scorer), "first_stage_dim": None,
             "annotations": opts.annotations, "detector": opts.detector,
             "boxes": getattr(scorer, "boxes_used", None)}  # which boxes were indexed (None: the model reads none)
    return scorer, entry


# --------------------------------------------------------------------------------------------- the cache
def extraction_options(opts: IndexOptions, scorer, data: str, split: str | None):
    """The ``python -m extract`` options of the collection's cache: an adapter's own extraction settings (its
    checkpoint's ``extraction.args``) for the new data, else the backbone's global embeddings plus the components
    the scorer reads (``scorer.cache_components``: none for a bare backbone, ``patches``, ``tokens`` for FILIP)."""
    from adapters.load import pretrained_checkpoint
    from extract.options import ExtractOptions

    run = {"data": str(data), "out": str(opts.cache_dir), "split": split, "image_root": opts.image_root,
           "device": str(scorer.device), "workers": opts.workers, "batch_size": opts.batch_size,
           "max_missing_boxes": opts.max_missing_boxes, **source_flags(opts)}
    meta = getattr(scorer, "meta", None) or {}
    if "extraction" in meta:
        names = {f.name for f in dataclasses.fields(ExtractOptions)}
        args = {k: v for k, v in meta["extraction"]["args"].items() if k in names}
        args.update(run)
        if opts.annotations:  # the user's boxes of this collection
            args["annotations"] = opts.annotations
        used = (getattr(scorer, "boxes_used", None) or {}).get("source")  # the boxes the scorer reads queries with
        if used and (opts.annotations or opts.detector):  # --detector, or --annotations in a trained detector's place
            args.update(boxes=used, detector=opts.detector)  # (None with --annotations: both at once are refused)
        return ExtractOptions(**args)
    ours = pretrained_checkpoint(opts.model) if opts.pretrained is None else None
    base, pretrained = ours or (opts.model, opts.pretrained)
    return ExtractOptions(base=base, pretrained=pretrained, components=list(getattr(scorer, "cache_components", ())),
                          **run)


def obtain_cache(opts: IndexOptions, scorer, data: str, split: str | None):
    """(the opened FeatureCache of the collection, its ExtractOptions): built, or reused by fingerprint."""
    from extract.cache import FeatureCache
    from extract.pipeline import run
    from serve.search import cache_keys

    ext = extraction_options(opts, scorer, data, split)
    manifest = run(ext, backbone=scorer.backbone)
    cache = FeatureCache.open(ext.out, fingerprint=manifest["fingerprint"])
    need = set(cache_keys(scorer, "image")) | set(cache_keys(scorer, "text") if cache.num_captions else ())
    missing = sorted(need - set(cache.keys))
    if missing:
        raise ValueError(f"cache {cache.path} lacks arrays {missing} that {scorer.name} reads")
    diff = scorer.cache_settings_diff(cache.settings) if hasattr(scorer, "cache_settings_diff") else []
    if diff:  # e.g. --detector boxes for a head trained on ground-truth ones: allowed, but said
        print(f"warning: {cache.path} was extracted with other settings than {scorer.name} was trained on "
              "(checkpoint's -> this cache's):\n  " + "\n  ".join(diff[:8]))
    return cache, ext


# --------------------------------------------------------------------------------------------- first-stage vectors
def _check_indexable(scorer) -> None:
    """Vectors come from the cache (``serve.search.cache_keys``: a bare backbone's global embeddings, an adapter's
    head arrays, FILIP's patch / token embeddings); refuse a model whose representations cannot be read from one."""
    from serve.search import cache_keys

    try:
        cache_keys(scorer, "image"), cache_keys(scorer, "text")
    except ValueError:
        raise ValueError(f"{scorer.name} ({type(scorer).__name__}) cannot be indexed: an index reads its vectors "
                         "from the feature cache (a bare backbone's global embeddings, an adapter's head arrays, "
                         "FILIP's patch and token embeddings), and this model reads none of them") from None


def first_stage(scorer, cache, side: str, rows: np.ndarray, direction: str, reps_out: list | None = None):
    """[len(rows), F] float32 first-stage vectors of cache rows (image rows for ``side`` "image", caption rows for
    "text") in ``direction``: ``first_stage_image`` / ``first_stage_text`` of the scorer's representations of the
    cached arrays (``serve.search.encode_arrays``: a bare backbone's cached global embeddings, an adapter's head
    representations, FILIP's unit patch / token embeddings, whose first stage is their mean -- an approximation of
    its score that re-ranking corrects). ``reps_out``: receives those representations (what stage 2 re-ranks with,
    :mod:`serve.stage2`)."""
    import torch

    from serve.search import cache_keys, encode_arrays

    arrays = {k: cache.gather(k, rows) for k in cache_keys(scorer, side)}
    with torch.no_grad():
        reps = encode_arrays(scorer, arrays, side)
        out = scorer.first_stage_image(reps, direction) if side == "image" else scorer.first_stage_text(reps, direction)
    if reps_out is not None:
        reps_out.append(reps)
    out = out.detach().float().cpu().numpy()
    if not np.isfinite(out).all():
        raise ValueError(f"{scorer.name} gave non-finite first-stage vectors for {side} rows of {cache.path}")
    return np.ascontiguousarray(out, dtype=np.float32)


def write_vectors(path: Path, parts: list, scorer, side: str, direction: str, batch: int, desc: str,
                  store=None):
    """All first-stage vectors of ``side`` over the collection's ``parts`` (their caches, in order) into a float32
    .npy memmap at ``path`` (bounded memory); None when there are none. ``store``: a
    :class:`serve.stage2.Stage2Writer` that receives the head's representations of the same rows."""
    counts = [p.cache.num_images if side == "image" else p.cache.num_captions for p in parts]
    total = sum(counts)
    if total == 0:
        return None
    out, row = None, 0
    with progress(total=total, desc=desc, unit="img" if side == "image" else "cap") as pbar:
        for part, count in zip(parts, counts):
            for a in range(0, count, batch):
                reps = [] if store is not None else None
                vec = first_stage(scorer, part.cache, side, np.arange(a, min(a + batch, count)), direction, reps)
                if store is not None:
                    store.add(reps[0])
                if out is None:
                    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(total, vec.shape[1]))
                out[row:row + len(vec)] = vec
                row += len(vec)
                pbar.update(len(vec))
    out.flush()
    return np.load(path, mmap_mode="r")


def stage2_writer(opts: IndexOptions, scorer, work: BuildDir, side: str, parts: list):
    """The :class:`serve.stage2.Stage2Writer` of ``side`` (None: nothing to store -- a bare backbone, whose first
    stage is its exact score, ``--stage2 encoded``, or a side without items)."""
    from serve.search import has_second_stage
    from serve.stage2 import Stage2Writer

    total = sum(p.cache.num_images if side == "image" else p.cache.num_captions for p in parts)
    if opts.stage2 == "encoded" or total == 0 or not has_second_stage(scorer):
        return None
    budget = parse_memory(opts.stage2_max_bytes) if opts.stage2 == "auto" else None
    return Stage2Writer(work.path, side, total, budget)


def finish_stage2(store, work: BuildDir, opts: IndexOptions) -> dict:
    """The manifest entry of a finished stage-2 store (its files flushed); said when it could not be stored."""
    entry, names = store.finish()
    for name in names:
        work.wrote(name)
    if entry["stored"]:
        say(f"  {store.side} re-ranking representations stored: {entry['bytes'] / 2**20:,.1f} MiB")
    elif opts.stage2 == "stored":
        raise ValueError(f"--stage2 stored: the {store.side} representations cannot be stored: {entry['reason']}")
    else:
        say(f"  {store.side} re-ranking encodes its candidates per query: {entry['reason']}")
    return entry


def query_vectors(parts: list, scorer, side: str, opts: IndexOptions, own) -> tuple[np.ndarray, str]:
    """Real queries of the ``side`` index for tuning and recall: a seeded sample of the other side's vectors in the
    query direction (an image index is searched by texts, "t2i"; a text index by images, "i2t"), or, without
    captions, of the collection's own image vectors."""
    other = "text" if side == "image" else "image"
    direction = "t2i" if side == "image" else "i2t"
    counts = [p.cache.num_images if other == "image" else p.cache.num_captions for p in parts]
    total = sum(counts)
    rng = np.random.default_rng([opts.seed, 0xC0DE, SIDES_INDEX[side]])
    if total == 0:
        pick = np.sort(rng.choice(len(own), min(opts.recall_queries, len(own)), replace=False))
        return np.ascontiguousarray(own[pick], dtype=np.float32), "images of the collection"
    pick = np.sort(rng.choice(total, min(opts.recall_queries, total), replace=False))
    found, start = [], 0
    for part, count in zip(parts, counts):
        local = pick[(pick >= start) & (pick < start + count)] - start
        for a in range(0, len(local), opts.batch_size):
            found.append(first_stage(scorer, part.cache, other, local[a:a + opts.batch_size], direction))
        start += count
    what = "captions of the collection (t2i)" if side == "image" else "images of the collection (i2t)"
    return np.concatenate(found), what


SIDES_INDEX = {"image": 1, "text": 2}


# --------------------------------------------------------------------------------------------- metadata
@dataclass
class Part:
    """One source of the collection: its cache and where its rows start."""

    number: int
    data: dict
    cache: object
    image_start: int = 0
    caption_start: int = 0

    def entry(self) -> dict:
        c = self.cache
        return {"data": self.data, "cache": {"path": str(Path(c.path).absolute()), "fingerprint": c.fingerprint},
                "images": c.num_images, "captions": c.num_captions,
                "image_rows": [self.image_start, self.image_start + c.num_images],
                "caption_rows": [self.caption_start, self.caption_start + c.num_captions]}


def _source_items(source, cache) -> tuple[dict[str, str], dict[str, str]]:
    """(image id -> file path or location, caption id -> text) for the items of ``cache``, from its source."""
    from extract.data.sources import IndexedSource, WebDatasetSource, expand_shards
    from extract.data.images import BadCaption, validate_caption

    paths, texts = {}, {}
    if isinstance(source, IndexedSource):
        for r in source.records():
            paths[r.image_id] = os.path.abspath(r.source)
            for c in r.captions:
                texts[c.id] = c.text
        return paths, texts
    assert isinstance(source, WebDatasetSource)
    # Streaming shards: the cache keeps ids, not texts; its shard k is input shard k (one per tar). The captions
    # are read back from the tar members without decoding any image, validated as extraction validated them.
    for shard in expand_shards(source.shards):
        reader = WebDatasetSource([shard], max_pixels=source.max_pixels, unusual=source.unusual)
        for key, files in reader.raw_samples(shard):
            paths[key] = f"{os.path.abspath(shard)}::{key}"
            for k, raw in enumerate(reader._raw_captions(key, paths[key], files)):
                try:
                    texts[f"{key}#{k}"] = validate_caption(raw)
                except BadCaption:
                    pass
    return paths, texts


def part_metadata(source, part: Part):
    """(image table, text table) of one part, as pyarrow Tables with the contract's columns (serve/__init__.py)."""
    import pyarrow as pa

    cache = part.cache
    paths, texts = _source_items(source, cache)
    image_ids, caption_ids = cache.image_ids(), cache.caption_ids()
    caption_image = cache.caption_image_index()
    captions: list[list[str]] = [[] for _ in image_ids]
    for cid, img in zip(caption_ids, caption_image.tolist()):
        captions[img].append(texts.get(cid, ""))
    n, m = len(image_ids), len(caption_ids)
    image = pa.table({
        "row": pa.array(np.arange(part.image_start, part.image_start + n, dtype=np.int64)),
        "image_id": pa.array(image_ids, pa.string()),
        "path": pa.array([paths.get(i, "") for i in image_ids], pa.string()),
        "captions": pa.array(captions, pa.list_(pa.string())),
        "cache_row": pa.array(np.arange(n, dtype=np.int64)),
        "part": pa.array(np.full(n, part.number, dtype=np.int32)),
    })
    text = pa.table({
        "row": pa.array(np.arange(part.caption_start, part.caption_start + m, dtype=np.int64)),
        "caption_id": pa.array(caption_ids, pa.string()),
        "text": pa.array([texts.get(c, "") for c in caption_ids], pa.string()),
        "image_row": pa.array(caption_image.astype(np.int64) + part.image_start),
        "image_id": pa.array([image_ids[i] for i in caption_image.tolist()], pa.string()),
        "cache_row": pa.array(np.arange(m, dtype=np.int64)),
        "part": pa.array(np.full(m, part.number, dtype=np.int32)),
    })
    return image, text


def _old_table(out: Path, old: dict, side: str):
    """The existing index's metadata of ``side`` (parquet in indices of format version 1), in the columns and types
    the new rows have, so the two concatenate."""
    from serve.layout import IMAGE_COLUMNS, TEXT_COLUMNS

    table = read_table(out / old["indexes"][side]["metadata"])
    return table.select(list(IMAGE_COLUMNS if side == "image" else TEXT_COLUMNS)).combine_chunks()


def write_table(table, path: Path) -> None:
    layout_write_table(table, path)


# --------------------------------------------------------------------------------------------- one side's index
def _ondisk(opts: IndexOptions, key: str, n: int, d: int) -> bool:
    from serve.faiss_index import estimate_bytes, kind_of

    if not kind_of(key).startswith("ivf"):
        if opts.ondisk == "on" and opts.kind != "auto":
            raise ValueError(f"--ondisk on needs an IVF index (--kind ivf-flat or ivf-pq), not {opts.kind}")
        return False
    if opts.ondisk == "auto":
        return estimate_bytes(key, n, d) > parse_memory(opts.max_memory)
    return opts.ondisk == "on"


def _candidates(opts: IndexOptions, vectors, queries) -> list[str]:
    from serve import faiss_index as fi

    n, d = vectors.shape
    budget = parse_memory(opts.max_memory)
    refined = opts.refine != "off"
    if opts.kind != "auto":
        return [fi.key_for_kind(opts.kind, n, d, budget, refined)]
    flat_ms = fi.flat_latency_ms(vectors, queries) if 4 * n * d <= budget and n >= fi.FLAT_THRESHOLD else None
    return fi.auto_keys(n, d, budget, flat_ms=flat_ms, max_latency_ms=opts.max_latency_ms, refined=refined)


def build_side(opts: IndexOptions, side: str, vectors, queries, query_source: str, work: BuildDir,
               old: dict | None = None, old_dir: Path | None = None) -> dict:
    """Build (or, with ``old``, the manifest entry of the existing index in ``old_dir``, extend) the ``side`` index
    over ``vectors`` into ``work``; returns its manifest entry."""
    from serve import faiss_index as fi

    faiss = import_faiss()
    started = time.perf_counter()
    n, d = vectors.shape
    name = f"{side}.index"
    exact = fi.exact_top(vectors, queries, fi.RECALL_K)  # once, whatever the number of candidates
    if old is not None:
        index, key, ondisk = _extend(opts, side, vectors, work, old, old_dir)
        tuned = fi.tune(index, key, vectors, queries, opts.max_latency_ms, say=say, exact=exact,
                        min_recall=opts.min_recall)
        tried = [*old.get("tried", []), {"key": key, "added": n - old["ntotal"], **_summary(tuned)}]
    else:
        index = key = tuned = None
        ondisk, tried = False, []
        candidates = _candidates(opts, vectors, queries)
        for k, cand in enumerate(candidates):
            t0 = time.perf_counter()
            cand_ondisk = _ondisk(opts, cand, n, d)
            say(f"{side} index: {cand} over {n:,} vectors of {d} dims" + (" (on disk)" if cand_ondisk else "")
                + (f", candidate {k + 1} of {len(candidates)}" if len(candidates) > 1 else ""))
            built = _fresh(opts, side, cand, vectors, work, k, cand_ondisk)
            result = fi.tune(built, cand, vectors, queries, opts.max_latency_ms, say=say, exact=exact,
                             min_recall=opts.min_recall)
            tried.append({"key": cand, **_summary(result), "build_seconds": round(time.perf_counter() - t0, 3)})
            better = tuned is None or (result["recall_at_10"] or 1.0) > (tuned["recall_at_10"] or 1.0)
            if better:
                index, key, tuned, ondisk = built, cand, result, cand_ondisk
            recall = result["recall_at_10"]
            if recall is None or recall >= opts.min_recall:
                break
            if k + 1 < len(candidates):
                say(f"{side} index: {cand} reaches recall@10 {recall:.3f} < --min-recall {opts.min_recall}; trying "
                    f"{candidates[k + 1]}")
            else:
                print(f"warning: the {side} index ({key}) reaches recall@10 {tuned['recall_at_10']:.3f} within "
                      f"{opts.max_latency_ms} ms per query, below --min-recall {opts.min_recall}: raise --max-memory "
                      "or --max-latency-ms for a better one")
    entry = {"file": name, "metadata": f"{side}{METADATA_SUFFIX}", "key": key, "kind": fi.kind_of(key),
             "params": tuned["params"], "ntotal": int(index.ntotal), "max_norm": fi.max_norm(vectors),
             "recall_at_10": tuned["recall_at_10"],
             "recall_queries": int(len(queries)), "queries": query_source, "ms_per_query": tuned["ms_per_query"],
             "tuning": tuned["ladder"], "tuning_rule": tuned.get("rule"),
             "best_recall_at_10": tuned.get("best_recall_at_10"), "tried": tried, "ondisk": bool(ondisk)}
    if isinstance(index, fi.Refined):
        entry["refine"] = {"file": f"{side}.refine.npy", "dtype": "float16", "bytes": index.vectors.nbytes}
        work.wrote(f"{side}.refine.npy")
        index = index.index  # FAISS writes the index; the vectors are their own file
    else:
        work.file(f"{side}.refine.npy").unlink(missing_ok=True)  # written for a PQ candidate that was not kept
    if ondisk:
        entry.update(ivfdata=f"{side}.ivfdata", trained=f"{side}.trained.index")
        src = work.scratch / f"candidate-{key_slug(key)}" / f"{side}.ivfdata"
        if src.exists():  # a fresh build: its lists were merged under scratch; the name stays (IO_FLAG_ONDISK_SAME_DIR)
            os.replace(src, work.file(f"{side}.ivfdata"))
            os.replace(src.parent / f"{side}.trained.index", work.file(f"{side}.trained.index"))
        work.wrote(f"{side}.ivfdata")
        work.wrote(f"{side}.trained.index")
    faiss.write_index(index, str(work.file(name)))
    work.wrote(name)
    entry["bytes"] = work.file(name).stat().st_size
    entry["build_seconds"] = round(time.perf_counter() - started, 3)
    return entry


def key_slug(key: str) -> str:
    return key.replace(",", "_")


def _summary(tuned: dict) -> dict:
    return {"params": tuned["params"], "recall_at_10": tuned["recall_at_10"], "ms_per_query": tuned["ms_per_query"]}


def refined(opts: IndexOptions, side: str, key: str, index, vectors, work: BuildDir):
    """``index`` with exact re-scoring (serve.faiss_index.Refined) when ``--refine`` asks for it for this key: its
    vectors written once per side as ``<side>.refine.npy`` (fp16) and memory-mapped; else ``index`` itself."""
    from serve import faiss_index as fi

    wanted = opts.refine == "on" or (opts.refine == "auto" and fi.kind_of(key) == "ivf-pq")
    if not wanted or fi.kind_of(key) == "flat":
        return index
    path = work.file(f"{side}.refine.npy")
    if not path.exists():
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=vectors.shape)
        for a in range(0, len(vectors), 65_536):
            out[a:a + 65_536] = np.asarray(vectors[a:a + 65_536], dtype=np.float32).astype(np.float16)
        out.flush()
        del out
    return fi.Refined(index, np.load(path, mmap_mode="r"))


def _fresh(opts: IndexOptions, side: str, key: str, vectors, work: BuildDir, k: int, ondisk: bool):
    from serve import faiss_index as fi

    faiss = import_faiss()
    with progress(total=len(vectors), desc=f"{side} index {key}", unit="vec") as pbar:
        if not ondisk:
            return refined(opts, side, key, fi.build(vectors, key, seed=opts.seed, pbar=pbar), vectors, work)
        folder = work.scratch / f"candidate-{key_slug(key)}"
        folder.mkdir(parents=True, exist_ok=True)
        trained = fi.train_index(vectors, key, opts.seed)
        faiss.write_index(trained, str(folder / f"{side}.trained.index"))
        return refined(opts, side, key, fi.fill_ondisk(trained, vectors, folder / f"{side}.ivfdata",
                                                       folder / "blocks", shard_rows=opts.ondisk_shard_rows,
                                                       pbar=pbar), vectors, work)


def _extend(opts: IndexOptions, side: str, vectors, work: BuildDir, old: dict, old_dir: Path):
    """--add: the existing index of ``side`` with the vectors after its ``ntotal`` appended (ids continue)."""
    from serve import faiss_index as fi

    faiss = import_faiss()
    start = old["ntotal"]
    new = vectors[start:]
    key = old["key"]
    say(f"{side} index: adding {len(new):,} vectors to {key} ({start:,} there)")
    with progress(total=len(new), desc=f"{side} index {key}", unit="vec") as pbar:
        if old.get("ondisk"):
            with fi.quiet_stdout():
                keep = faiss.read_index(str(old_dir / old["file"]),
                                        faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)
            trained = faiss.read_index(str(old_dir / old["trained"]))
            index = fi.fill_ondisk(trained, new, work.file(f"{side}.ivfdata"), work.scratch / f"{side}-blocks",
                                   shard_rows=opts.ondisk_shard_rows, start=start, keep=[keep], pbar=pbar)
            shutil.copyfile(old_dir / old["trained"], work.file(f"{side}.trained.index"))
            return refined(opts, side, key, index, vectors, work) if old.get("refine") else index, key, True
        index = faiss.read_index(str(old_dir / old["file"]))
        fi.add_vectors(index, new, pbar=pbar)
    return refined(opts, side, key, index, vectors, work) if old.get("refine") else index, key, False


# --------------------------------------------------------------------------------------------- the job
def library_versions() -> dict:
    import importlib.metadata

    out = {}
    for name, dist in (("plugvlm", "plugvlm"), ("faiss", "faiss-cpu"), ("pyarrow", "pyarrow"), ("torch", "torch"),
                       ("open_clip", "open_clip_torch")):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["faiss"] = out["faiss"] or getattr(import_faiss(), "__version__", None)
    return out


def _data_entry(spec: str, split: str | None, cache) -> dict:
    resolved = os.path.abspath(spec) if os.path.exists(spec) else spec
    data = cache.settings.get("data", {})
    return {"spec": resolved, "split": split, "source": data.get("source"), "fingerprint": data.get("sha256")}


def _split_for(opts: IndexOptions) -> str | None:
    if is_toyworld(opts.data):
        return opts.split or "test"
    if opts.split:
        raise ValueError(f"--split applies to toy worlds only; {opts.data} is another kind of source")
    return None


def _old_parts(manifest: dict, out: Path) -> list[Part]:
    """The existing index's parts with their caches opened (stage 2 reads them, and --add recomputes their vectors
    for the recall check): a missing cache is an error naming it."""
    from extract.cache import FeatureCache

    parts = []
    for k, p in enumerate(manifest.get("parts") or [{"data": manifest["data"], "cache": manifest["cache"]}]):
        try:
            cache = FeatureCache(p["cache"]["path"])
        except FileNotFoundError as e:
            raise IndexDirError(f"{out} reads its features from the cache {p['cache']['path']}, which is gone ({e}); "
                                "--add needs it: rebuild the index instead") from None
        if cache.fingerprint != p["cache"]["fingerprint"]:
            raise IndexDirError(f"the cache {cache.path} of {out} was rebuilt since (fingerprint {cache.fingerprint[:16]}, "
                                f"the manifest says {p['cache']['fingerprint'][:16]}): rebuild the index instead")
        start = p.get("image_rows", [0])[0], p.get("caption_rows", [0])[0]
        parts.append(Part(k, p["data"], cache, *start))
    return parts


def build_index(opts: IndexOptions) -> dict:
    """Build (or with ``opts.add`` extend) the index ``opts`` describe; returns the manifest written (module
    docstring; the directory's contract is in :mod:`serve`)."""
    check_options(opts, build_parser())
    _required(opts)
    return build_placed(with_defaults(opts))


def build_placed(opts: IndexOptions) -> dict:
    """:func:`build_index` of options already checked and placed (:func:`with_defaults`: ``data`` and ``out``
    set), as the command line has them."""
    out = Path(opts.out).absolute()
    started = time.perf_counter()
    recover(out)
    with build_lock(out):
        removed = remove_leftovers(out)
        if removed:
            say(f"removed {', '.join(removed)} left by a build that did not finish")
        old = None
        if opts.add:
            old = check_alignment(out, read_manifest(out))
        else:
            check_replaceable(out)
        return _build(opts, out, old, started)


def _build(opts: IndexOptions, out: Path, old: dict | None, started: float) -> dict:
    split = _split_for(opts)
    scorer, model = load_model(opts)
    say(f"model: {scorer.name} (fingerprint {model['fingerprint'][:16]})")
    if old is not None:
        check_model(old, model["fingerprint"], scorer.name, out)
        parts = _old_parts(old, out)
    else:
        parts = []
    cache, ext = obtain_cache(opts, scorer, opts.data, split)
    data = _data_entry(opts.data, split, cache)
    for p in parts:
        if p.cache.fingerprint == cache.fingerprint or p.data.get("fingerprint") == data["fingerprint"]:
            raise IndexDirError(f"{opts.data} is already in {out} (part {p.number}: {p.data.get('spec')}, same data "
                                "fingerprint): nothing to add")
    image_start = sum(p.cache.num_images for p in parts)
    caption_start = sum(p.cache.num_captions for p in parts)
    new = Part(len(parts), data, cache, image_start, caption_start)
    parts.append(new)
    if cache.num_images == 0:
        raise ValueError(f"{opts.data}: no image could be read (see {cache.path / 'report.json'}); nothing to index")

    from extract.data.sources import open_source

    work = BuildDir(out)
    try:
        # metadata first: cheap, and a source that cannot be read back fails before the vectors are computed
        import pyarrow as pa

        image_meta, text_meta = part_metadata(open_source(ext.data, **open_options(ext)), new)
        if old is not None:
            image_meta = pa.concat_tables([_old_table(out, old, "image"), image_meta])
            if "text" in old["indexes"]:
                text_meta = pa.concat_tables([_old_table(out, old, "text"), text_meta])
        stores = {side: stage2_writer(opts, scorer, work, side, parts) for side in ("image", "text")}
        vectors = {"image": write_vectors(work.scratch / "image.npy", parts, scorer, "image", "t2i", opts.batch_size,
                                          "first-stage image vectors", stores["image"]),
                   "text": write_vectors(work.scratch / "text.npy", parts, scorer, "text", "i2t", opts.batch_size,
                                         "first-stage caption vectors", stores["text"])}
        model["first_stage_dim"] = int(vectors["image"].shape[1])
        indexes = {}
        for side in ("image", "text"):
            if vectors[side] is None:
                continue
            queries, source = query_vectors(parts, scorer, side, opts, vectors[side])
            previous = (old or {}).get("indexes", {}).get(side)
            indexes[side] = build_side(opts, side, vectors[side], queries, source, work, previous, out)
            if stores[side] is not None:
                indexes[side]["stage2"] = finish_stage2(stores[side], work, opts)
            table = image_meta if side == "image" else text_meta
            write_table(table, work.file(f"{side}{METADATA_SUFFIX}"))
            work.wrote(f"{side}{METADATA_SUFFIX}")
        del vectors
        manifest = {
            "format": FORMAT, "version": VERSION, "model": model,
            "data": parts[0].data, "cache": parts[0].entry()["cache"], "parts": [p.entry() for p in parts],
            "collection": {"images": sum(p.cache.num_images for p in parts),
                           "captions": sum(p.cache.num_captions for p in parts)},
            "indexes": indexes, "files": work.sizes(), "digests": work.digests(),
            "options": {"kind": opts.kind, "max_memory": opts.max_memory, "max_latency_ms": opts.max_latency_ms,
                        "min_recall": opts.min_recall, "ondisk": opts.ondisk},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(time.perf_counter() - started, 3),
            "versions": library_versions(),
        }
        if old is not None:
            manifest["created_first"] = old.get("created_first", old.get("created"))
        work.write_json(MANIFEST, manifest)
        work.commit()
    except BaseException:
        work.discard()
        raise
    return manifest


def summary(manifest: dict, out: str) -> str:
    """The closing lines of a build."""
    c = manifest["collection"]
    lines = [f"index: {c['images']:,} images, {c['captions']:,} captions -> {out} ({manifest['build_seconds']:.1f} s)"]
    for side, e in manifest["indexes"].items():
        recall = "exact" if e["recall_at_10"] is None else f"recall@10 {e['recall_at_10']:.3f}"
        params = ", ".join(f"{k} {v}" for k, v in e["params"].items())
        lines.append(f"  {side}: {e['key']}{' (on disk)' if e['ondisk'] else ''}, {recall}"
                     + (f" at {params}" if params else "") + f", {e['ms_per_query']:.3f} ms/query")
    return "\n".join(lines)


def verify_index(index_dir: str | os.PathLike) -> dict[str, str]:
    """``--verify``: every file of the index checked against its recorded SHA-256, a line each (serve.layout.
    verify_files); the alignment of index, metadata and manifest checked too. Raises IndexDirError naming the first
    damaged file."""
    from serve.layout import verify_files

    started = time.perf_counter()
    manifest = read_manifest(index_dir, verify="none")
    say(f"verifying {index_dir}: {len(manifest.get('files') or {})} files, "
        f"{sum((manifest.get('files') or {}).values()):,} bytes")
    result = verify_files(index_dir, manifest, whole=True, say=say)  # first: a digest names the damaged file
    check_alignment(index_dir, manifest)
    unrecorded = [k for k, v in result.items() if v != "ok"]
    print(f"{index_dir}: {len(result) - len(unrecorded)} files match the SHA-256 their build recorded "
          f"({time.perf_counter() - started:.1f} s)" + (f"; {len(unrecorded)} built before whole-file digests were "
                                                         f"recorded, unchecked ({', '.join(unrecorded)}): rebuild "
                                                         "the index to have them checked" if unrecorded else ""))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: IndexOptions) -> None:
        if opts.verify is not None:
            verify_index(opts.verify)
            return
        opts = with_defaults(opts)  # parse_args checked them; placed once, here, so the summary names the folder
        print(summary(build_placed(opts), opts.out))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
