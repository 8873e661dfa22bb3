"""``python -m serve.query``: search an index directory for a text (images) or an image (captions), with the
model's own re-ranking, and print the hits as a table or JSON.

    python -m serve.query runs/index "a red cube left of a blue ball" --k 10 --rerank 100
    python -m serve.query runs/index --image photo.png --k 5 --json
    python -m serve.query runs/index "a red circle" --where image_id=00012 --where image_id=00013
    python -m serve.query runs/index "a red circle" --k 10 --offset 10          # the second page of ten
    python -m serve.query runs/index --vector query.npy --k 5        # a first-stage vector (.npy or a JSON list)

The model is the one the index was built with (``--model`` names another only to be refused if it differs).
Columns: the final rank, the rank the first stage gave (before re-ranking), the first-stage score, the re-ranked
score (with ``--rerank``), the hit's id and its image file or caption text; notes (a clamped ``--rerank``,
one a bare backbone ignores, a truncated query) follow the table, or sit in the JSON's ``notes``.
``--json`` prints one JSON object on stdout and nothing else (messages from loading the model go to stderr).

Bad input (an empty query, a corrupt image, ``--k 0``, a missing, half-written or tampered index, another
model) is one ``error:`` line and exit status 2; ``--debug`` (or PLUGVLM_DEBUG=1) shows the traceback instead.
Nothing is written anywhere.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Sequence

from extract.common.cli import Parser, build_parser as build_cli, check_options, option, parse_options, run_job
from extract.common.config import nonnegative_int, positive_int


@dataclass
class QueryOptions:
    """What ``python -m serve.query`` does, as data: ``query(QueryOptions(index="runs/index", query="a red
    circle", rerank=100))`` runs the same search as the command line and returns ``(searcher, hits)``."""

    index: str | None = option(None, positional=True, nargs="?",
                               help="index directory written by python -m serve.index")
    query: str | None = option(None, positional=True, nargs="?",
                               help="the text to search images for (leave out with --image)")
    image: str | None = option(None, metavar="PATH", help="an image file: search captions for it instead")
    vector: str | None = option(None, metavar="PATH",
                                help="a first-stage vector instead (the index's width; a .npy file, read without "
                                     "pickles, or a JSON list of numbers): the first stage alone, in --side")
    side: str = option("image", choices=["image", "text"],
                       help="with --vector: search the images (default) or the captions")
    k: int = option(10, type=positive_int, help="hits to print (at most the collection's size)")
    rerank: int | None = option(None, type=positive_int, metavar="K",
                                help="re-score the first K candidates with the model's own score (default: no "
                                     "re-ranking; a bare backbone has no second stage and ignores it, noted)")
    where: list = option(default_factory=list, action="append", metavar="COLUMN=VALUE",
                         help="keep hits whose metadata column (image.arrow / text.arrow) equals VALUE; repeat "
                              "a column for any of several values, different columns must all match")
    offset: int = option(0, type=nonnegative_int, help="skip this many hits first (paging: --offset 10 --k 10 is "
                                                       "the second page of ten)")
    json: bool = option(False, action="store_true", help="print the hits as one JSON object instead of a table")
    recall: bool = option(False, action="store_true",
                          help="instead of a query: R@1/5/10 of the served results on the indexed collection itself "
                               "(each caption searching the images, each image the captions), first stage and "
                               "re-ranked with K = 10, 50, 100, next to train.eval's figures on the same cache")
    live: bool = option(False, action="store_true",
                        help="with --recall: encode each query as a user's is (each caption and image file alone, "
                             "in fp32) instead of reading it from the cache, which holds them as extracted (fp16, "
                             "in batches): what serving answers (extract/README, \"Batch invariance\")")
    model: str | None = option(None, group="model",
                               help="the model to query with (default: the index's; one with other weights is "
                                    "refused, naming both)")
    pretrained: str | None = option(None, group="model", help="weights for --model: tag, checkpoint path or 'none'")
    annotations: str | None = option(None, group="model",
                                     help="boxes of image queries for adapters that read boxes: COCO instances, "
                                          "Visual Genome objects.json or a toy-world folder, naming the images by "
                                          "file name or id; given, they replace the detector of an adapter trained on "
                                          "detected boxes (default: the index's, else for adapters trained on "
                                          "ground-truth boxes the indexed toy world's)")
    detector: str | None = option(None, group="model",
                                  help="YOLO weights: detect boxes of query images instead (default: the index's "
                                       "box source)")
    device: str = option("cpu", group="model", help="torch device for encoding the query and re-ranking")
    debug: bool = option(False, action="store_true", help="show the traceback of an error (also PLUGVLM_DEBUG=1)")


def build_parser() -> Parser:
    return build_cli(QueryOptions, "python -m serve.query", __doc__)


def _check(ns) -> None:
    if not ns.index:
        raise ValueError("give the index directory (written by python -m serve.index) first")
    if ns.live and not ns.recall:
        raise ValueError("--live applies to --recall (how its queries are encoded)")
    if ns.recall:
        if ns.query is not None or ns.image is not None or ns.vector is not None:
            raise ValueError("--recall measures the index on its own collection: give no query, --image or --vector "
                             "with it")
        return
    if sum(x is not None for x in (ns.query, ns.image, ns.vector)) != 1:
        raise ValueError("give one of a text query, --image PATH or --vector PATH")


def load_vector(path: str):
    """The numbers of a ``--vector`` file: a .npy array (``allow_pickle=False``: never unpickle what a user hands
    us) or a JSON list; checked by :func:`serve.search.query_vector` (a QueryError says what is wrong)."""
    import json as json_

    import numpy as np

    from serve.search import QueryError, query_vector

    try:
        if str(path).endswith(".npy"):
            data = np.load(path, allow_pickle=False)
        else:
            with open(path, encoding="utf-8") as f:
                data = json_.load(f)
    except (OSError, ValueError) as e:
        raise QueryError(f"--vector {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__} (a .npy array "
                         "or a JSON list of numbers)") from None
    return query_vector(data)


def parse_args(argv: Sequence[str] | None = None) -> QueryOptions:
    return parse_options(QueryOptions, build_parser(), argv, check=_check)


def query(opts: QueryOptions):
    """Open the index and search (see the module docstring): ``(searcher, hits)``. The query itself (empty text,
    an unreadable image) and the filters are checked before the model loads, so those fail in milliseconds."""
    from extract.data.images import BadCaption, BadImage, decode_image, validate_caption
    from serve.layout import read_manifest
    from serve.search import MAX_QUERY_CHARS, QueryError, Searcher
    from serve.sides import parse_where

    check_options(opts, build_parser())
    if not opts.index:
        raise QueryError("give the index directory (written by python -m serve.index)")
    if sum(x is not None for x in (opts.query, opts.image, opts.vector)) != 1:
        raise QueryError("give one of a text query, --image PATH or --vector PATH")
    where = parse_where(opts.where) if opts.where else None
    vector = load_vector(opts.vector) if opts.vector is not None else None  # before the model loads
    if opts.query is not None and len(opts.query) > MAX_QUERY_CHARS:
        raise QueryError(f"query of {len(opts.query):,} characters refused: a search phrase has at most "
                         f"{MAX_QUERY_CHARS:,} (the model reads its first 77 or 248 tokens, a few hundred characters)")
    # the collection's size from the manifest, before the model loads: a --k beyond it is a mistake to say at once
    side = "images" if opts.query is not None or (vector is not None and opts.side == "image") else "captions"
    held = read_manifest(opts.index, verify="none")["collection"].get(side) or 0  # Searcher.open hashes
    if held and opts.k > held:
        raise QueryError(f"--k {opts.k} is more than the {held:,} {side} in the collection: ask for at most "
                         f"--k {held}")
    if opts.query is not None:
        try:
            validate_caption(opts.query)
        except BadCaption as e:
            raise QueryError("bad query: " + str(e).replace("caption", "query")) from None
    elif opts.image is not None:
        try:
            decode_image(opts.image)
        except BadImage as e:
            raise QueryError(f"query image {opts.image}: {e}") from None
    searcher = Searcher.open(opts.index, opts.model, pretrained=opts.pretrained, device=opts.device,
                             annotations=opts.annotations, detector=opts.detector)
    if vector is not None:
        if opts.rerank:
            raise QueryError("--rerank needs a text or an image: the model re-scores images against texts, not "
                             "vectors (a --vector search is the first stage alone)")
        return searcher, searcher.search_vector(vector, opts.side, k=opts.k, where=where, offset=opts.offset,
                                                query=f"vector {opts.vector}")
    search = searcher.search_text if opts.query is not None else searcher.search_image
    hits = search(opts.query if opts.query is not None else opts.image, k=opts.k, rerank=opts.rerank, where=where,
                  offset=opts.offset)
    return searcher, hits


RECALL_RERANKS = (10, 50, 100)


def recall(opts: QueryOptions) -> tuple[object, str]:
    """``--recall``: (searcher, the Markdown table of ``serve.recall.recall_table``): served R@k, first stage and
    re-ranked with each K of :data:`RECALL_RERANKS`, and the evaluation suite's retrieval figures computed from the
    index's feature cache (``adapters.eval.retrieval.run_retrieval_cached``: the same arrays, so with an exact index
    and K covering the collection the rows agree; a collection of several parts has no single cache and gets no
    evaluation row)."""
    from serve.recall import recall_table
    from serve.search import Searcher
    from adapters.eval.retrieval import run_retrieval_cached

    check_options(opts, build_parser())
    searcher = Searcher.open(opts.index, opts.model, pretrained=opts.pretrained, device=opts.device,
                             annotations=opts.annotations, detector=opts.detector)
    evaluation = None
    if len(searcher.manifest.get("parts") or [None]) == 1:
        from extract.cache import FeatureCache

        evaluation = run_retrieval_cached(searcher.scorer, FeatureCache.open(searcher.manifest["cache"]["path"]))
    return searcher, recall_table(searcher, RECALL_RERANKS, evaluation=evaluation,
                                  queries="live" if opts.live else "cache")


def as_json(searcher, hits) -> dict:
    """The JSON ``--json`` prints: the search (query, direction, k, rerank, offset, notes, hits) and the index."""
    return {**hits.to_dict(), "model": searcher.scorer.name, "index": str(searcher.index_dir),
            "collection": {"images": searcher.num_images, "captions": searcher.num_captions},
            "has_second_stage": searcher.has_second_stage}


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _shown_path(path: str | None) -> str:
    """A hit's image file as a person reads it: relative to the current folder when it lies inside it."""
    if not path:
        return ""
    import os

    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def table(searcher, hits) -> str:
    """The hits as an aligned text table, a title line above and the notes below."""
    images = hits.direction == "t2i"
    what = "images" if images else "captions"
    rerank = f"; first {hits.rerank} re-ranked" if hits.rerank else ""
    lines = [f"{what} for {_cut(hits.query, 80)!r} ({searcher.scorer.name}; {searcher.index_dir}: "
             f"{searcher.num_images} images, {searcher.num_captions} captions{rerank})"]
    heads = ["rank", "stage-1 rank", "stage-1 score"] + (["re-ranked score"] if hits.rerank else [])
    heads += ["image_id", "path"] if images else ["caption_id", "image_id", "text"]
    rows = []
    for h in hits:
        row = [str(h.rank_after), str(h.rank_before), f"{h.score:.4f}"]
        if hits.rerank:
            row.append(f"{h.rerank_score:.4f}")
        row += [h.id, _shown_path(h.path)] if images else [h.id, str(h.metadata.get("image_id", "")), _cut(h.text, 90)]
        rows.append(row)
    numeric = len(heads) - (2 if images else 3)  # right-aligned numbers, left-aligned ids and text
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    for row in [heads] + rows:
        cells = [c.rjust(w) if j < numeric else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    if not rows:
        lines.append(f"(no {what})")
    lines += [f"note: {n}" for n in hits.notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)

    def job(opts: QueryOptions) -> None:
        if opts.recall:
            searcher, markdown = recall(opts)
            entry = searcher.manifest["indexes"]["image"]
            print(f"served R@k of {opts.index} ({searcher.scorer.name}; {entry['key']}; {searcher.num_images} images, "
                  f"{searcher.num_captions} captions; each caption / image of the collection is a query, "
                  + ("encoded alone as a user's" if opts.live else "read from the cache") + "):")
            print(markdown, end="")
            return
        if opts.json:
            # stdout carries the JSON alone: what loading the model prints goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                searcher, hits = query(opts)
            print(json.dumps(as_json(searcher, hits), indent=2, default=str))
        else:
            searcher, hits = query(opts)
            print(table(searcher, hits))

    return run_job(job, opts, debug=opts.debug)


if __name__ == "__main__":
    raise SystemExit(main())
