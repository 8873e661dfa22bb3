"""Training data for ``python -m train.pretrain``: image-caption batches, deterministic and rank-aware.

Two kinds of source (any :func:`extract.data.sources.open_source` spec):

- **Indexed** (toy world, CSV/TSV, COCO JSON): an epoch visits every image once, in a permutation drawn from
  ``(seed, epoch)``, with one of its captions drawn from ``(seed, epoch, image)`` (an image with five COCO
  captions shows a different one each epoch; the toy world's object, relation and long captions alternate).
  The permutation is cut into global micro-batches of ``world_size x batch_size`` images and rank r takes
  rows ``r * batch_size ...`` of each, so N ranks see exactly the images one process sees with N times the
  batch. A run resumed at step s starts at micro-batch ``s x accum_freq`` of its epoch: the data after a
  resume is the data the uninterrupted run would have seen (the kill -9 test). Incomplete last micro-batches
  are dropped (open_clip's ``drop_last``).
- **webdataset shards** (``.tar``, folder, brace pattern): streamed. Every data-loader worker of every rank
  is a *reader* with its own endless sequence of shards, drawn from ``(seed, reader, pass)`` -- with
  replacement (``--dataset-resampled``, open_clip's default for large data) or a per-pass shuffled partition.
  A reader cuts its sequence of samples into blocks of ``--shuffle-buffer`` samples (across shard ends) and
  gives each block in an order drawn from ``(seed, reader, block)``; only the undecoded bytes of one block are
  held. An epoch is ``--train-num-samples`` samples, and the stream runs on across epochs. A resumed run
  continues the stream exactly: reader position k holds the same sample in every run (see the next
  paragraph), the DataLoader takes batches from its workers in turn, so the micro-batches a rank has
  consumed say how far each reader got; the resumed readers count the samples of the shards they pass
  (headers only, no decoding), read one block and start at the position where the run stopped. The
  checkpoint stores that count and the layout it was counted in (:meth:`TrainData.resume_state`); with
  another layout (world size, workers, batch size, seed, shuffle buffer, shards) the resumed stream skips as
  much data but is not the same samples.

Bad input never stops training and never changes batch shapes (ranks must gather equal shapes): an
unreadable image of an indexed source is replaced by another image drawn from the same seed; in a stream, a
sample that is refused takes the place of the next good sample in its reader's order, which also appears in
its own place (so position k is the same sample in every run, whatever decoding refuses). Every refusal is
recorded with :class:`extract.data.report.Skip` (the same reasons and locations as
``python -m extract.data.check``), travels with its batch to the main process, and is counted in the log, the
checkpoints and ``data_report.json``.

Workers also run the objective's ``prepare`` (e.g. PowerCLIP's spaCy phrase trees), so the training loop only
moves tensors. Augmentation is open_clip's training transform (random resized crop, scale 0.9-1) seeded per
sample from ``(seed, epoch, image)``, or the evaluation transform when the objective needs fixed geometry.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from extract.data.sources import IndexedSource, WebDatasetSource, expand_shards, open_source
from extract.data.images import BadImage
from extract.data.report import Skip, SkipReport
from extract.worlds.toyworld import heldout_of, is_toyworld

MAX_REPLACEMENTS = 50  # unreadable images in a row before an indexed source is declared broken


def _rng(*keys: int | str) -> np.random.Generator:
    """A numpy generator for a tuple of keys (strings hashed), independent of call order and process."""
    ints = [k if isinstance(k, int) else int.from_bytes(hashlib.sha256(k.encode()).digest()[:4], "little")
            for k in keys]
    return np.random.default_rng(np.random.SeedSequence(ints))


class SeededTransform:
    """Apply ``transform`` with torch's RNG seeded for this sample (random resized crop draws from it), so an
    image gets the same crop whichever worker, rank or resumed run loads it. Picklable for workers."""

    def __init__(self, transform: Callable, random: bool):
        self.transform, self.random = transform, random

    def __call__(self, image, seed: int) -> torch.Tensor:
        if not self.random:
            return self.transform(image)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(image)


# --------------------------------------------------------------------------------------------- indexed sources
class IndexedPairs(Dataset):
    """Map-style dataset over an indexed source; an index is ``(epoch, image position)``.

    Returns a dict: ``image`` (tensor), ``caption`` (str), ``image_id``, ``location`` and ``note`` (how its pixels
    were converted, or None: the report counts conversions from these, since a worker's own report never reaches the
    main process) and ``skips`` (the Skip records of images that failed and were replaced to produce this item).
    """

    def __init__(self, source: IndexedSource, transform: SeededTransform, seed: int):
        self.source, self.transform, self.seed = source, transform, seed
        self.records = source.records()
        if not self.records:
            raise ValueError(f"{source.name} has no usable image-caption pair: {source.report.summary()}")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: tuple[int, int]) -> dict[str, Any]:
        epoch, position = index
        skips: list[Skip] = []
        for attempt in range(MAX_REPLACEMENTS):
            if attempt:  # a replacement drawn from the seed: the same one in every run
                position = int(_rng(self.seed, epoch, position, attempt, "replace").integers(len(self.records)))
            record = self.records[position]
            try:
                sample = self.source.load(record)
            except BadImage as e:
                skips.append(Skip.from_error("image", record.image_id, record.location, e))
                continue
            rng = _rng(self.seed, epoch, position, "sample")
            caption = record.captions[int(rng.integers(len(record.captions)))].text
            image = self.transform(sample.image, int(rng.integers(2 ** 63 - 1)))
            return {"image": image, "caption": caption, "image_id": record.image_id, "location": record.location,
                    "note": sample.note, "skips": skips}
        raise RuntimeError(f"{MAX_REPLACEMENTS} unreadable images in a row in {self.source.name} (last: "
                           f"{skips[-1].location}: {skips[-1].reason}); check it with python -m extract.data.check")


class GlobalBatchSampler:
    """Yields this rank's micro-batches of ``(epoch, position)`` (see the module docstring).

    steps_per_epoch = (n // (world_size * batch_size)) // accum_freq optimizer steps; ``set_epoch(e, start)``
    positions the next iteration at optimizer step ``start`` of epoch ``e``.
    """

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, accum_freq: int, seed: int):
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.accum_freq, self.seed = accum_freq, seed
        self.global_micro = batch_size * world_size
        self.steps_per_epoch = (n // self.global_micro) // accum_freq
        if self.steps_per_epoch < 1:
            raise ValueError(f"{n} images make no full step of {accum_freq} x {world_size} rank(s) x {batch_size}; "
                             "lower --batch-size / --accum-freq or use more data")
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start = epoch, start_step

    def permutation(self, epoch: int) -> np.ndarray:
        return _rng(self.seed, epoch, "permutation").permutation(self.n)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start) * self.accum_freq

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        perm = self.permutation(self.epoch)
        for micro in range(self.start * self.accum_freq, self.steps_per_epoch * self.accum_freq):
            rows = perm[micro * self.global_micro + self.rank * self.batch_size:][:self.batch_size]
            yield [(self.epoch, int(p)) for p in rows]


# --------------------------------------------------------------------------------------------- streams
class StreamPairs(IterableDataset):
    """Endless stream of items from webdataset shards for one rank (see the module docstring).

    Worker w of ``W`` (one when loading in the main process) is reader ``rank x W + (w + start) mod W`` and
    starts at position ``((start + w) // W) x batch_size`` of that reader's order: after ``start`` micro-batches
    of this rank, that is where the uninterrupted DataLoader, which takes batches from workers 0, 1, ... in
    turn, would continue. Reader shard orders depend on ``(seed, reader, pass)`` only.
    """

    def __init__(self, shards: Sequence[str], transform: SeededTransform, seed: int, rank: int, world_size: int,
                 resampled: bool = True, shuffle_buffer: int = 1000, batch_size: int = 1, start: int = 0,
                 max_pixels: int | None = None):
        self.shards = list(shards)
        self.transform, self.seed, self.rank, self.world_size = transform, seed, rank, world_size
        self.resampled, self.shuffle_buffer, self.max_pixels = resampled, max(1, shuffle_buffer), max_pixels
        self.batch_size, self.start = batch_size, start

    def _shard_order(self, reader: int, readers: int) -> Iterator[str]:
        for pas in range(1 << 62):
            rng = _rng(self.seed, reader, pas, "shards")
            if self.resampled:
                yield from (self.shards[int(i)] for i in rng.integers(len(self.shards), size=len(self.shards)))
                continue
            order = _rng(self.seed, pas, "partition").permutation(len(self.shards))
            mine = order[reader::readers]
            yield from (self.shards[int(i)] for i in (mine if len(mine) else rng.integers(len(self.shards), size=1)))

    def _raw(self, source: WebDatasetSource, reader: int, readers: int, skip: int) -> Iterator[tuple]:
        """``(shard, key, files)`` of the reader's samples in shard order, from sample number ``skip`` on (the
        shards before it are counted from their headers, not read)."""
        counts: dict[str, int] = {}
        empty, limit = 0, max(50, 2 * len(self.shards))
        for shard in self._shard_order(reader, readers):
            if skip:
                n = counts[shard] if shard in counts else counts.setdefault(shard, source.count_samples(shard))
                if n <= skip:
                    skip -= n
                    empty = 0 if n else empty + 1
                    if empty >= limit:
                        break
                    continue
            got = 0
            for key, files in source.raw_samples(shard, skip=skip):
                got += 1
                yield shard, key, files
            skip = 0
            empty = 0 if got else empty + 1
            if empty >= limit:
                break
        raise RuntimeError(f"no sample in {limit} shards in a row of {source.name} ({source.report.summary()}); "
                           "check them with python -m extract.data.check")

    def _order(self, source: WebDatasetSource, reader: int, readers: int, position: int) -> Iterator[tuple]:
        """The reader's samples in shuffled order (blocks of ``shuffle_buffer``, see the module docstring), from
        ``position`` on."""
        size = self.shuffle_buffer
        block, offset = divmod(position, size)
        raw = self._raw(source, reader, readers, block * size)
        while True:
            chunk = list(islice(raw, size))
            order = _rng(self.seed, reader, block, "block").permutation(len(chunk)) if size > 1 else [0]
            for i in order[offset:]:
                yield chunk[int(i)]
            block, offset = block + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = self.rank * workers + (worker + self.start) % workers
        position = (self.start + worker) // workers * self.batch_size
        source = WebDatasetSource(self.shards, max_pixels=self.max_pixels)
        order = self._order(source, reader, self.world_size * workers, position)
        ahead: deque[list] = deque()  # [shard, key, files, Sample | None, decoded?] from the current position on
        seen = 0
        while True:
            sample = self._good(source, order, ahead)
            ahead.popleft()
            rng = _rng(self.seed, reader, position, "item")
            caption = sample.captions[int(rng.integers(len(sample.captions)))].text
            skips = source.report.skips
            item = {"image": self.transform(sample.image, int(rng.integers(2 ** 63 - 1))), "caption": caption,
                    "image_id": sample.image_id, "location": sample.location, "note": sample.note,
                    "skips": skips[seen:]}
            seen = len(skips)
            position += 1
            yield item

    @staticmethod
    def _good(source: WebDatasetSource, order: Iterator[tuple], ahead: deque) -> Any:
        """The sample at the current position (``ahead[0]``) if it is good, else the next good one after it."""
        for k in range(MAX_REPLACEMENTS + 1):
            if k == len(ahead):
                ahead.append([*next(order), None, False])
            entry = ahead[k]
            if not entry[4]:
                entry[3], entry[4] = source.to_sample(entry[0], entry[1], entry[2]), True
                entry[2] = None  # the bytes are decoded (or refused): free them
            if entry[3] is not None:
                return entry[3]
        raise RuntimeError(f"{MAX_REPLACEMENTS + 1} refused samples in a row in {source.name} (last: "
                           f"{ahead[-1][0]}::{ahead[-1][1]}); check it with python -m extract.data.check")


# --------------------------------------------------------------------------------------------- batches
class Collate:
    """Items -> a batch dict: ``image`` [b, 3, H, W], ``text`` [b, L] (the model's tokenizer, unless the
    objective's ``prepare`` supplies it), the objective's extras, and ``image_ids`` / ``captions`` / ``locations`` /
    ``notes`` / ``skips`` (lists, not moved to the device). Runs in the data-loader workers."""

    def __init__(self, tokenizer, objective):
        self.tokenizer, self.objective = tokenizer, objective

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        captions = [it["caption"] for it in items]
        image_ids = [it["image_id"] for it in items]
        batch: dict[str, Any] = {"image": torch.stack([it["image"] for it in items])}
        extras = self.objective.prepare(captions, image_ids, self.tokenizer)
        batch["text"] = extras.pop("text") if "text" in extras else self.tokenizer(captions)
        batch.update(extras)
        batch.update(image_ids=image_ids, captions=captions, locations=[it["location"] for it in items],
                     notes=[it["note"] for it in items], skips=[s for it in items for s in it["skips"]])
        return batch


TENSOR_FREE_KEYS = ("image_ids", "captions", "locations", "notes", "skips")


def to_device(batch: dict[str, Any], device, input_dtype=None) -> dict[str, Any]:
    """Move a batch's tensors to ``device`` (images cast to the model's input dtype); lists stay."""
    out = {}
    for k, v in batch.items():
        if k in TENSOR_FREE_KEYS or not isinstance(v, torch.Tensor):
            out[k] = v
        elif k == "image" and input_dtype is not None:
            out[k] = v.to(device=device, dtype=input_dtype, non_blocking=True)
        else:
            out[k] = v.to(device=device, non_blocking=True)
    return out


@dataclass
class TrainData:
    """What the engine needs from the data: micro-batches per epoch, sizes, the report and a description."""

    loader: DataLoader
    steps_per_epoch: int
    accum_freq: int
    kind: str
    description: dict[str, Any]
    report: SkipReport = field(default_factory=SkipReport)
    sampler: GlobalBatchSampler | None = None
    image_ids: set[str] | None = None
    _stream: Iterator | None = None
    # streams: the micro-batches this rank had consumed at optimizer step `start_step`, and what they count in
    start_micro: int = 0
    start_step: int = 0
    layout: dict[str, Any] | None = None

    def resume_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint written after optimizer step ``step`` stores for the data to continue exactly (pass
        the checkpoint's state, with it under ``"data_state"``, to :func:`build_train_data`): for a stream, the
        micro-batches each rank had consumed (the same on every rank) and the layout they were counted in; for an
        indexed source nothing (the step positions it)."""
        if self.layout is None:
            return {}
        return {"micro_batches": self.start_micro + (step - self.start_step) * self.accum_freq,
                "layout": self.layout}

    def epoch_batches(self, epoch: int, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """The optimizer steps ``start_step .. steps_per_epoch - 1`` of ``epoch``, each as its list of
        ``accum_freq`` micro-batches."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_step)
            it = iter(self.loader)
        else:
            if self._stream is None:
                self._stream = iter(self.loader)
            it = self._stream
        for _ in range(start_step, self.steps_per_epoch):
            micro = [next(it) for _ in range(self.accum_freq)]
            for b in micro:  # a converted image is noted once per (image, location), however often it is drawn
                self.report.add_batch(b, b["skips"])
            yield micro


def build_train_data(data: str, *, batch_size: int, rank: int, world_size: int, accum_freq: int, seed: int,
                     tokenizer, objective, transform: SeededTransform, workers: int, split: str = "train",
                     image_root: str | None = None, source_options: dict[str, Any] | None = None,
                     train_num_samples: int | None = None, resampled: bool = True, shuffle_buffer: int = 1000,
                     resume_state: dict[str, Any] | None = None, pin_memory: bool = False) -> TrainData:
    """Open ``data`` and build its loader (see the module docstring).

    ``source_options``: CSV/TSV reading options (:func:`extract.common.source_args.source_options`). ``resume_state``: the
    state of the checkpoint being resumed (its ``"step"`` and the ``"data_state"`` that
    :meth:`TrainData.resume_state` gave); a stream then continues where that run stopped. ``pin_memory``: the
    loader gives page-locked batches, whose copy to a CUDA device can run beside compute (train.pretrain.prefetch)."""
    spec_is_stream = _is_stream(data)
    if not spec_is_stream:
        options: dict[str, Any] = {}
        if is_toyworld(data):
            options["split"] = split
        elif image_root:
            options["image_root"] = image_root
        source = open_source(data, **options, **(source_options or {}))
        if not isinstance(source, IndexedSource):
            raise ValueError(f"{data}: not an indexed source")
    collate = Collate(tokenizer, objective)
    loader_kw = dict(num_workers=workers, collate_fn=collate, persistent_workers=workers > 0, pin_memory=pin_memory)
    if spec_is_stream:
        shards = expand_shards(data)
        if not shards:
            raise ValueError(f"no webdataset shards found for {data!r}")
        if not train_num_samples:
            raise ValueError("webdataset training needs --train-num-samples (samples per epoch), as open_clip does")
        steps = train_num_samples // (batch_size * world_size * accum_freq)
        if steps < 1:
            raise ValueError(f"--train-num-samples {train_num_samples} makes no full step of {accum_freq} x "
                             f"{world_size} x {batch_size}")
        layout = {"seed": seed, "world_size": world_size, "readers_per_rank": max(1, workers), "batch_size": batch_size,
                  "shuffle_buffer": max(1, shuffle_buffer), "resampled": bool(resampled),
                  "shards": hashlib.sha256("\n".join(Path(s).name for s in shards).encode()).hexdigest()[:16]}
        start_micro, start_step, resume = _stream_start(resume_state, layout, accum_freq)
        stream = StreamPairs(shards, transform, seed, rank, world_size, resampled=resampled,
                             shuffle_buffer=shuffle_buffer, batch_size=batch_size, start=start_micro)
        loader = DataLoader(stream, batch_size=batch_size, **loader_kw)
        desc = {"kind": "webdataset", "spec": str(data), "shards": len(shards), "resampled": resampled,
                "shuffle_buffer": shuffle_buffer, "samples_per_epoch": train_num_samples, "resume": resume}
        return TrainData(loader, steps, accum_freq, "stream", desc, start_micro=start_micro, start_step=start_step,
                         layout=layout)
    dataset = IndexedPairs(source, transform, seed)
    sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world_size, accum_freq, seed)
    loader = DataLoader(dataset, batch_sampler=sampler, **loader_kw)
    desc = {"kind": type(source).__name__, "spec": str(data), "split": split if is_toyworld(data) else None,
            "images": len(dataset), "captions": sum(len(r.captions) for r in dataset.records),
            "index_report": source.report.counts()}
    if is_toyworld(data):  # what the weights never saw: a demo world holding these out tests composition
        desc["holdout"] = sorted(f"{c} {s}" for c, s in heldout_of(data))
    report = SkipReport().merge(source.report)
    return TrainData(loader, sampler.steps_per_epoch, accum_freq, "indexed", desc, report, sampler,
                     {r.image_id for r in dataset.records})


def _stream_start(resume_state: dict[str, Any] | None, layout: dict[str, Any], accum_freq: int) -> tuple[int, int, str]:
    """(micro-batches consumed, optimizer step, how exact) at which a stream starts for this checkpoint state."""
    if not resume_state:
        return 0, 0, "new stream"
    step = int(resume_state.get("step", 0))
    saved = resume_state.get("data_state") or {}
    if "micro_batches" not in saved:  # a checkpoint from before the stream stored its position
        return step * accum_freq, step, f"approximate: the checkpoint has no stream position; skipped {step} steps"
    micro = int(saved["micro_batches"])
    changed = sorted(k for k in layout if saved.get("layout", {}).get(k) != layout[k])
    if changed:
        return micro, step, f"approximate: {', '.join(changed)} changed; skipped {micro} micro-batches per rank"
    return micro, step, f"exact: continues after {micro} micro-batches per rank"


def _is_stream(data: str) -> bool:
    from pathlib import Path

    text = str(data)
    p = Path(text)
    if p.is_dir():
        return not is_toyworld(text) and bool(expand_shards(text))
    return ("{" in text and "}" in text) or text.lower().endswith((".tar", ".tar.gz", ".tgz"))
