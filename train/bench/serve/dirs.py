"""Index directories written as ``python -m serve.index`` writes them: the backbone's and a ComAlign head's."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from extract.common.cli import progress, say

from train.bench.serve.data import component_arrays, component_counts, shard_rows
from train.bench.serve.options import BenchmarkOptions
from train.bench.serve.timing import clock


def write_cache(root: Path, settings: dict, n: int, ids: list[str], arrays_of: Callable[[int, int], dict],
                desc: str):
    """A finished feature cache of ``n`` images (no captions) in extract's layout (fingerprinted folder,
    ``shard_size`` rows per shard, written with :class:`extract.cache.CacheDir`); reused when complete."""
    from extract.cache import CacheDir, FeatureCache

    cache_dir = CacheDir(root, settings)
    if not cache_dir.is_complete():
        cache_dir.prepare()
        size = shard_rows()
        shards = max(1, math.ceil(n / size))
        with progress(total=n, desc=desc, unit="img") as pbar:
            for s in range(shards):
                a, b = s * size, min(n, (s + 1) * size)
                arrays = dict(arrays_of(a, b), caption_image=np.zeros(0, np.int32))
                cache_dir.write_shard(s, arrays, {"images": b - a, "captions": 0, "image_ids": ids[a:b],
                                                  "caption_ids": []})
                pbar.update(b - a)
        cache_dir.write_manifest(shards, {"settings_summary": settings["summary"]})
    return FeatureCache(cache_dir.path)


def _image_table(ids: list[str]):
    """image.arrow of a collection without captions, with serve.index's columns (serve/__init__.py)."""
    import pyarrow as pa

    n = len(ids)
    empty = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.string()))
    return pa.table({"row": pa.array(np.arange(n, dtype=np.int64)), "image_id": pa.array(ids, pa.string()),
                     "path": pa.array([f"synthetic/{i}.jpg" for i in ids], pa.string()), "captions": empty,
                     "cache_row": pa.array(np.arange(n, dtype=np.int64)),
                     "part": pa.array(np.zeros(n, dtype=np.int32))})


def finish_index_dir(work, entry: dict, model: dict, cache, ids: list[str], opts: BenchmarkOptions,
                     started: float) -> dict:
    """image.arrow and manifest.json beside ``work``'s image.index, swapped into place as serve.index does."""
    from serve.index import library_versions, write_table
    from serve.layout import FORMAT, MANIFEST, METADATA_SUFFIX, VERSION

    write_table(_image_table(ids), work.file("image" + METADATA_SUFFIX))
    work.wrote("image" + METADATA_SUFFIX)
    data = {"spec": "synthetic", "split": None, "source": "train.bench.serve", "fingerprint": None}
    cache_entry = {"path": str(cache.path), "fingerprint": cache.fingerprint}
    n = len(ids)
    manifest = {
        "format": FORMAT, "version": VERSION, "model": model, "data": data, "cache": cache_entry,
        "parts": [{"data": data, "cache": cache_entry, "images": n, "captions": 0, "image_rows": [0, n],
                   "caption_rows": [0, 0]}],
        "collection": {"images": n, "captions": 0}, "indexes": {"image": entry}, "files": work.sizes(),
        "digests": work.digests(),
        "options": {"kind": "auto", "max_memory": opts.max_memory, "max_latency_ms": opts.max_latency_ms,
                    "min_recall": opts.min_recall, "ondisk": "auto"},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(time.perf_counter() - started, 3),
        "versions": library_versions()}
    work.write_json(MANIFEST, manifest)
    work.commit()
    return manifest


def model_entry(scorer, opts: BenchmarkOptions, kind: str, dim: int) -> dict:
    from serve.layout import model_fingerprint

    return {"model": opts.model, "pretrained": opts.pretrained, "kind": kind, "name": scorer.name,
            "fingerprint": model_fingerprint(scorer), "first_stage_dim": dim, "annotations": None, "detector": None}


