"""The data side of adapter training: which feature caches a method needs (built or reused), held-out splits,
and the order in which caption rows are batched.

Caches. A method's head class names the components it needs (``components``) and any extraction options
(``extract_options``); :func:`extraction_options` turns them into ``python -m extract``'s options and
:func:`obtain_cache` runs its job (``extract.pipeline.run``, a function call, no command line) with exactly those
settings (the cache's fingerprint then decides reuse: identical settings and data reuse the folder, anything else
builds a new one, see ``extract/cache.py``). A cache given explicitly (``--cache``) is checked by :func:`check_cache` against the
backbone (architecture, preprocessing, weights hash) and the method (components, cached arrays, options); a
mismatch is an error naming both sides.

Batches. Captions are the training rows, and an image has several captions (5 in COCO, ~4.4 in the toy
world). A contrastive batch holding two captions of one image would treat each as a negative of the other's
image row, i.e. push apart two true pairs. :func:`epoch_batches` therefore never puts one image twice into a
(global) batch: a caption whose image is already in the batch being filled waits, first in line, for the
next batch. Every caption is seen once per epoch, in a random order that is a pure function of
(seed, epoch), which is what makes ``--resume`` exact without saving any sampler state.
"""
from __future__ import annotations

import json
from collections import deque

import numpy as np

from extract.cache import FeatureCache, settings_diff
from extract.worlds.toyworld import is_toyworld


# --------------------------------------------------------------------------------------------- data sources
def listed_images(spec, split: str | None = None, **options) -> int | None:
    """How many images a data source lists, read from its index without decoding or encoding anything
    (toy world, CSV/TSV, COCO JSON); None for a streaming source (webdataset), which only extraction counts.
    Lets a run refuse settings the data cannot satisfy (a batch larger than the training set) before the
    extraction, not after it. Images that fail to decode later only lower the count."""
    from extract.data.sources import IndexedSource, open_source

    source = open_source(spec, **({"split": split} if split else {}), **options)
    return len(source.records()) if isinstance(source, IndexedSource) else None


# --------------------------------------------------------------------------------------------- caches
def extraction_options(opts, data, split: str | None = None, *, device: str | None = None,
                       workers: int | None = None):
    """The ``python -m extract`` options (an ``extract.pipeline.ExtractOptions``) of one cache of the adapter run
    ``opts`` (a ``train.adapter.options.AdapterOptions``): its backbone, components, pass-through extraction options,
    data-source options, batch size and precision into ``opts.cache_dir``; ``data`` / ``split`` name the source,
    ``device`` / ``workers`` say how it runs (neither changes the cache; default workers: extract's)."""
    from extract.options import DEFAULT_WORKERS, ExtractOptions
    from extract.common.source_args import source_flags

    fields = {k: v for k, v in opts.extract_options.items() if v is not None}
    fields.update(source_flags(opts))
    if opts.image_root:
        fields["image_root"] = opts.image_root
    return ExtractOptions(data=str(data), out=str(opts.cache_dir), base=opts.base, pretrained=opts.pretrained,
                          split=split, components=list(opts.components), batch_size=opts.extract_batch_size,
                          precision=opts.extract_precision, device=device,
                          workers=DEFAULT_WORKERS if workers is None else workers, **fields)


def obtain_cache(options, backbone) -> FeatureCache:
    """Build (or reuse, by fingerprint) the cache ``options`` (ExtractOptions) describe, with the already loaded
    ``backbone``; returns it opened."""
    from extract.pipeline import run

    manifest = run(options, backbone=backbone)
    return FeatureCache.open(options.out, fingerprint=manifest["fingerprint"])


def final_table_data(opts) -> dict:
    """``train.eval.evaluate.EvaluateOptions`` data fields of an adapter run's final table (``opts``: anything with
    ``data``, ``val_data``, ``test_data``, ``benchmark``, ``image_root`` and the --csv-* fields): the test data
    (``test_data``, else the toy world's test split, else ``val_data``) and the benchmarks, read like the training
    data; {} when there is none."""
    from extract.common.source_args import source_flags

    out: dict = {}
    spec = opts.test_data or (opts.data if opts.data and is_toyworld(opts.data) else None) or opts.val_data
    if spec is not None:
        out = {"data": str(spec), "split": "test"} if is_toyworld(spec) else {"retrieval_data": str(spec)}
    if opts.benchmark:
        out["benchmark"] = list(opts.benchmark)
    if out:
        if opts.image_root:
            out["image_root"] = opts.image_root
        out.update(source_flags(opts))  # the test table is read like the training one
    return out


