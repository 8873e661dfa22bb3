"""``python -m train.adapter --unfreeze``: the adapter head trained *with* its backbone, from raw images and captions.

The cached path (``train.adapter`` without ``--unfreeze``) trains a head on features the frozen backbone computed
once. SmartCLIP's official recipe instead fine-tunes the whole CLIP (smartclip.txt §6.1 "Implementation
details": backbone lr 1e-6, mask network 1e-3, batch 1024, 248-token captions through Long-CLIP's position
stretching). This module is that mode's data path and model, for any head whose class allows it:

- **Which heads.** A head qualifies when its class sets ``supports_unfreeze = True`` and every array it reads is
  one a backbone forward produces (:data:`LIVE_KEYS`: global embeddings, patch and token states); heads that
  read detector crops or spaCy components cannot be trained through the backbone this way
  (:func:`unfreeze_support`). Nothing here knows a method by name.
- **Data** (:class:`Pairs`): images and captions of an indexed source (CSV/TSV, COCO JSON, toy world; read by
  ``extract.data.sources``) with the cached path's held-out rules (:func:`live_splits`) and its batch order
  (``train.adapter.data.epoch_batches``: every caption once per epoch, never two captions of one image in a
  batch, a pure function of (seed, epoch), so ``--resume`` is exact). Images are decoded by DataLoader
  workers with the backbone's preprocessing (the eval transform, as Long-CLIP's fine-tuning loader uses) and
  captions tokenized there too (:func:`batch_loader`). An undecodable image drops its pair from that batch
  and is reported once; on several ranks every rank then trims to the smallest local batch so gathered
  shapes agree.
- **Model** (:class:`LiveModel`): backbone + head behind the head's own interface (``encode_image`` /
  ``encode_text`` / ``loss``) over raw inputs, so the training loop's gradient caching, divergence checks and
  gradient averaging serve both modes unchanged. The backbone runs in train mode with gradients
  (``FrozenBackbone.unfreeze``); its parameters form their own AdamW groups (:func:`backbone_param_groups`).
- **Held-out evaluation** (:func:`live_heldout`): the cached evaluation (``train.adapter.heldout``) on arrays the
  *current* backbone computes for the held-out images and captions, through the same
  :class:`adapters.adapter_scorer.LiveExtractor` that evaluation and serving use, held in an in-memory
  stand-in for the feature cache (:class:`ArrayCache`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from extract.cache import is_image_key
from extract.data.sources import IndexedSource, ImageRecord, SampleDataset, Skip, SkipReport, collate_skipping, open_source
from extract.data.images import BadImage
from extract.models.tokens import tokenize_with_spans

#: arrays a backbone forward produces (``extract.models.backbone``), i.e. what a head trained through it may read
LIVE_KEYS = frozenset({"image_embed", "patch_tokens", "text_embed", "token_embed", "token_mask"})
#: arrays that come from the data alone, no backbone forward (``extract.pipeline.ShardBuilder.region_arrays`` /
#: ``tree_arrays``): computed per batch, exactly as the cache computes them (:class:`DataArrays`)
DATA_IMAGE_KEYS = frozenset({"region_masks", "region_valid"})
DATA_TEXT_KEYS = frozenset({"leaf_tokens", "node_leaves", "n_leaves", "n_nodes"})


# --------------------------------------------------------------------------------------------- which heads
def unfreeze_support(head_cls) -> str | None:
    """None when ``--unfreeze`` can train ``head_cls``; otherwise why not (for the error message)."""
    if not head_cls.supports_unfreeze:
        return f"{head_cls.__name__} does not set supports_unfreeze = True"
    needed = set(head_cls.image_keys) | set(head_cls.text_keys)
    known = LIVE_KEYS | DATA_IMAGE_KEYS | DATA_TEXT_KEYS
    if needed - known:
        return (f"it reads {sorted(needed - known)}, which neither a backbone forward nor the data alone gives "
                f"(only {sorted(known)})")
    return None


def unfreeze_methods(registry) -> list[str]:
    """Registered methods that ``--unfreeze`` can train."""
    return [name for name in registry.names() if unfreeze_support(registry.get(name)) is None]


# --------------------------------------------------------------------------------------------- data
@dataclass
class Pairs:
    """Images of an indexed source with their captions, by row: ``records[i]`` is image row i, caption row c is
    ``texts[c]`` of image ``caption_image[c]``."""

    source: IndexedSource
    records: list[ImageRecord]
    texts: list[str]
    caption_image: np.ndarray
    name: str

    @classmethod
    def open(cls, spec, split: str | None = None, **options) -> "Pairs":
        """``spec`` read with ``extract.data.sources.open_source`` (``split`` for a toy world); streaming sources are
        refused: batches need images by index."""
        if split is not None:
            options["split"] = split
        source = open_source(spec, **{k: v for k, v in options.items() if v is not None})
        if not isinstance(source, IndexedSource):
            raise ValueError(f"--unfreeze reads images by index, which {spec} (webdataset shards, a stream) does not "
                             "allow: give a CSV/TSV, COCO JSON or toy-world folder, or train without --unfreeze "
                             "(cached features)")
        records = source.records()
        return cls._of(source, records, source.name)

    @classmethod
    def _of(cls, source, records: list[ImageRecord], name: str) -> "Pairs":
        texts = [c.text for r in records for c in r.captions]
        caption_image = np.asarray([i for i, r in enumerate(records) for _ in r.captions], dtype=np.int64)
        if not records:
            raise ValueError(f"{name}: no image with a valid caption (see python -m extract.data.check)")
        return cls(source, records, texts, caption_image, name)

    @property
    def num_images(self) -> int:
        return len(self.records)

    def subset(self, image_rows: np.ndarray, name: str) -> "Pairs":
        """The images ``image_rows`` with all of their captions (rows renumbered)."""
        return Pairs._of(self.source, [self.records[int(i)] for i in np.sort(image_rows)], name)


def live_splits(args, world: Path | None) -> tuple[Pairs, np.ndarray, Pairs]:
    """(training pairs, training caption rows, held-out pairs) with the cached path's rules
    (``train.adapter.engine.load_data``): a toy world's ``val`` split, else ``--val-data``, else a seeded
    ``--val-fraction`` of the training images held out with all of their captions."""
    from extract.common.source_args import source_options
    from extract.worlds.toyworld import is_toyworld
    from train.adapter.data import caption_rows_of, split_images

    options = {"image_root": args.image_root, "unusual": args.extract_options.get("unusual"), **source_options(args)}
    train = Pairs.open(args.data, "train" if world else None, **options)
    if args.val_data:
        val = Pairs.open(args.val_data, "val" if is_toyworld(args.val_data) else None, **options)
        val.name = "val"
        return train, np.arange(len(train.texts)), val
    if world is not None:
        val = Pairs.open(world, "val", **options)
        val.name = "val"
        return train, np.arange(len(train.texts)), val
    train_images, val_images = split_images(train.num_images, args.val_fraction, args.seed)
    val = train.subset(val_images, f"val ({args.val_fraction:g} of the training images)")
    return train, caption_rows_of(train.caption_image, train_images), val


class PairDataset(Dataset):
    """Caption row -> ``(row, preprocessed image, caption, (width, height), decoded pixels or None)``, or a
    :class:`Skip` for an undecodable image. The pixels come along only with ``keep_pixels`` (a segmenter's
    regions need them)."""

    def __init__(self, pairs: Pairs, transform, keep_pixels: bool = False):
        self.pairs, self.transform, self.keep_pixels = pairs, transform, keep_pixels

    def __len__(self) -> int:
        return len(self.pairs.texts)

    def __getitem__(self, row: int):
        record = self.pairs.records[int(self.pairs.caption_image[row])]
        try:
            sample = self.pairs.source.load(record)
        except BadImage as e:
            return Skip.from_error("image", record.image_id, record.location, e)
        image = sample.image
        return (int(row), self.transform(image), self.pairs.texts[row], image.size,
                np.asarray(image) if self.keep_pixels else None)


class PairCollate:
    """Stack images, tokenize captions (in the worker): ``{"rows" [B], "pixels" [B, 3, H, W], "ids" [B, L],
    "attention_mask" [B, l], "truncated" [B], "sizes" [B, 2] (each image's (width, height)), "raws" (decoded
    pixels, or Nones), "skips": [Skip]}`` with ``l`` the longest caption of the batch
    (the cache trims token arrays the same way; ``ids`` keep the full context, which the text tower's
    position embeddings and causal mask are sized for)."""

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer, self.context_length = tokenizer, context_length

    def __call__(self, items: Sequence) -> dict:
        good = [x for x in items if not isinstance(x, Skip)]
        skips = [x for x in items if isinstance(x, Skip)]
        if not good:
            return {"rows": torch.zeros(0, dtype=torch.long), "skips": skips}
        tok = tokenize_with_spans(self.tokenizer, [g[2] for g in good], self.context_length)
        length = int(tok.attention_mask.sum(1).max())
        return {"rows": torch.tensor([g[0] for g in good]), "pixels": torch.stack([g[1] for g in good]),
                "ids": tok.ids, "attention_mask": tok.attention_mask[:, :length], "truncated": tok.truncated,
                "sizes": torch.tensor([g[3] for g in good], dtype=torch.long).reshape(-1, 2),
                "raws": [g[4] for g in good], "skips": skips}


def _loader_generator() -> torch.Generator:
    # A DataLoader draws its workers' base seed from the global RNG unless given a generator: that draw would make
    # the training RNG stream (dropout) depend on how many loaders were created, i.e. differ after --resume.
    return torch.Generator().manual_seed(0)


def batch_loader(pairs: Pairs, batches: Sequence[np.ndarray], backbone, workers: int,
                 keep_pixels: bool = False) -> DataLoader:
    """One epoch's (local) batches of caption rows, decoded and tokenized by ``workers`` processes, in order."""
    return DataLoader(PairDataset(pairs, backbone.preprocess, keep_pixels), batch_sampler=[b.tolist() for b in batches],
                      num_workers=workers, collate_fn=PairCollate(backbone.tokenizer, backbone.context_length),
                      generator=_loader_generator())


