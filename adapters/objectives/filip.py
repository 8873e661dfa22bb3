"""FILIP (Yao et al. 2022, "Fine-grained Interactive Language-Image Pre-training"): contrastive learning on a
token-wise late-interaction similarity instead of the global embeddings.

For image i with patch embeddings x_k and text j with token embeddings y_l (both L2-normalised, FILIP §3.1.1):

- image-to-text similarity ``s^I_ij = mean over i's patches k of max over j's tokens l <x_k, y_l>``
- text-to-image similarity ``s^T_ij = mean over j's tokens l of max over i's patches k <x_k, y_l>``

and the loss is InfoNCE on ``s^I`` for image->text and on ``s^T`` for text->image (FILIP eq. 4-5), with CLIP's
learnt temperature. Padding never takes part: a padded text token is neither a candidate of a max nor a term of
a mean (the paper: "we only consider the non-padded tokens"). The start-of-text token is left out too: under the
causal mask it sees nothing but itself, so its embedding is the same for every caption and would add a
caption-independent term to ``s^T``. The class token is left out of the image side (patches only).

The [b, B, K, L] token similarities are computed in chunks of images with the chunk recomputed in the backward
pass (``torch.utils.checkpoint``), so memory stays bounded by ``--filip-chunk``. On many ranks each rank scores
its images against every text and every image against its texts (the ``local_loss`` pattern of
:mod:`adapters.losses.contrastive`), so two ranks give one process's loss and gradients.

Evaluation scores with the same late interaction (:class:`FILIPScorer`, as the FILIP paper does for retrieval
and zero-shot); ``adapters.load.load_scorer`` picks it from the checkpoint's JSON. It reads its representations
from a feature cache too (``--components patches,tokens``), so ``train.eval --cache`` scores a cached collection
and ``serve.index`` indexes one: the first stage searches the mean of each item's unit token vectors, an
approximation, and re-ranking scores the candidates with the late interaction itself.
"""
from __future__ import annotations

import argparse
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.losses.contrastive import gather, local_rows
from adapters.objectives.base import Features, StepContext
from adapters.objectives.towers import encode_image, encode_text, normalize, token_mask
from adapters.objectives.clip import CLIPObjective
from adapters.registry import PRETRAIN
from adapters.scoring import CacheReadable


