"""Training data for ``python -m train.pretrain``: image-caption batches, deterministic and rank-aware.

Two kinds of source (any :func:`extract.data.open_source` spec):

- **Indexed** (toy world, CSV/TSV, COCO JSON): an epoch visits every image once, in a permutation drawn from
  ``(seed, epoch)``, with one of its captions drawn from ``(seed, epoch, image)`` (an image with five COCO
  captions shows a different one each epoch; the toy world's object, relation and long captions alternate).
  The permutation is cut into global micro-batches of ``world_size x batch_size`` images and rank r takes
  rows ``r * batch_size ...`` of each, so N ranks see exactly the images one process sees with N times the
  batch. A run resumed at step s starts at micro-batch ``s x accum_freq`` of its epoch: the data after a
  resume is the data the uninterrupted run would have seen (the kill -9 test). Incomplete last micro-batches
  are dropped (open_clip's ``drop_last``).
- **webdataset shards** (``.tar``, folder, brace pattern): streamed. Every data-loader worker of every rank
  reads its own shards -- with replacement (``--dataset-resampled``, open_clip's default for large data) or
  a per-pass shuffled partition -- through a shuffle buffer of ``--shuffle-buffer`` samples. An epoch is
  ``--train-num-samples`` samples. After a resume the stream restarts with a new seed (at a shard boundary):
  the same distribution, not the same samples (open_clip does the same).

Bad input never stops training and never changes batch shapes (ranks must gather equal shapes): an
unreadable image of an indexed source is replaced by another image drawn from the same seed; a stream simply
skips it. Every refusal is recorded with :class:`extract.report.Skip` (the same reasons and locations as
``python -m extract.check_data``), travels with its batch to the main process, and is counted in the log, the
checkpoints and ``data_report.json``.

Workers also run the objective's ``prepare`` (e.g. PowerCLIP's spaCy phrase trees), so the training loop only
moves tensors. Augmentation is open_clip's training transform (random resized crop, scale 0.9-1) seeded per
sample from ``(seed, epoch, image)``, or the evaluation transform when the objective needs fixed geometry.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from extract.data import IndexedSource, WebDatasetSource, expand_shards, open_source
from extract.images import BadImage
from extract.report import Skip, SkipReport

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

    Returns a dict: ``image`` (tensor), ``caption`` (str), ``image_id`` and ``skips`` (the Skip records of
    images that failed and were replaced to produce this item).
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
            return {"image": image, "caption": caption, "image_id": record.image_id, "skips": skips}
        raise RuntimeError(f"{MAX_REPLACEMENTS} unreadable images in a row in {self.source.name} (last: "
                           f"{skips[-1].location}: {skips[-1].reason}); check it with python -m extract.check_data")


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

    Each worker w of rank r reads shards chosen by ``(seed, resume, r, w, pass)``: drawn with replacement when
    ``resampled``, else a shuffled partition of all shards over the ``world_size x workers`` readers (a reader
    with no shard of its own in a pass reads a random one, so no worker starves). Items go through a shuffle
    buffer. Bad samples are skipped; their Skip records ride along with the next good item.
    """

    def __init__(self, shards: Sequence[str], transform: SeededTransform, seed: int, rank: int, world_size: int,
                 resampled: bool = True, shuffle_buffer: int = 1000, resume: int = 0, max_pixels: int | None = None):
        self.shards = list(shards)
        self.transform, self.seed, self.rank, self.world_size = transform, seed, rank, world_size
        self.resampled, self.shuffle_buffer, self.resume, self.max_pixels = resampled, shuffle_buffer, resume, max_pixels

    def _shard_order(self, worker: int, workers: int) -> Iterator[str]:
        reader, readers = self.rank * workers + worker, self.world_size * workers
        for pas in range(1 << 62):
            rng = _rng(self.seed, self.resume, reader, pas, "shards")
            if self.resampled:
                yield from (self.shards[int(i)] for i in rng.integers(len(self.shards), size=len(self.shards)))
                continue
            order = _rng(self.seed, self.resume, pas, "partition").permutation(len(self.shards))
            mine = order[reader::readers]
            yield from (self.shards[int(i)] for i in (mine if len(mine) else rng.integers(len(self.shards), size=1)))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = _rng(self.seed, self.resume, self.rank, worker, "stream")
        buffer: list[dict[str, Any]] = []
        pending: list[Skip] = []
        for shard in self._shard_order(worker, workers):
            source = WebDatasetSource([shard], max_pixels=self.max_pixels)
            seen = 0
            for sample in source:
                skips = source.report.skips
                pending.extend(skips[seen:])
                seen = len(skips)
                caption = sample.captions[int(rng.integers(len(sample.captions)))].text
                item = {"image": self.transform(sample.image, int(rng.integers(2 ** 63 - 1))), "caption": caption,
                        "image_id": sample.image_id, "skips": []}
                if self.shuffle_buffer > 1:
                    if len(buffer) < self.shuffle_buffer:
                        buffer.append(item)
                        continue
                    k = int(rng.integers(len(buffer)))
                    buffer[k], item = item, buffer[k]
                item["skips"], pending = pending, []
                yield item
            pending.extend(source.report.skips[seen:])