def backbone_dir(out: Path, record: dict, auto: dict, vectors: np.ndarray, scorer, opts: BenchmarkOptions,
                 cache_root: Path, world_settings: dict) -> Path:
    """The largest N's auto index as serve.index writes the index directory of a bare backbone: the index built
    and tuned in section 1, its metadata, a manifest naming the model and a cache holding the vectors (fp16
    global embeddings, as ``python -m extract`` caches them)."""
    from serve.faiss_index import estimate_bytes, parse_memory
    from serve.layout import BuildDir

    started = time.perf_counter()
    n, d = vectors.shape
    ids = [f"{i:07d}" for i in range(n)]
    say(f"[{clock()}] writing the backbone index directory {out} ({record['key']}, N={n:,}) and its cache")
    cache = write_cache(cache_root, {"summary": f"train.bench.serve: {n:,} synthetic global embeddings",
                                     "backbone": scorer.backbone.describe(), "components": [], "data": world_settings},
                        n, ids, lambda a, b: {"image_embed": vectors[a:b].astype(np.float16)}, "backbone cache")
    from serve.faiss_index import kind_of, max_norm

    work = BuildDir(out)
    try:
        os.replace(record["file"], work.file("image.index"))
        work.wrote("image.index")
        entry = {"file": "image.index", "metadata": "image.arrow", "key": record["key"], "kind": kind_of(record["key"]),
                 "params": record["params"], "ntotal": n, "max_norm": max_norm(vectors),
                 "recall_at_10": record["tune_recall_at_10"],
                 "recall_queries": opts.queries, "queries": "held-out synthetic queries (t2i)",
                 "ms_per_query": record["tune_ms_per_query"], "tuning": record["ladder"],
                 "tried": [{"key": k} for k in auto["tried"]], "ondisk": False,
                 "bytes": work.file("image.index").stat().st_size, "build_seconds": round(record["build_seconds"], 3)}
        if record.get("refine_file"):  # exact re-scoring, as serve.index stores it
            os.replace(record["refine_file"], work.file("image.refine.npy"))
            work.wrote("image.refine.npy")
            entry["refine"] = {"file": "image.refine.npy", "dtype": "float16", "bytes": record["disk_bytes"]}
        if record["kind"].startswith("ivf") and estimate_bytes(record["key"], n, d) > parse_memory(opts.max_memory):
            say("  note: serve.index would keep these inverted lists on disk (.ivfdata); written as one file here")
        finish_index_dir(work, entry, model_entry(scorer, opts, "backbone", d), cache, ids, opts, started)
    except BaseException:
        work.discard()
        raise
    return out


def comalign_scorer(backbone, opts: BenchmarkOptions):
    """A ComAlign adapter at the backbone's shapes with its initial weights (the same arithmetic as a trained one),
    built as ``AdapterScorer.from_checkpoint`` builds one: head + frozen backbone + live extraction of text
    components (spaCy entities and relations, as the cache's)."""
    import torch

    from adapters.adapter_scorer import AdapterScorer, LiveExtractor
    from adapters.heads.comalign import ComAlign, ComAlignConfig

    entities, relations = component_counts()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)
        head = ComAlign(ComAlignConfig(), backbone.embed_dim).to(backbone.device).eval()
    args = {"base": opts.model, "pretrained": opts.pretrained, "components": ["entities", "relations"], "boxes": "gt",
            "max_entities": entities, "max_relations": relations}
    extractor = LiveExtractor(backbone, args, box_source="gt", annotations={})  # text queries only: no boxes needed
    return AdapterScorer(head, backbone, extractor, name=f"{opts.model} + comalign", meta={})


def comalign_dir(out: Path, scorer, vectors: np.ndarray, queries: np.ndarray, opts: BenchmarkOptions,
                 cache_root: Path, world_settings: dict) -> tuple[Path, dict]:
    """The re-ranking collection: a ComAlign feature cache of the first ``rows`` vectors (global embeddings plus
    entity / relation components), and its index directory built by serve.index's own ``write_vectors`` (first-stage
    vectors from the cache) and ``build_side`` (auto, tuned, recall), for the queries' ComAlign first stage."""
    from serve.index import IndexOptions, Part, build_side, finish_stage2, stage2_writer, write_vectors
    from serve.layout import BuildDir
    from serve.search import encode_arrays

    started = time.perf_counter()
    rows = min(len(vectors), opts.rerank_rows)
    entities, relations = component_counts()
    ids = [f"{i:07d}" for i in range(rows)]
    say(f"[{clock()}] writing the re-ranking collection: a ComAlign cache of {rows:,} items ({entities} entity + "
        f"{relations} relation components each) and its index directory {out}")

    def arrays_of(a: int, b: int) -> dict:
        return component_arrays(vectors[a:b], entities, relations, np.random.default_rng([opts.seed, 0xA11, a]),
                                "image")

    settings = {"summary": f"train.bench.serve: {rows:,} synthetic ComAlign items",
                "backbone": scorer.backbone.describe(), "components": ["entities", "relations"],
                "limits": {"entities": entities, "relations": relations}, "data": world_settings}
    cache = write_cache(cache_root, settings, rows, ids, arrays_of, "ComAlign cache")
    text = component_arrays(queries, entities, relations, np.random.default_rng([opts.seed, 0x7E1]), "text")
    query_vectors = np.ascontiguousarray(
        scorer.first_stage_text(encode_arrays(scorer, text, "text"), "t2i").float().cpu().numpy(), dtype=np.float32)
    work = BuildDir(out)
    try:
        index_opts = IndexOptions(kind="auto", max_memory=opts.max_memory, max_latency_ms=opts.max_latency_ms,
                                  min_recall=opts.min_recall, seed=opts.seed)
        store = stage2_writer(index_opts, scorer, work, "image", [Part(0, {}, cache)])
        first = write_vectors(work.scratch / "image.npy", [Part(0, {}, cache)], scorer, "image", "t2i", 256,
                              "ComAlign first-stage vectors", store)
        entry = build_side(index_opts, "image", first, query_vectors, "synthetic captions' components (t2i)", work)
        if store is not None:
            entry["stage2"] = finish_stage2(store, work, index_opts)
        dim = int(first.shape[1])
        del first
        finish_index_dir(work, entry, model_entry(scorer, opts, "adapter", dim), cache, ids, opts, started)
    except BaseException:
        work.discard()
        raise
    return out, text
