"""plugvlm serving: FAISS retrieval over a collection with compositional re-ranking, and the Gradio app on top of
it.

Two stages, as clip-retrieval's back-end plus what none has::

    query -> encode once -> stage 1: FAISS top-K on first-stage vectors (single-threaded per request)
          -> stage 2: the model's own Scorer re-scores the K candidates from their cached component features
          -> hits with both scores and both ranks

Modules: ``layout`` (the index directory: files, manifest, atomic replacement, build lock), ``faiss_index``
(index types, the ``auto`` choice, tuning, recall at build, on-disk IVF), ``index`` (``python -m serve.index``:
build and ``--add``), ``stage2`` (re-ranking representations stored in the index), ``search`` (``Searcher``: open,
search_text / search_image, re-ranking, filters, paging), ``query`` (``python -m serve.query``); the app:
``service`` (``Served``: what the page and the API both call, with its ``Limits`` and ``Gate``), ``heatmap``
(per-phrase maps under any scorer), ``app`` (the Gradio page over ``Served``), ``heatmap_render`` (how the page draws
the heatmaps), ``http`` (FastAPI with the page mounted and clip-retrieval's ``/knn-service``), ``request_guard``
(what a request may make the server touch), ``redact`` (what an answer may say about the server's files: names,
never paths), ``__main__`` (``python -m serve``). Its speed and load runs are
``python -m train.bench.serve`` and ``python -m train.bench.serve_load``.

The index directory (``INDEX_DIR/``), written by ``serve.index`` and read by ``serve.search``:

- ``manifest.json`` (written last; its presence means the directory is complete): ``format`` "plugvlm-index",
  ``version`` 2 (1: the same with parquet metadata, still read), ``model`` (what was given: ``model``, ``pretrained``; ``kind`` backbone | pretrain | adapter;
  ``name``; ``fingerprint``: SHA-256 identifying the model's weights -- a query with another model is refused,
  naming both (``serve.layout.model_fingerprint``); ``first_stage_dim``; ``annotations`` / ``detector``: the
  box source given to ``serve.index``, which replaces the one the adapter was trained with; ``boxes``: which boxes
  were indexed, ``source`` / ``trained`` / ``from``, None for a model that reads none), ``data`` (``spec``
  resolved, ``split``, ``source``, ``fingerprint``: the feature cache's data fingerprint), ``cache`` (``path``, ``fingerprint``: the feature cache
  holding every item's component arrays, which stage 2 reads), ``collection`` (``images``, ``captions``),
  ``indexes``: ``{"image": {...}, "text": {...}}`` (``text`` only when the source has captions), each with
  ``file``, ``metadata``, ``key`` (the FAISS factory string), ``kind`` (flat | hnsw | ivf-flat | ivf-pq),
  ``params`` (nprobe / efSearch), ``ntotal``, ``bytes``, ``recall_at_10`` against exact search measured at build
  (null for flat), ``recall_queries``, ``build_seconds``, ``ondisk``; and ``created``, ``build_seconds``,
  ``versions``.
- Added by ``serve.index`` beyond that: ``parts`` (one per source, in row order, the first being ``data`` /
  ``cache``; more after ``--add``): ``data``, ``cache``, ``images``, ``captions``, ``image_rows`` / ``caption_rows``
  ([start, end) of its rows); ``files`` (every file's byte size, checked on open);
  ``digests`` (SHA-256 of every file: the metadata tables and files up to 256 MiB checked on every open, all of
  them by ``python -m serve.index --verify``; see ``serve.layout``); ``options`` (the budgets it
  was built under); ``created_first`` (after ``--add``). Per index: ``queries`` (what the recall / latency queries
  were), ``ms_per_query`` (single-threaded, at ``params``), ``tuning`` (each setting tried: params, ms, recall),
  ``tried`` (each candidate index built, with its figures); on-disk IVF: ``ivfdata`` (``image.ivfdata``, opened
  with ``faiss.IO_FLAG_ONDISK_SAME_DIR``) and ``trained`` (the empty trained index, for ``--add``); ``max_norm``
  (the largest norm of the indexed vectors: every score a query gets is checked against the bound it gives);
  ``refine`` (``--refine``: ``file``, ``dtype``, ``bytes`` of the vectors that re-score the shortlist exactly).
- ``image.index`` / ``text.index``: FAISS inner-product indices over first-stage vectors (float32, stored as
  the scorer gives them), FAISS id = row. ``image.index`` holds ``scorer.first_stage_image(reps, "t2i")`` of
  every image (queried by ``first_stage_text(reps, "t2i")`` of a text); ``text.index`` holds
  ``first_stage_text(reps, "i2t")`` of every caption (queried by ``first_stage_image(reps, "i2t")``).
- ``image.arrow`` (an uncompressed Arrow IPC file, one record batch, memory-mapped when read; ``image.parquet`` in
  version 1): ``row`` (int64, = FAISS id), ``image_id``, ``path``, ``captions`` (list of str),
  ``cache_row`` (the image's row in the cache). ``text.arrow``: ``row``, ``caption_id``, ``text``,
  ``image_row`` (row in image.arrow), ``image_id``, ``cache_row``. Both also ``part`` (int32: the index in
  ``parts`` of the source the row came from, whose cache ``cache_row`` is a row of). Never pickle.
- ``image.refine.npy`` / ``text.refine.npy`` (``--refine``, the default for ivf-pq): the first-stage vectors as
  fp16 [N, d], row = FAISS id, memory-mapped; a PQ index's shortlist of ``k x k_factor`` is re-scored exactly
  from them (``serve.faiss_index.Refined``).
- ``image.stage2.<name>.npy`` / ``text.stage2.<name>.npy`` (adapters; :mod:`serve.stage2`): the head's
  representation of every item, row = FAISS id, which re-ranking reads instead of encoding its candidates; the
  index's ``stage2`` entry says whether they were stored (``stored``, ``arrays``, ``bytes``) or why not
  (``reason``).
- Beside the folder while a build runs: ``INDEX_DIR.lock`` (its flock), ``INDEX_DIR.tmp-<pid>`` (the new folder
  being written); see ``serve.layout`` for the atomic replacement and ``read_manifest`` / ``open_index`` /
  ``read_metadata`` / ``check_alignment`` for reading it back checked.
"""

import extract.numerics  # noqa: F401  MKL's reproducible mode before any matrix product