def _block(img: Tensor, img_mask: Tensor | None, txt: Tensor, txt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(s^I, s^T) [bi, bj] for a block of images [bi, K, D] against texts [bj, L, D] (unit rows).

    ``txt`` must already have its padded tokens replaced by a real token of the same caption (see
    :func:`filip_similarities`): a duplicate never changes a max, so the max over a caption's tokens needs no
    mask; means use the masks. img_mask None = every patch is real (training), which skips a pass.
    """
    bi, k, d = img.shape
    bj, length, _ = txt.shape
    sim = (img.reshape(bi * k, d) @ txt.reshape(bj * length, d).T).view(bi, k, bj, length)
    best_token = sim.amax(dim=3)  # [bi, K, bj]: each patch's best token of each caption
    if img_mask is None:
        s_i = best_token.mean(dim=1)
        best_patch = sim.amax(dim=1)  # [bi, bj, L]
    else:
        im = img_mask.to(sim.dtype)
        s_i = (best_token * im[:, :, None]).sum(1) / im.sum(1, keepdim=True).clamp_min(1)
        best_patch = sim.masked_fill(~img_mask[:, :, None, None], torch.finfo(sim.dtype).min).amax(dim=1)
    tm = txt_mask.to(sim.dtype)[None]  # [1, bj, L]
    s_t = (best_patch * tm).sum(-1) / tm.sum(-1).clamp_min(1)
    return s_i, s_t


def _fill_padding(txt: Tensor, txt_mask: Tensor) -> Tensor:
    """Padded token rows replaced by the caption's last real token (a duplicate: no max changes, and the
    gradient a max sends to it reaches that token). A caption without real tokens keeps its rows (masked out
    of every mean anyway)."""
    positions = torch.arange(txt.shape[1], device=txt.device)
    last = torch.where(txt_mask, positions, torch.zeros_like(positions)).amax(dim=1)  # [bj]
    source = torch.where(txt_mask, positions, last[:, None])  # [bj, L]
    return torch.gather(txt, 1, source[..., None].expand(-1, -1, txt.shape[-1]))


def filip_similarities(img: Tensor, img_mask: Tensor | None, txt: Tensor, txt_mask: Tensor, *,
                       chunk: int = 0, max_elements: int = 1 << 27) -> tuple[Tensor, Tensor]:
    """Token-wise similarities s^I, s^T [Bi, Bj] (FILIP eq. 2-3) of every image against every text.

    img [Bi, K, D], txt [Bj, L, D]: L2-normalised token embeddings; img_mask [Bi, K] (None: all real),
    txt_mask [Bj, L]: bool, True = a real token. Captions are cut to the longest real length of the batch first.
    Computed in fp32 for ``chunk`` images at a time (0: as many as keep chunk x Bj x K x L under ``max_elements``);
    under autograd, when the images do not fit one chunk, each chunk is recomputed in the backward pass
    (``torch.utils.checkpoint``) so peak memory stays that bound.
    """
    with torch.autocast(device_type=img.device.type, enabled=False):
        img, txt = img.float(), txt.float()
        txt_mask = txt_mask.bool()
        length = max(1, int(txt_mask.any(0).nonzero().max()) + 1) if txt_mask.any() else 1
        txt, txt_mask = _fill_padding(txt[:, :length], txt_mask[:, :length]), txt_mask[:, :length]
        if img_mask is not None:
            img_mask = img_mask.bool()
            if bool(img_mask.all()):
                img_mask = None
        if chunk <= 0:
            chunk = max(1, max_elements // max(1, txt.shape[0] * img.shape[1] * length))
        grad = torch.is_grad_enabled() and (img.requires_grad or txt.requires_grad)
        s_i, s_t = [], []
        for s in range(0, len(img), chunk):
            args = (img[s:s + chunk], None if img_mask is None else img_mask[s:s + chunk], txt, txt_mask)
            a, b = (torch.utils.checkpoint.checkpoint(_block, *args, use_reentrant=False)
                    if grad and len(img) > chunk else _block(*args))
            s_i.append(a)
            s_t.append(b)
        return torch.cat(s_i), torch.cat(s_t)


def filip_loss(img: Tensor, img_mask: Tensor | None, txt: Tensor, txt_mask: Tensor, logit_scale: Tensor, *,
               rank: int = 0, world_size: int = 1, local_loss: bool = True, gather_with_grad: bool = True,
               chunk: int = 0) -> Tensor:
    """FILIP's contrastive loss (eq. 4-5) on the local batch; features are gathered over ranks inside.
    img_mask None: every patch is real."""
    g = lambda x: gather(x, rank, world_size, with_grad=gather_with_grad)  # noqa: E731
    g_mask = lambda m: gather(m.to(torch.uint8), rank, world_size, with_grad=False, keep_local_grad=False).bool()  # noqa: E731
    all_img, all_txt = g(img), g(txt)
    all_imask = None if img_mask is None else g_mask(img_mask)
    all_tmask = g_mask(txt_mask)
    if world_size > 1 and local_loss:
        labels = local_rows(len(img), rank, world_size, img.device)
        s_i, _ = filip_similarities(img, img_mask, all_txt, all_tmask, chunk=chunk)  # my images vs all texts
        _, s_t = filip_similarities(all_img, all_imask, txt, txt_mask, chunk=chunk)  # all images vs my texts
        logits_i, logits_t = logit_scale * s_i, logit_scale * s_t.T
    else:
        labels = torch.arange(len(all_img), device=img.device)
        s_i, s_t = filip_similarities(all_img, all_imask, all_txt, all_tmask, chunk=chunk)
        logits_i, logits_t = logit_scale * s_i, logit_scale * s_t.T
    return 0.5 * (F.cross_entropy(logits_i.float(), labels) + F.cross_entropy(logits_t.float(), labels))


@PRETRAIN.register("filip")
class FILIPObjective(CLIPObjective):
    """Token-wise late-interaction contrastive loss. Features: normalised ``patch_tokens`` [b, K, D],
    ``text_tokens`` [b, L, D] with ``text_mask`` [b, L], and ``logit_scale``."""

    def __init__(self, chunk: int = 0):
        self.chunk = chunk

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("filip")
        g.add_argument("--filip-chunk", type=int, default=0,
                       help="filip: images per chunk of the token-similarity tensor (0: up to 2^27 floats a chunk); "
                            "bounds memory, never changes the result")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FILIPObjective":
        return cls(chunk=args.filip_chunk)

    def config(self) -> dict:
        return {"text_tokens": "after start-of-text through end-of-text", "image_tokens": "patches"}

    def features(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext) -> Features:
        image = encode_image(model, batch["image"], patches=True)
        text = encode_text(model, batch["text"], tokens=True)
        return {"patch_tokens": normalize(image.patches), "text_tokens": normalize(text.tokens),
                "text_mask": token_mask(batch["text"], include_sot=False), "logit_scale": model.logit_scale.exp()}

    def loss(self, features: Features, ctx: StepContext) -> dict[str, Tensor]:
        f = features
        loss = filip_loss(f["patch_tokens"], None, f["text_tokens"], f["text_mask"], f["logit_scale"],
                          rank=ctx.rank, world_size=ctx.world_size, local_loss=ctx.local_loss,
                          gather_with_grad=ctx.gather_with_grad, chunk=self.chunk)
        return {"loss": loss, "filip": loss.detach()}

    def text_side(self, model: nn.Module, text: Tensor) -> Features:
        return {"text_tokens": normalize(encode_text(model, text, tokens=True).tokens),
                "text_mask": token_mask(text, include_sot=False)}

    def image_text_logits(self, features: Features, texts: Features) -> Tensor:
        """s^I (FILIP eq. 2), the image->text direction of its loss, scaled."""
        s_i, _ = filip_similarities(features["patch_tokens"], None, texts["text_tokens"], texts["text_mask"],
                                    chunk=self.chunk)
        return features["logit_scale"] * s_i

    @staticmethod
    def scorer(backbone, name: str | None = None) -> "FILIPScorer":
        """How a FILIP-trained checkpoint is evaluated (see :class:`FILIPScorer`)."""
        return FILIPScorer(backbone, name)


class FILIPScorer(CacheReadable):
    """An :class:`adapters.scoring.Scorer` scoring with FILIP's late interaction on a frozen backbone: image
    reps are the normalised patch embeddings, text reps the normalised token embeddings after start-of-text
    with their mask. Retrieval is directional, as in FILIP: texts are ranked for an image by s^I (image-to-
    text, eq. 2) and images for a text by s^T (eq. 3); a single score per pair (compositional benchmarks,
    zero-shot) is their mean (s^I + s^T) / 2."""

    directional = True

    def __init__(self, backbone, name: str | None = None, chunk: int = 0):
        self.backbone, self.name, self.chunk = backbone, name or "filip", chunk
        self.preprocess = backbone.preprocess
        self.device = backbone.device

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> dict[str, Tensor]:
        patches = self.backbone.encode_images(images.to(self.device)).patches
        return {"patches": F.normalize(patches.float(), dim=-1)}

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> dict[str, Tensor]:
        t = self.backbone.encode_texts(list(texts))
        mask = t.attention_mask.clone()
        mask[:, 0] = False  # start-of-text: see the module docstring
        return {"tokens": F.normalize(t.tokens.float(), dim=-1), "mask": mask}

    @torch.no_grad()
    def _both(self, image_reps: dict[str, Tensor], text_reps: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return filip_similarities(image_reps["patches"], None, text_reps["tokens"], text_reps["mask"], chunk=self.chunk,
                                  max_elements=1 << 25)

    def score(self, image_reps: dict[str, Tensor], text_reps: dict[str, Tensor]) -> Tensor:
        s_i, s_t = self._both(image_reps, text_reps)
        return 0.5 * (s_i + s_t)

    def score_directed(self, image_reps: dict[str, Tensor], text_reps: dict[str, Tensor], direction: str) -> Tensor:
        """[I, T] scores for ``direction`` "i2t" (s^I: images rank texts) or "t2i" (s^T: texts rank images)."""
        s_i, s_t = self._both(image_reps, text_reps)
        if direction not in ("i2t", "t2i"):
            raise ValueError(f"direction must be 'i2t' or 't2i', got {direction!r}")
        return s_i if direction == "i2t" else s_t

    # -- the feature cache (serve.index, serve.search's re-ranking, train.eval.evaluate --cache) -------------------------
    # The arrays of ``python -m extract --components patches,tokens`` under the same backbone are what
    # encode_images / encode_texts compute, stored in fp16: reading them gives the live representations to fp16
    # rounding, so a collection is indexed and re-ranked without re-encoding it.
    cache_components = ("patches", "tokens")

    def text_tower(self):
        return self.backbone

    def check_cache(self, cache) -> None:
        """The cache must come from this backbone and hold the patch and token embeddings it scores with."""
        from adapters.scoring import check_cache_backbone

        check_cache_backbone(self, cache)
        missing = sorted({k for side in ("image", "text") for k in self.cache_keys(side)} - set(cache.keys))
        if missing:
            raise ValueError(f"--cache {cache.path} lacks the arrays {missing} that {self.name} scores with: extract "
                             f"the retrieval data with --components {','.join(self.cache_components)}, or drop --cache")

    def cache_keys(self, side: str) -> tuple[str, ...]:
        """The cache arrays :meth:`encode_arrays` reads per item of ``side`` ("image" / "text")."""
        if side not in ("image", "text"):
            raise ValueError(f"side must be 'image' or 'text', got {side!r}")
        return ("patch_tokens",) if side == "image" else ("token_embed", "token_mask")

    @torch.no_grad()
    def encode_arrays(self, arrays: dict, side: str) -> dict[str, Tensor]:
        """The representations of :meth:`encode_images` / :meth:`encode_texts` from cached arrays (numpy or
        tensors, first dimension = items): images ``patch_tokens`` [B, K, D] -> unit ``patches``; texts
        ``token_embed`` [B, L, D] and ``token_mask`` [B, L] -> unit ``tokens`` and the mask without start-of-text,
        both padded to the backbone's text context [B, C, ...] as :meth:`encode_texts` gives them (padding False)."""
        if side == "image":
            patches = torch.as_tensor(np.asarray(arrays["patch_tokens"])).float()
            return {"patches": F.normalize(patches, dim=-1).to(self.device)}
        if side != "text":
            raise ValueError(f"side must be 'image' or 'text', got {side!r}")
        mask = torch.as_tensor(np.asarray(arrays["token_mask"])).bool().clone()
        mask[:, 0] = False  # start-of-text, as encode_texts
        tokens = F.normalize(torch.as_tensor(np.asarray(arrays["token_embed"])).float(), dim=-1)
        # A cache trims tokens to each shard's longest caption, so batches from two shards would differ in length
        # and not concatenate (train.eval.evaluate --cache, served recall) nor stack (serve.stage2); the context length
        # is every batch's. Padding is masked out of every max and mean, so no score changes.
        pad = int(getattr(self.backbone, "context_length", 0) or 0) - tokens.shape[1]
        if pad > 0:
            tokens = F.pad(tokens, (0, 0, 0, pad))
            mask = F.pad(mask, (0, pad), value=False)
        return {"tokens": tokens.to(self.device), "mask": mask.to(self.device)}

    # -- serving: the first stage (adapters.heads.base.AdapterHead explains the contract) ------------------------------
    # Late interaction has no exact one-vector form. The mean of an item's unit token vectors stands in:
    # <mean_k x_k, mean_l y_l> is the mean of all token similarities (normalising the means rescales it per item),
    # of which s^I / s^T keep the best per token. Not the global embedding: FILIP's loss never reads it, so after FILIP pre-training it is close to
    # untrained (measured on a 600-scene toy world's test split, 60 images / 266 captions, the tiny backbone after
    # 6 FILIP epochs: R@10 t2i / i2t 39.1 / 28.3 with mean tokens, 29.7 / 15.0 with the global embedding, 60.2 /
    # 63.3 with FILIP's own score).
    # An approximation, not a bound: an item the late interaction ranks high can rank low here, so a served
    # search without re-ranking says so (serve.search adds this note), and one with rerank=K covering the
    # collection ranks exactly as FILIP's own score.
    first_stage_note = ("its first stage (the mean of its unit token vectors) only approximates FILIP's "
                        "late-interaction score: rerank=K re-scores the first K candidates with that score")

    def first_stage_image(self, image_reps: dict[str, Tensor], direction: str = "t2i") -> Tensor:
        """[I, D]: the normalised mean of the image's normalised patch embeddings (both directions)."""
        _check_direction(direction)
        return F.normalize(image_reps["patches"].float().mean(dim=1), dim=-1)

    def first_stage_text(self, text_reps: dict[str, Tensor], direction: str = "t2i") -> Tensor:
        """[T, D]: the normalised mean of the caption's real tokens (the mask of :meth:`encode_texts`: no padding,
        no start-of-text); a caption without real tokens gives a zero vector."""
        _check_direction(direction)
        mask = text_reps["mask"].to(text_reps["tokens"].device).float()
        total = (text_reps["tokens"].float() * mask[..., None]).sum(dim=1)
        return F.normalize(total / mask.sum(dim=1, keepdim=True).clamp_min(1), dim=-1)


def _check_direction(direction: str) -> None:
    if direction not in ("i2t", "t2i"):
        raise ValueError(f"direction must be 'i2t' or 't2i', got {direction!r}")