def take(batch: dict, n: int) -> dict:
    """The first ``n`` pairs of a loaded batch (ranks trim to the smallest local batch after a skipped image)."""
    return {k: (v[:n] if isinstance(v, (torch.Tensor, list)) and k != "skips" else v) for k, v in batch.items()}


class DataArrays:
    """The arrays a head reads that come from the data alone (:data:`DATA_IMAGE_KEYS`, :data:`DATA_TEXT_KEYS`:
    region masks, phrase trees), computed per batch by the extraction's own code (``ShardBuilder.region_arrays`` /
    ``tree_arrays`` of the run's live extractor), so ``--unfreeze`` trains on exactly what the cache would hold
    (tests/train/test_adapter_unfreeze_powerclip.py compares them). Trees are parsed in this process, whose parse
    memo (extract/components/text.py) spares every epoch after the first."""

    def __init__(self, builder, head_cls):
        self.builder = builder
        self.image_keys = [k for k in head_cls.image_keys if k in DATA_IMAGE_KEYS]
        self.text_keys = [k for k in head_cls.text_keys if k in DATA_TEXT_KEYS]

    def __bool__(self) -> bool:
        return bool(self.image_keys or self.text_keys)

    @property
    def needs_pixels(self) -> bool:
        return bool(self.image_keys) and self.builder.region_needs_pixels

    def images(self, image_ids: Sequence[str], sizes, raws: Sequence | None = None) -> dict[str, torch.Tensor]:
        if not self.image_keys:
            return {}
        sizes = [tuple(int(v) for v in s) for s in (sizes.tolist() if torch.is_tensor(sizes) else sizes)]
        out = self.builder.region_arrays(list(image_ids), sizes, raws)
        return {k: torch.from_numpy(out[k]) for k in self.image_keys}

    def texts(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        if not self.text_keys:
            return {}
        out = self.builder.tree_arrays(list(texts))
        return {k: torch.from_numpy(np.ascontiguousarray(out[k])) for k in self.text_keys}


# --------------------------------------------------------------------------------------------- model
class LiveModel(nn.Module):
    """Trainable backbone + head with the head's interface over raw inputs.

    ``encode_image({"pixels": [B, 3, H, W]})`` and ``encode_text({"ids": [B, L], "attention_mask": [B, l]})`` run
    the backbone (with gradients when it is unfrozen), build the arrays the head reads exactly as the cache
    defines them (``image_embed`` / ``text_embed`` normalised, ``patch_tokens`` / ``token_embed`` in the joint
    space, tokens trimmed to the mask's length) and return the head's representations; ``loss`` is the head's.
    """

    image_keys = ("pixels",)
    text_keys = ("ids", "attention_mask")

    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.directional = head.directional

    def image_arrays(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's image arrays (``image_keys``) for ``{"pixels": [B, 3, H, W]}``, with autograd; the arrays that
        come from the data (:class:`DataArrays`) are taken from the batch as they are."""
        feats = self.backbone.image_features(batch["pixels"])
        arrays = {"image_embed": feats.embedding, **{k: batch[k] for k in DATA_IMAGE_KEYS if k in batch}}
        if "patch_tokens" in self.head.image_keys:
            arrays["patch_tokens"] = feats.patches
        return {k: arrays[k] for k in self.head.image_keys}

    def text_arrays(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's caption arrays (``text_keys``) for ``{"ids": [B, L], "attention_mask": [B, l]}``."""
        mask = batch["attention_mask"].to(self.backbone.device)
        embedding, tokens = self.backbone.token_features(batch["ids"], mask)
        arrays = {"text_embed": embedding, "token_embed": tokens[:, :mask.shape[1]], "token_mask": mask,
                  **{k: batch[k] for k in DATA_TEXT_KEYS if k in batch}}
        return {k: arrays[k] for k in self.head.text_keys}

    def encode_image(self, batch: dict[str, torch.Tensor]):
        return self.head.encode_image(self.image_arrays(batch))

    def encode_text(self, batch: dict[str, torch.Tensor]):
        return self.head.encode_text(self.text_arrays(batch))

    def loss(self, image_reps, text_reps, *, rank: int = 0, world_size: int = 1):
        return self.head.loss(image_reps, text_reps, rank=rank, world_size=world_size)

    def logits(self, image_reps, text_reps):
        """The head's image->text logits (what --hard-negatives' extra columns use)."""
        return self.head.logits(image_reps, text_reps)


def backbone_param_groups(model: nn.Module, weight_decay: float, lr: float) -> list[dict]:
    """AdamW groups of an unfrozen open_clip model at ``lr``: weight decay on matrices only, as open_clip (no decay
    on gains, biases, the logit scale, class embeddings), and none on the position embeddings either: with
    ``--context-length`` the first 20 text positions are frozen by a zero-gradient hook (Long-CLIP §3.1), which a
    decoupled weight decay would still shrink."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith("positional_embedding") else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay, "lr": lr, "name": "backbone"},
                        {"params": no_decay, "weight_decay": 0.0, "lr": lr, "name": "backbone (no decay)"})
            if g["params"]]


# --------------------------------------------------------------------------------------------- held-out evaluation
class ArrayCache:
    """In-memory stand-in for :class:`extract.cache.FeatureCache` over arrays computed live: image arrays by image
    row, caption arrays by caption row (what ``train.adapter.heldout`` reads: ``gather``, ``caption_image_index``,
    ``image_ids``)."""

    def __init__(self, image_arrays: dict[str, np.ndarray], caption_arrays: dict[str, np.ndarray],
                 caption_image: np.ndarray, image_ids: list[str]):
        self.arrays = {**image_arrays, **caption_arrays}
        self._caption_image = np.asarray(caption_image, dtype=np.int64)
        self._image_ids = list(image_ids)
        self.num_images, self.num_captions = len(self._image_ids), len(self._caption_image)
        self.path, self.fingerprint = Path("(live)"), None

    @property
    def keys(self) -> list[str]:
        return sorted(self.arrays)

    def image_ids(self) -> list[str]:
        return list(self._image_ids)

    def caption_image_index(self) -> np.ndarray:
        return self._caption_image

    def gather(self, key: str, rows) -> np.ndarray:
        return self.arrays[key][np.asarray(rows, dtype=np.int64)]


@torch.no_grad()
def live_arrays(pairs: Pairs, extractor, batch_size: int, workers: int, report: SkipReport | None = None,
                desc: str = "held-out") -> ArrayCache:
    """The cache's arrays for every image and caption of ``pairs``, computed now by ``extractor`` (its backbone
    in eval mode; its train mode is restored). Undecodable images are left out with their captions."""
    from extract.common.cli import progress
    from train.adapter.heldout import concat_padded

    backbone = extractor.backbone
    was = backbone.training
    backbone.eval()
    try:
        loader = DataLoader(SampleDataset(pairs.source, None, pairs.records), batch_size=batch_size,
                            num_workers=workers, collate_fn=collate_skipping, generator=_loader_generator())
        image_parts, ids, texts, caption_image = [], [], [], []
        for good, skips in progress(loader, desc=f"encoding {desc} images", unit="batch"):
            if report is not None:
                report.add_batch(good, skips)
            if good["images"] is None:
                continue
            image_parts.append(extractor.image_arrays(good["images"], good["image_ids"]))
            for image_id, caps in zip(good["image_ids"], good["captions"]):
                caption_image += [len(ids)] * len(caps)
                texts += [c.text for c in caps]
                ids.append(image_id)
        if not ids:
            raise ValueError(f"{pairs.name}: no held-out image could be decoded")
        text_parts = [extractor.batch_text_arrays(texts[a:a + batch_size]) for a in range(0, len(texts), batch_size)]
        images, captions = concat_padded(image_parts), concat_padded(text_parts)
        return ArrayCache({k: v for k, v in images.items() if is_image_key(k)},
                          {k: v for k, v in captions.items() if not is_image_key(k)}, np.asarray(caption_image), ids)
    finally:
        backbone.train(was)


def live_heldout(pairs: Pairs, extractor, *, batch_size: int, workers: int, negatives_world: Path | None = None,
                 report: SkipReport | None = None):
    """A :class:`train.adapter.heldout.HeldOut` of ``pairs`` with arrays from the current backbone, and the toy
    world's hard negatives of its ``val`` split when ``negatives_world`` is given (texts encoded now as well)."""
    from train.adapter.heldout import attach_toyworld_negatives, heldout_split

    heldout = heldout_split(live_arrays(pairs, extractor, batch_size, workers, report), name=pairs.name)
    if negatives_world is not None:
        was = extractor.backbone.training
        extractor.backbone.eval()
        try:
            attach_toyworld_negatives(heldout, negatives_world, "val", extractor)
        finally:
            extractor.backbone.train(was)
    return heldout


# --------------------------------------------------------------------------------------------- setup
@dataclass
class LiveData:
    """Everything the loop needs in ``--unfreeze`` mode (see :func:`prepare_live`)."""

    train: Pairs
    train_rows: np.ndarray
    caption_image: np.ndarray
    val: Pairs
    world: Path | None
    negatives_world: Path | None
    extractor: object
    extraction: dict
    data_arrays: DataArrays | None = None   # region masks / trees per batch, for heads that read them
    report: SkipReport = field(default_factory=SkipReport)
    _skipped: set = field(default_factory=set)

    def heldout(self, batch_size: int, workers: int):
        return live_heldout(self.val, self.extractor, batch_size=batch_size, workers=workers,
                            negatives_world=self.negatives_world, report=self.report)

    def note_skips(self, skips: Sequence[Skip]) -> list[Skip]:
        """Record skipped training images; returns those not seen before (each is announced once)."""
        new = [s for s in skips if (s.id, s.location) not in self._skipped]
        for s in new:
            self._skipped.add((s.id, s.location))
            self.report.add(s)
        return new

    def batch_arrays(self, rows: np.ndarray, sizes, raws) -> tuple[dict, dict]:
        """(image, caption) arrays from the data for the training caption ``rows`` whose images have ``sizes`` /
        ``raws`` (:class:`DataArrays`); empty without such a head."""
        if not self.data_arrays:
            return {}, {}
        images = [self.train.records[int(i)] for i in self.caption_image[np.asarray(rows)]]
        return (self.data_arrays.images([r.image_id for r in images], sizes, raws),
                self.data_arrays.texts([self.train.texts[int(r)] for r in rows]))


def extraction_args(args, world: Path | None) -> dict:
    """The resolved ``python -m extract`` options of this run's components (what a cache's ``config.json`` holds),
    so the checkpoint's live extractor computes arrays the way the cached path's would."""
    from train.adapter.data import extraction_options

    options = extraction_options(args, args.data, "train" if world else None, device=args.device, workers=0)
    return json.loads(json.dumps(dataclasses.asdict(options), default=str))


def prepare_live(args, backbone, base_describe: dict, head_cls=None) -> LiveData:
    """Splits (:func:`live_splits`), the live extractor, the extraction description the checkpoint stores and (for
    ``head_cls`` reading region masks or trees) what computes them per batch."""
    from adapters.adapter_scorer import LiveExtractor
    from extract.worlds.toyworld import is_toyworld

    world = Path(args.data) if is_toyworld(args.data) else None
    train, train_rows, val = live_splits(args, world)
    ex_args = extraction_args(args, world)
    extractor = LiveExtractor(backbone, ex_args, annotations=world)
    extraction = {"fingerprint": None, "path": None, "live": True, "args": ex_args,
                  "settings": {"backbone": base_describe, **extractor.settings(),
                               "summary": f"{args.base} on {train.name}: live ({','.join(args.components)})"}}
    negatives_world = world if not args.val_data else (Path(args.val_data) if is_toyworld(args.val_data) else None)
    data_arrays = DataArrays(extractor.builder, head_cls) if head_cls is not None else None
    return LiveData(train, train_rows, train.caption_image, val, world, negatives_world, extractor, extraction,
                    data_arrays or None)
