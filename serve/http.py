"""The HTTP side of ``python -m serve``: one FastAPI app with the Gradio page (serve.app) mounted at ``/`` and a JSON
back-end compatible with clip-retrieval's ``clip_back``, so a program written for clip-retrieval works unchanged.

Routes (clip-retrieval's first, same request and response shapes):

``POST /knn-service``
    Request fields as clip_back reads them: ``text``, ``image`` (base64; a ``data:`` URL is accepted too),
    ``image_url``, ``embedding_input`` (a first-stage vector, the index's width), ``modality`` ("image": search the
    images, "text": the captions; default "image"), ``indice_name`` (one of /indices-list; null: the served one),
    ``num_images`` (results that carry metadata, default 40), ``num_result_ids`` (ids searched for, default
    ``num_images``), ``deduplicate`` (drop results whose stored vectors have cosine >= 0.94 with a better one,
    connected components as clip_back), ``use_mclip``, ``use_safety_model``, ``use_violence_detector``,
    ``aesthetic_score``, ``aesthetic_weight``. The query is the first non-empty of text, image / image_url,
    embedding_input (clip_back's order). Response: a JSON list, best first, of ``{"id": row, "similarity": score,
    "caption", "url", "image_id", ...}`` -- metadata only on the first ``num_images`` results, as clip_back.
    ``url`` is ``/images/<row>`` on this server (the collection's file), ``caption`` an image's first caption or
    the caption hit's text. No answer holds a file path of the server unless it was started with ``--show-paths``
    (``image_path``, as clip_back: for a trusted local setup): every JSON answer, errors and the notes header
    included, goes through ``Served.public`` (serve.redact). An ``embedding_input`` with no direction (all zeros,
    or a float32 norm that underflows to 0), a NaN, an infinity or a number beyond float32's range is a 400 that
    says so (``serve.search.query_vector``), checked before any cast, so it leaves nothing in the server's log.

    Extensions (absent = clip-retrieval's behaviour): ``rerank`` (true: the first ``k_candidates`` first-stage
    candidates are re-scored by the model's own score, ``similarity`` is that score), ``k_candidates`` (default
    ``max(num_result_ids, 50)``), ``where`` (a metadata filter ``{"column": value or [values]}`` on image.arrow /
    text.arrow columns), ``offset`` (paging), ``return_image`` (true: each result with metadata also carries
    ``image``, its file in base64, which clip_back adds whenever its metadata has ``image_path``). Every result
    also has ``first_stage_similarity``, ``rerank_similarity`` (null without re-ranking), ``rank_before`` /
    ``rank_after`` and the ids (``image_id``, ``caption_id``); a query image the model has no ground-truth boxes for
    (an upload its annotations do not name, for a model that reads them) is searched by the first stage only, not
    re-ranked, and every result carries ``box_note``: why, and how to give the server boxes (``--annotations FILE`` /
    ``--detector WEIGHTS.pt``). Per-stage timings come back in the standard
    ``Server-Timing`` header (``encode;dur=3.1, first_stage;dur=0.2, rerank;dur=4.0, ...`` in ms) and the notes
    (a clamped k, an option not applied) in ``X-Plugvlm-Notes`` (a JSON list).

    What differs, on purpose: no URL is ever fetched (``image_url`` is refused with a message saying to send the
    image in base64; clip_back downloads it), nothing is downloaded at start-up (clip_back fetches its safety
    model, violence detector and aesthetic embeddings: none is served here, so those options are accepted and
    not applied, each with a note, as clip_back ignores them when it was started without them), ``use_mclip`` is
    refused (no multilingual model), and an error is HTTP 400 / 503 with ``{"error": "..."}``, not a traceback.
``GET /indices-list``
    The served index's name (its folder's name), in a list.
``POST /metadata``
    ``{"ids": [...], "indice_name": ...}`` -> ``[{"id": id, "metadata": {...}}]`` for image rows (extension:
    ``"modality": "text"`` for caption rows).
``GET /images/<row>``
    The collection's image file of that row (the ``url`` of results); nothing else of the disk is reachable.
``GET /health``
    ``{"status": "ok", "pid", "rss_bytes", "uptime_s", "in_flight", "busy_refusals", "served": {...}}`` (the index
    folder in ``served`` only with ``--show-paths``).

Safety: request bodies are refused above the upload limit (HTTP 413), model work goes through the app's
:class:`serve.service.Gate` (HTTP 503 when busy, with Retry-After), Gradio's own URL-fetching routes (``/file=http...``,
``/proxy=``) are refused (403) and its file route serves nothing of the collection directly (no ``allowed_paths``):
a file outside Gradio's upload and cache folders asked for through it is refused with 403.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import math
import os
import re
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request  # module level: FastAPI resolves the routes' annotations here

from extract.common.memory import rss_bytes
from serve.service import DEFAULT_CANDIDATES, Busy, QueryImage, Served, box_note, decode_checked, encode_image
from serve.request_guard import RequestGuard

#: clip_back's de-duplication threshold: results whose normalised vectors have inner product >= this are one
DEDUP_THRESHOLD = 0.94
#: bytes a request body may hold beyond the base64 of the largest upload (the JSON around it)
BODY_SLACK = 1 << 20
#: clip_back's request fields, which are accepted; anything else is refused by name (a typo is not silently ignored)
CLIP_FIELDS = ("text", "image", "image_url", "embedding_input", "modality", "indice_name", "num_images",
               "num_result_ids", "deduplicate", "use_mclip", "use_safety_model", "use_violence_detector",
               "aesthetic_score", "aesthetic_weight", "verbose")
EXTENSIONS = ("rerank", "k_candidates", "where", "offset", "return_image")
#: clip_back's options that need models it downloads; accepted here and not applied (each noted)
NOT_SERVED = {"use_safety_model": "no safety model is served", "use_violence_detector": "no violence detector is "
              "served", "aesthetic_score": "no aesthetic embeddings are served"}


class RequestError(ValueError):
    """A request that cannot be answered as asked (HTTP 400)."""


# --------------------------------------------------------------------------------------------- /knn-service
@dataclass
class KnnRequest:
    """A /knn-service request, checked (module docstring)."""

    text: str | None = None
    image: bytes | None = None
    embedding: list | None = None
    modality: str = "image"
    num_images: int = 40
    num_result_ids: int = 40
    deduplicate: bool = False
    rerank: bool = False
    k_candidates: int | None = None
    where: dict | None = None
    offset: int = 0
    return_image: bool = False
    notes: tuple[str, ...] = ()


def _present(value) -> bool:
    return value is not None and value != "" and value != []


def _int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    # JSON's Infinity / NaN / 1e400 arrive as floats that int() cannot take: refused here, by name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and (
            not math.isfinite(value) or not value.is_integer())):
        raise RequestError(f"{name} must be a whole number, got {_shown(value)}")
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be between {lo} and {hi}, got {_shown(value)}")
    return int(value)


def _name(field: str) -> str:
    """A field name a client sent, as it is when plain, quoted and escaped otherwise."""
    return field if re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", field) else _shown(field, 40)


def _shown(value, limit: int = 80) -> str:
    """A client's value for a message: JSON (Infinity, NaN, escaped lone surrogates), cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=True) if isinstance(value, (int, float, str)) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