def cache_config(cache: FeatureCache) -> dict:
    """The resolved ``python -m extract`` arguments that built ``cache`` (its config.json)."""
    path = cache.path / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def check_cache(cache: FeatureCache, head_cls, backbone, options: dict) -> None:
    """Raise ValueError naming both sides when ``cache`` was not built by ``backbone`` or lacks what ``head_cls``
    needs (components, arrays, extraction options)."""
    theirs, ours = cache.settings.get("backbone", {}), backbone.describe(hash_weights=True)
    if theirs != ours:
        diff = "\n  ".join(settings_diff(theirs, ours)[:8])
        raise ValueError(f"cache {cache.path} was built for backbone {_name(theirs)}, but this run uses "
                         f"{_name(ours)}:\n  {diff}\nBuild a cache for this backbone (drop --cache: it is built "
                         "automatically) or pass the backbone the cache was made with")
    have = set(cache.settings.get("components", []))
    missing = sorted(set(head_cls.components) - have)
    missing_keys = sorted((set(head_cls.image_keys) | set(head_cls.text_keys)) - set(cache.keys))
    if missing or missing_keys:
        raise ValueError(f"cache {cache.path} ({cache.settings.get('summary', '')}) holds components "
                         f"{sorted(have) or ['global only']}; method {head_cls.name} needs {sorted(head_cls.components)}"
                         f" (missing components {missing}, arrays {missing_keys}). Drop --cache to build the "
                         "right one, or extract with --components " + ",".join(sorted(have | set(head_cls.components))))
    config = cache_config(cache)
    wrong = [f"{k}: cache has {config.get(k)!r}, {head_cls.name} needs {v!r}" for k, v in options.items()
             if v is not None and k in config and config[k] != v]
    if wrong:
        raise ValueError(f"cache {cache.path} was extracted with other options than method {head_cls.name} needs:\n  "
                         + "\n  ".join(wrong))


def _name(describe: dict) -> str:
    sha = describe.get("weights_sha256") or ""
    return f"{describe.get('base')} ({describe.get('model')}, {describe.get('pretrained') or 'random'} weights" + \
        (f" sha256 {sha[:12]})" if sha else ")")


# --------------------------------------------------------------------------------------------- splits
def split_images(num_images: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train image rows, held-out image rows): a seeded ``fraction`` of the images (at least one) is held out
    with all of its captions, so no caption of a training image is ever evaluated on."""
    if not 0 < fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {fraction}")
    order = np.random.default_rng([seed, 0x5EED]).permutation(num_images)
    n_val = max(1, int(round(num_images * fraction)))
    if n_val >= num_images:
        raise ValueError(f"--val-fraction {fraction} leaves no training image out of {num_images}")
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def caption_rows_of(caption_image: np.ndarray, image_rows: np.ndarray) -> np.ndarray:
    """Caption rows whose image is in ``image_rows``."""
    return np.nonzero(np.isin(caption_image, image_rows))[0]


# --------------------------------------------------------------------------------------------- batches
def epoch_batches(rows: np.ndarray, caption_image: np.ndarray, batch_size: int, seed: int, epoch: int,
                  max_batches: int | None = None) -> list[np.ndarray]:
    """Full batches of caption rows for one epoch, no image twice in a batch (module docstring).

    rows: the training caption rows; caption_image [num_captions]: image row of every caption (global);
    batch_size: the global batch (all ranks). Returns at most ``max_batches`` (default: as many as the rows
    fill) arrays of ``batch_size`` rows. Captions that cannot complete a batch at the end of the epoch (an
    incomplete last batch, or captions of images already in it) are dropped for this epoch only.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    order = np.asarray(rows, dtype=np.int64)[np.random.default_rng([seed, epoch]).permutation(len(rows))]
    limit = len(order) // batch_size if max_batches is None else min(max_batches, len(order) // batch_size)
    batches: list[np.ndarray] = []
    waiting: deque = deque()   # (row, image) pairs put off because their image was already in the batch
    current: list[int] = []
    seen: set = set()

    def add(row: int, image: int) -> str:
        """Put a caption into the batch being filled ("added", "emitted" when that completed it) or at the
        end of the waiting line ("waiting")."""
        if image in seen:
            waiting.append((row, image))
            return "waiting"
        current.append(row)
        seen.add(image)
        if len(current) < batch_size:
            return "added"
        batches.append(np.asarray(current, dtype=np.int64))
        current.clear()
        seen.clear()
        return "emitted"

    def drain() -> None:
        """Passes over the waiting line, oldest first, while they still place a caption (a fresh batch
        takes waiting captions before new ones)."""
        placed = True
        while placed and waiting and len(batches) < limit:
            placed = False
            for _ in range(len(waiting)):
                outcome = add(*waiting.popleft())
                placed |= outcome != "waiting"
                if len(batches) >= limit:
                    return

    if limit == 0:
        return batches
    for row, image in zip(order.tolist(), caption_image[order].tolist()):
        if add(row, image) == "emitted":
            drain()
        if len(batches) >= limit:
            return batches
    drain()
    return batches