# --------------------------------------------------------------------------------------------- batches
class Collate:
    """Items -> a batch dict: ``image`` [b, 3, H, W], ``text`` [b, L] (the model's tokenizer, unless the
    objective's ``prepare`` supplies it), the objective's extras, and ``image_ids`` / ``captions`` / ``skips``
    (lists, not moved to the device). Runs in the data-loader workers."""

    def __init__(self, tokenizer, objective):
        self.tokenizer, self.objective = tokenizer, objective

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        captions = [it["caption"] for it in items]
        image_ids = [it["image_id"] for it in items]
        batch: dict[str, Any] = {"image": torch.stack([it["image"] for it in items])}
        extras = self.objective.prepare(captions, image_ids, self.tokenizer)
        batch["text"] = extras.pop("text") if "text" in extras else self.tokenizer(captions)
        batch.update(extras)
        batch.update(image_ids=image_ids, captions=captions, skips=[s for it in items for s in it["skips"]])
        return batch


TENSOR_FREE_KEYS = ("image_ids", "captions", "skips")


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
            for b in micro:
                self.report.add_batch({"image_ids": [], "locations": [], "notes": []}, b["skips"])
            yield micro


def build_train_data(data: str, *, batch_size: int, rank: int, world_size: int, accum_freq: int, seed: int,
                     tokenizer, objective, transform: SeededTransform, workers: int, split: str = "train",
                     image_root: str | None = None, csv_img_key: str = "filepath", csv_caption_key: str = "title",
                     train_num_samples: int | None = None, resampled: bool = True, shuffle_buffer: int = 1000,
                     resume_count: int = 0) -> TrainData:
    """Open ``data`` and build its loader (see the module docstring)."""
    spec_is_stream = _is_stream(data)
    if not spec_is_stream:
        options: dict[str, Any] = {}
        if _is_toyworld(data):
            options["split"] = split
        elif image_root:
            options["image_root"] = image_root
        if str(data).lower().endswith((".csv", ".tsv")):
            options.update(img_key=csv_img_key, caption_key=csv_caption_key)
        source = open_source(data, **options)
        if not isinstance(source, IndexedSource):
            raise ValueError(f"{data}: not an indexed source")
    collate = Collate(tokenizer, objective)
    loader_kw = dict(num_workers=workers, collate_fn=collate, persistent_workers=workers > 0)
    if spec_is_stream:
        shards = expand_shards(data)
        if not shards:
            raise ValueError(f"no webdataset shards found for {data!r}")
        if not train_num_samples:
            raise ValueError("webdataset training needs --train-num-samples (samples per epoch), as open_clip does")
        stream = StreamPairs(shards, transform, seed, rank, world_size, resampled=resampled,
                             shuffle_buffer=shuffle_buffer, resume=resume_count)
        loader = DataLoader(stream, batch_size=batch_size, **loader_kw)
        steps = train_num_samples // (batch_size * world_size * accum_freq)
        if steps < 1:
            raise ValueError(f"--train-num-samples {train_num_samples} makes no full step of {accum_freq} x "
                             f"{world_size} x {batch_size}")
        desc = {"kind": "webdataset", "spec": str(data), "shards": len(shards), "resampled": resampled,
                "shuffle_buffer": shuffle_buffer, "samples_per_epoch": train_num_samples, "resume_count": resume_count}
        return TrainData(loader, steps, accum_freq, "stream", desc)
    dataset = IndexedPairs(source, transform, seed)
    sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world_size, accum_freq, seed)
    loader = DataLoader(dataset, batch_sampler=sampler, **loader_kw)
    desc = {"kind": type(source).__name__, "spec": str(data), "split": split if _is_toyworld(data) else None,
            "images": len(dataset), "captions": sum(len(r.captions) for r in dataset.records),
            "index_report": source.report.counts()}
    report = SkipReport().merge(source.report)
    return TrainData(loader, sampler.steps_per_epoch, accum_freq, "indexed", desc, report, sampler,
                     {r.image_id for r in dataset.records})


def _is_toyworld(data: str) -> bool:
    from pathlib import Path

    p = Path(str(data))
    return p.is_dir() and (p / "meta.json").is_file() and (p / "annotations.json").is_file()


def _is_stream(data: str) -> bool:
    from pathlib import Path

    text = str(data)
    p = Path(text)
    if p.is_dir():
        return not _is_toyworld(text) and bool(expand_shards(text))
    return ("{" in text and "}" in text) or text.lower().endswith((".tar", ".tar.gz", ".tgz"))