def parse_knn(body: Any, served: Served, index_names: list[str]) -> KnnRequest:
    """Check a /knn-service body (a decoded JSON object) against clip_back's fields and ours."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with a text, image or embedding_input field")
    unknown = sorted(set(body) - set(CLIP_FIELDS) - set(EXTENSIONS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(_name(u) for u in unknown[:5])}; fields: "
                           f"{', '.join(CLIP_FIELDS + EXTENSIONS)}")
    name = body.get("indice_name")
    if name is not None and name not in index_names:
        raise RequestError(f"indice_name {_shown(name)} is not served here; /indices-list: {index_names}")
    modality = body.get("modality") or "image"
    if modality not in ("image", "text"):
        raise RequestError(f"modality must be 'image' or 'text', got {_shown(modality)}")
    if modality == "text" and served.searcher.num_captions == 0:
        raise RequestError("modality 'text' searches captions, and this collection has none")
    if body.get("use_mclip"):
        raise RequestError("use_mclip: no multilingual text model is served here; send the query in English with "
                           "use_mclip false")
    limit = served.limits.max_results
    num_images = _int(body, "num_images", 40, 1, limit)
    req = KnnRequest(modality=modality, num_images=num_images,
                     num_result_ids=_int(body, "num_result_ids", num_images, 1, limit),
                     deduplicate=_bool(body, "deduplicate"), rerank=_bool(body, "rerank"),
                     k_candidates=(None if body.get("k_candidates") is None
                                   else _int(body, "k_candidates", 0, 1, limit)),
                     offset=_int(body, "offset", 0, 0, max(served.searcher.num_images, served.searcher.num_captions)),
                     return_image=_bool(body, "return_image"))
    where = body.get("where")
    if where is not None and not isinstance(where, dict):
        raise RequestError(f"where must be an object {{column: value or [values]}}, got {type(where).__name__}")
    req.where = where or None
    notes = [f"{k}: {why}; not applied" for k, why in NOT_SERVED.items() if body.get(k) not in (None, False, "")]
    text, image, url, embedding = (body.get(k) for k in ("text", "image", "image_url", "embedding_input"))
    if _present(text):  # clip_back's order: text, then image / image_url, then embedding_input
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}")
        req.text = text
    elif _present(image):
        req.image = _base64_image(image, served.limits.max_upload_bytes)
    elif _present(url):
        raise RequestError("image_url: this server fetches no URLs; download the image yourself and send its bytes "
                           "in base64 as \"image\"")
    elif _present(embedding):
        if not isinstance(embedding, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in embedding):
            raise RequestError("embedding_input must be a list of numbers")
        req.embedding = embedding
    else:
        raise RequestError("give one of text, image (base64) or embedding_input")
    if sum(_present(v) for v in (text, image, url, embedding)) > 1:
        notes.append("several queries given: searched with the first of text, image, embedding_input (clip_back's "
                     "order)")
    req.notes = tuple(notes)
    return req


def _base64_image(value, max_bytes: int) -> bytes:
    if not isinstance(value, str):
        raise RequestError(f"image must be a base64 string, got {type(value).__name__}")
    if value.startswith("data:") and "," in value:
        value = value.split(",", 1)[1]
    value = re.sub(r"\s+", "", value)
    if len(value) > 4 * math.ceil(max_bytes / 3):
        raise RequestError(f"image: more than the {max_bytes:,} bytes an image may have")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("image: not valid base64") from None


def knn_service(served: Served, req: KnnRequest, base_url: str = "/") -> tuple[list[dict], dict, list[str]]:
    """Answer a checked /knn-service request: (results as clip_back gives them, timings in ms, notes)."""
    searcher = served.searcher
    notes = list(req.notes)
    started = time.perf_counter()
    k = req.num_result_ids
    side = req.modality
    if req.rerank:
        # at least the page asked for (the search raises K to offset + k anyway, with a note), within the limit
        candidates = req.k_candidates or min(max(req.offset + k, DEFAULT_CANDIDATES), served.limits.max_results)
    else:
        candidates = None
        if req.k_candidates is not None:
            notes.append("k_candidates applies with rerank: true; not re-ranked")
    if req.text is not None and side == "image":
        hits = served.text_to_image(req.text, k, candidates, where=req.where, offset=req.offset)
    elif req.image is not None and side == "text":
        image = _request_image(served, req.image)
        hits = served.image_to_text(image, k, candidates, where=req.where, offset=req.offset)
    else:
        # a same-modality query (images like an image, captions like a text) or a raw vector: the first stage
        # alone, in the vectors the index holds for that side (serve/__init__.py)
        if candidates is not None:
            notes.append("rerank: the model re-scores images against texts; a same-modality or embedding_input "
                         "query is searched by the first stage only")
        vector, query, encode_ms, boxes = _query_vector(served, req, side)
        with served.gate.hold():
            hits = searcher.search_vector(vector, side, k, where=req.where, offset=req.offset, query=query)
        if encode_ms is not None:
            hits.timings = {"encode": encode_ms, **hits.timings}
        hits.box_note = boxes
        hits.notes += [boxes] if boxes else []
    notes += hits.notes
    boxes = hits.box_note
    timings = dict(hits.timings)
    t0 = time.perf_counter()
    hits = list(hits)
    if req.deduplicate and hits:
        kept, why = deduplicate(served, side, hits)
        if why:
            notes.append(why)
        hits = kept
        timings["dedup"] = round((time.perf_counter() - t0) * 1000, 3)
    t0 = time.perf_counter()
    results = [_result(served, h, j < req.num_images, base_url, req.return_image) for j, h in enumerate(hits)]
    if boxes:
        for r in results:
            r["box_note"] = boxes
    timings["results"] = round((time.perf_counter() - t0) * 1000, 3)
    timings["total"] = round((time.perf_counter() - started) * 1000, 3)
    return results, timings, notes


def _request_image(served: Served, data: bytes) -> QueryImage:
    decoded = decode_checked(data, served.limits.max_pixels, "image")
    return QueryImage(decoded.image, "query", None, decoded.note)


def _query_vector(served: Served, req: KnnRequest, side: str):
    """(first-stage vector of the query in ``side``'s space, its name, encoding ms or None, serve.service.box_note
    for a query image the model has no boxes for, or None)."""
    import torch

    if req.embedding is not None:
        return req.embedding, f"embedding_input ({len(req.embedding)} numbers)", None, None
    scorer = served.searcher.scorer
    started = time.perf_counter()
    note = None
    with served.gate.hold(), torch.no_grad():
        if req.text is not None:  # captions like a text: the text's vector as text.index holds captions'
            text, _ = served.searcher.check_text(req.text)
            vector = scorer.first_stage_text(scorer.encode_texts([text]), "i2t")
            name = text
        else:  # images like an image: its vector as image.index holds images'
            image = _request_image(served, req.image)
            note = box_note(scorer, image, "its first-stage vector was computed without them")
            vector = scorer.first_stage_image(encode_image(scorer, image), "t2i")
            name = "image"
    return vector.float().cpu().numpy()[0], name, round((time.perf_counter() - started) * 1000, 3), note


def deduplicate(served: Served, side: str, hits: list) -> tuple[list, str | None]:
    """clip_back's de-duplication: results whose stored vectors (normalised) have inner product >= DEDUP_THRESHOLD
    form connected components, and only the best-ranked of each stays. (hits kept, a note when it could not run)."""
    index = served.searcher.collection(side).index
    rows = np.asarray([h.row for h in hits], dtype=np.int64)
    try:
        vectors = np.asarray(index.reconstruct_batch(rows), dtype=np.float32)
    except RuntimeError:
        return hits, "deduplicate: this index cannot give its vectors back (IVF without a direct map); not applied"
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = vectors / np.where(norms == 0, 1, norms)
    close = (vectors @ vectors.T) >= DEDUP_THRESHOLD
    parent = list(range(len(hits)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in zip(*np.nonzero(np.triu(close, 1))):
        a, b = root(int(i)), root(int(j))
        if a != b:
            parent[max(a, b)] = min(a, b)  # the component keeps its best-ranked member
    return [h for i, h in enumerate(hits) if root(i) == i], None


def _result(served: Served, hit, with_metadata: bool, base_url: str, return_image: bool) -> dict:
    out: dict[str, Any] = {"id": hit.row, "similarity": hit.final_score}
    if with_metadata:
        image_row = hit.row if hit.kind == "image" else int(hit.metadata["image_row"])
        caption = hit.text if hit.kind == "text" else next(iter(hit.metadata.get("captions") or []), "")
        out.update(caption=caption, url=f"{base_url.rstrip('/')}/images/{image_row}",
                   image_id=str(hit.metadata.get("image_id", "")))
        if served.limits.show_paths:  # the server's folder layout, only where the operator asked (--show-paths)
            out["image_path"] = hit.path
        if hit.kind == "text":
            out["caption_id"] = hit.id
        if return_image and hit.path:
            with open(hit.path, "rb") as f:
                out["image"] = base64.b64encode(f.read()).decode("ascii")
    out.update(first_stage_similarity=hit.score, rerank_similarity=hit.rerank_score, rank_before=hit.rank_before,
               rank_after=hit.rank_after)
    return out


def metadata_service(served: Served, body: Any, index_names: list[str], base_url: str = "/") -> list[dict]:
    """/metadata: ``[{"id": id, "metadata": {...}}]`` for the rows ``body["ids"]`` (image rows; caption rows with
    ``"modality": "text"``)."""
    if not isinstance(body, dict) or not isinstance(body.get("ids"), list):
        raise RequestError("the request body must be {\"ids\": [row, ...], \"indice_name\": ...}")
    if body.get("indice_name") is not None and body["indice_name"] not in index_names:
        raise RequestError(f"indice_name {_shown(body['indice_name'])} is not served here; /indices-list: "
                           f"{index_names}")
    side = body.get("modality") or "image"
    if side not in ("image", "text") or (side == "text" and served.searcher.num_captions == 0):
        raise RequestError(f"modality must be 'image' or 'text' (with captions), got {_shown(side)}")
    ids = body["ids"]
    if len(ids) > served.limits.max_results:
        raise RequestError(f"at most {served.limits.max_results} ids per request, got {len(ids)}")
    collection = served.searcher.collection(side)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < collection.n]
    if bad:
        raise RequestError(f"ids must be rows 0..{collection.n - 1} of the {side} index, got "
                           f"{', '.join(_shown(i, 20) for i in bad[:5])}")
    images = served.searcher.collection("image")
    out = []
    for row, meta in zip(ids, collection.rows(ids)):
        image_row = row if side == "image" else int(meta["image_row"])
        path = str(images.column("path")[image_row])
        caption = meta.get("text") if side == "text" else next(iter(meta.get("captions") or []), "")
        entry = {"caption": caption, "url": f"{base_url.rstrip('/')}/images/{image_row}",
                 **{k: v for k, v in meta.items() if k != "path"}}
        if served.limits.show_paths:
            entry["image_path"] = path
        out.append({"id": row, "metadata": entry})
    return out


# --------------------------------------------------------------------------------------------- the app
def create_app(served: Served, blocks=None):
    """The FastAPI app: the JSON routes (module docstring) and, unless ``blocks`` is False, the Gradio page of
    ``served`` (``serve.app.build_blocks``; pass one to reuse it) mounted at ``/``."""
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import FileResponse, JSONResponse

    class AsciiJSON(JSONResponse):
        """Every JSON answer: the server's paths replaced by their names (Served.public: serve.redact), escaped to
        ASCII (a message may quote what a client sent, lone surrogates ("\\ud800") included, which UTF-8 cannot
        encode)."""

        def render(self, content) -> bytes:
            return json.dumps(served.public(content), ensure_ascii=True, allow_nan=False,
                              separators=(",", ":")).encode()

    name = served.searcher.index_dir.name or "index"
    names = [name]
    app = FastAPI(title="plugvlm retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    counts = {"requests": 0}
    counts_lock = threading.Lock()

    def error(status: int, message: str, **headers) -> JSONResponse:
        return AsciiJSON({"error": message}, status_code=status, headers=headers or None)

    async def answer(request: Request, work):
        with counts_lock:
            counts["requests"] += 1
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, RecursionError):  # the guard refuses deep nesting first; this is the last line
            return error(400, "the request body is not JSON")
        try:
            return await run_in_threadpool(work, body, str(request.base_url))
        except Busy as e:
            return error(503, str(e), **{"Retry-After": "1"})
        except (ValueError, OSError) as e:  # RequestError, QueryError, IndexDirError ...
            return error(400, str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:  # a bug: logged, answered with one line, the server keeps serving
            traceback.print_exc()
            return error(500, f"internal error ({type(e).__name__}); the server logged it")

    def knn(body, base_url):
        results, timings, notes = knn_service(served, parse_knn(body, served, names), base_url)
        headers = {"Server-Timing": ", ".join(f"{k};dur={v}" for k, v in timings.items()),
                   "X-Plugvlm-Notes": json.dumps(served.public(notes), ensure_ascii=True)}
        return AsciiJSON(results, headers=headers)

    @app.post("/knn-service")
    async def knn_route(request: Request):
        return await answer(request, knn)

    @app.post("/metadata")
    async def metadata_route(request: Request):
        return await answer(request, lambda body, base: AsciiJSON(metadata_service(served, body, names, base)))

    @app.get("/indices-list")
    def indices_list():
        return AsciiJSON(names)

    @app.get("/images/{row}")
    def image_file(row: str):
        images = served.searcher.collection("image")
        if not re.fullmatch(r"[0-9]{1,18}", row) or int(row) >= images.n:  # ASCII digits: "²" is a digit to isdigit
            return error(404, f"no image row {_shown(row, 24)}: rows are 0..{images.n - 1}")
        path = str(images.column("path")[int(row)])
        if not os.path.isfile(path):
            return error(404, f"image row {row}: its file is gone from the collection")
        return FileResponse(path, headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "max-age=3600"})

    @app.get("/health")
    def health():
        gate = served.gate
        return AsciiJSON({"status": "ok", "pid": os.getpid(), "rss_bytes": rss_bytes(), "uptime_s": round(
            time.time() - served.started, 1), "requests": counts["requests"], "in_flight": gate._inside,
            "busy_refusals": gate.refused, "served": {k: v for k, v in served.describe().items()
                                                      if k != "recall" and (k != "index" or served.limits.show_paths)}})

    if blocks is not False:
        import gradio as gr

        from serve.app import build_blocks, page_theme

        blocks = blocks or build_blocks(served)
        # No allowed_paths: the page shows collection images as pixels it was handed, so Gradio's file route serves
        # only its own upload and cache folders (anything else: 403).
        app = gr.mount_gradio_app(app, blocks, path="/", allowed_paths=[], max_file_size=served.limits.max_upload_bytes,
                                  footer_links=["api"], run_history=False, show_error=True, ssr_mode=False,
                                  mcp_server=False, enable_monitoring=False, pwa=False, theme=page_theme())
        # Gradio checks that a request's file came from its upload folder only once launch() ran, which a mounted
        # app never calls: mark it launched so that check holds too (RequestGuard refuses such requests first)
        blocks.has_launched = True
    max_body = 4 * math.ceil(served.limits.max_upload_bytes / 3) + BODY_SLACK
    check_call = None
    if blocks is not False:
        from serve.app import call_problem

        check_call = functools.partial(call_problem, blocks)
    app.add_middleware(RequestGuard, max_body=max_body, check_call=check_call)
    return app


# --------------------------------------------------------------------------------------------- running it
def bind(host: str, port: int):
    """A listening TCP socket on ``host``:``port`` (0: a free port); OSError naming the fix when it cannot be had."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e}): another program may hold the port "
                      "(--port 0 picks a free one), or the address is not this machine's") from None
    return sock


class _QuietShutdown(logging.Filter):
    """Drops uvicorn's report of the streams a shutdown cuts: an open page (or a gradio_client) holds a heartbeat
    stream that never ends by itself, so every stop with a page open would print an error and a traceback of a
    CancelledError. Any other error still reaches the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith("timeout graceful shutdown exceeded"):
            return False
        return not (record.exc_info and record.exc_info[0] is not None
                    and issubclass(record.exc_info[0], asyncio.CancelledError))


def server_config(app):
    """uvicorn's settings for the app: quiet, idle connections closed after 5 s, at most 1000 connections (more are
    answered 503 by uvicorn), and a shutdown that waits at most 5 s for open streams (the page's heartbeat), then
    cuts them without a traceback (:class:`_QuietShutdown`)."""
    import uvicorn

    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietShutdown) for f in log.filters):
        log.addFilter(_QuietShutdown())
    return uvicorn.Config(app, log_level="warning", timeout_keep_alive=5, limit_concurrency=1000,
                          timeout_graceful_shutdown=5)


class RunningServer:
    """The app served by uvicorn in a background thread (tests, notebooks, the load check): ``url``, ``stop()``.
    ``port`` 0 picks a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 60.0):
        import uvicorn

        sock = bind(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        self._socket = sock
        self.server = uvicorn.Server(server_config(app))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="plugvlm-serve")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # a client still holding a stream (gradio's heartbeat): cut it
            self.server.force_exit = True
            self._thread.join(timeout=10)
        self._socket.close()
