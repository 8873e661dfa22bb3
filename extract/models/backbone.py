"""Frozen open_clip backbones that return global embeddings *and* per-patch / per-token embeddings.

Compositional heads need more than the pooled vectors open_clip returns: they pool patch tokens inside
regions and token embeddings inside phrases, in the joint (contrastive) space. We obtain those without
re-implementing any tower: a forward hook captures the residual stream at the output of each tower's
transformer, and we apply the tower's own final norm and projection to every token.

- CLIP ViT (OpenAI / LAION): patch_i = ln_post(x_i) @ proj; the global embedding is the same map applied to
  the class token, so patches live in exactly the space the global embedding lives in.
- CoCa: the contrastive embedding comes from an attentional pooler over patches, and no per-patch
  projection exists. We use the pooler's value path, out_proj(W_v ln_k(x_i)) — exactly what the pooler
  returns when it attends to patch i alone (the MaskCLIP reading of attention pooling, Zhou et al. 2022) —
  followed by ln_post and proj.
- Text: token_t = ln_final(x_t) @ text_projection; the global embedding is that map at the end-of-text token
  (CLIP) or at CoCa's appended class token.

``load_backbone`` resolves the weights before it builds anything, so an absent checkpoint fails in
well under a second with a message naming the file (see ``extract.models.weights``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from extract.common.cli import Parser, run_job
from extract.models.tokens import TokenizedText, tokenize_with_spans, tokenizer_for
from extract.models.weights_file import load_weights_file, weights_come_later
from extract.models.weights import (ResolvedWeights, WeightsNotFoundError, checkpoint_sidecar, file_sha256,
                             resolve_weights)

log = logging.getLogger(__name__)


class _NoRandomInitWarning(logging.Filter):
    """open_clip warns "No pretrained weights loaded for model ..." on the root logger every time a model is built
    with pretrained=None, which is how plugvlm always builds one: it loads the weights itself afterwards, so the
    warning is wrong for every file or tag and was printed 9 times by the demo. What is loaded is said once, by
    the job (``FrozenBackbone.describe``); this filter drops that one message and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No pretrained weights loaded for model")


def quiet_open_clip() -> None:
    """Install :class:`_NoRandomInitWarning` on the root logger (idempotent)."""
    root = logging.getLogger()
    if not any(isinstance(f, _NoRandomInitWarning) for f in root.filters):
        root.addFilter(_NoRandomInitWarning())


quiet_open_clip()

_HERE = Path(__file__).resolve().parent
MODEL_CONFIG_DIR = _HERE / "model_configs"
ALIASES_FILE = _HERE / "backbones.json"


# --------------------------------------------------------------------------------------------- registry
@lru_cache(maxsize=1)
def register_configs() -> None:
    """Make the tiny configs (plugvlm-tiny, plugvlm-tiny-coca, plugvlm-tiny-rn, ...) visible to open_clip, once."""
    import open_clip

    open_clip.add_model_config(MODEL_CONFIG_DIR)


@lru_cache(maxsize=1)
def backbone_aliases() -> dict[str, dict]:
    """The ``--base`` aliases (data, in backbones.json): alias -> {model, pretrained, quick_gelu, ...}."""
    table = json.loads(ALIASES_FILE.read_text())
    return {k: v for k, v in table.items() if not k.startswith("_")}


@dataclass(frozen=True)
class BackboneSpec:
    """What to build: a ``--base`` alias or open_clip model name, resolved to an architecture and weights.

    base: what the user typed; model: open_clip architecture; pretrained: tag, path, or None (random).
    """

    base: str
    model: str
    pretrained: str | None
    quick_gelu: bool = False
    requires_file: bool = False
    hint: str | None = None
    crop_scale: float = 1.0  # entity crops: the square's side / the object's (backbones.json "crop_scale")
    phrase_prompt: str = "{}"  # entity / subject / object phrases as the text tower reads them ("phrase_prompt")


def resolve_spec(base: str, pretrained: str | None = None) -> BackboneSpec:
    """Resolve ``base`` (alias or any open_clip model name) and ``pretrained`` (None: the alias's default;
    "none": random weights; else a tag or a path)."""
    import open_clip

    register_configs()
    alias = backbone_aliases().get(base)
    if alias is None:
        if base not in open_clip.list_models():
            raise ValueError(
                f"unknown backbone '{base}'. Aliases: {', '.join(backbone_aliases())}; "
                f"or any open_clip model name (open_clip.list_models(), e.g. ViT-B-32, ViT-SO400M-14-SigLIP).")
        alias = {"model": base, "pretrained": None}
    shipped = alias.get("file") and str(_HERE / alias["file"])  # weights that come with plugvlm (extract/models/bases/)
    tag = (shipped or alias.get("pretrained")) if pretrained is None else pretrained
    return BackboneSpec(base=base, model=alias["model"], pretrained=tag,
                        quick_gelu=bool(alias.get("quick_gelu", False)),
                        requires_file=bool(alias.get("requires_file", False)), hint=alias.get("weights_hint"),
                        crop_scale=float(alias.get("crop_scale", 1.0)),
                        phrase_prompt=str(alias.get("phrase_prompt", "{}")))


def trained_holdout(base: str, pretrained: str | None = None) -> list[str]:
    """The toy-world combinations ("yellow circle", ...) held out of the data the weights of ``base`` were
    pre-trained on, as their ``python -m train.pretrain`` description (``model.json``: ``data.holdout``) records
    them; [] for weights without one (a tag, random weights, another checkpoint)."""
    spec = resolve_spec(base, pretrained)
    if not spec.pretrained or spec.pretrained == "none" or not Path(spec.pretrained).is_file():
        return []
    sidecar = checkpoint_sidecar(spec.pretrained) or {}
    return sorted((sidecar.get("data") or {}).get("holdout") or [])


# --------------------------------------------------------------------------------------------- outputs
@dataclass
class ImageFeatures:
    """Backbone outputs for a batch of B images.

    embedding: [B, D] L2-normalised global embedding (identical to open_clip's encode_image(normalize=True)).
    patches: [B, N, D] patch tokens in the joint space, N = grid[0] * grid[1] in row-major order; NOT
        normalised (region pooling averages first, then normalises).
    grid: (rows, cols) of the patch grid.
    """

    embedding: torch.Tensor
    patches: torch.Tensor
    grid: tuple[int, int]


@dataclass
class TextFeatures:
    """Backbone outputs for a batch of B captions, L = context length.

    embedding: [B, D] L2-normalised global embedding (identical to open_clip's encode_text(normalize=True)).
    tokens: [B, L, D] token embeddings in the joint space, NOT normalised; padding positions hold
        whatever the tower computed there and must be ignored through ``attention_mask``.
    attention_mask: [B, L] bool, True for start/end-of-text and caption tokens.
    spans: [B, L, 2] long, [start, end) character offsets of each token in its caption (-1 for specials/pad).
    truncated: [B] bool, True where the caption was longer than the context and was cut.
    """

    embedding: torch.Tensor
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    spans: torch.Tensor
    truncated: torch.Tensor


# --------------------------------------------------------------------------------------------- towers
def _project(x: torch.Tensor, proj) -> torch.Tensor:
    if proj is None:
        return x
    return proj(x) if isinstance(proj, nn.Module) else x @ proj


def trimmed_text_length(model: nn.Module, ids: torch.Tensor) -> int | None:
    """The columns of ``ids`` [B, L] an open_clip ``CLIP`` text tower needs: up to the batch's last end-of-text token,
    or None where cutting the padding off could change a result (a CoCa or other custom text tower, a tower without
    the causal mask or not pooled at the end-of-text token, an empty batch).

    The mask is causal, so no token before the end-of-text attends to the padding after it, and the pooled
    embedding is the end-of-text token's (``argmax``: SimpleTokenizer's end-of-text has the largest id): both are
    the same on the trimmed columns up to float rounding, at the cost of the batch's longest caption (extract/README,
    "Frozen backbones": 62 of 77 columns for a batch of the toy world's training captions, 7 for short ones)."""
    if getattr(model, "text", None) is not None or getattr(model, "attn_mask", None) is None or not len(ids):
        return None
    if getattr(model, "text_pool_type", None) != "argmax":
        return None
    return int(ids.argmax(dim=-1).max()) + 1


def encode_text_columns(model: nn.Module, ids: torch.Tensor, length: int,
                        tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """open_clip's ``CLIP.encode_text`` on the first ``length`` columns of ``ids`` (:func:`trimmed_text_length`),
    step for step with the model's own modules and the matching rows of its positions and causal mask. Returns
    (pooled [B, D] before normalisation, and with ``tokens`` every column's joint-space embedding [B, length, D]:
    ``ln_final(x_t) @ text_projection``, the map that makes the end-of-text token the pooled one; else None)."""
    from open_clip.transformer import text_global_pool

    ids = ids[:, :length]
    cast_dtype = model.transformer.get_cast_dtype()
    x = model.token_embedding(ids).to(cast_dtype) + model.positional_embedding[:length].to(cast_dtype)
    mask = model.attn_mask if model.attn_mask is None else model.attn_mask[:length, :length]
    x = model.ln_final(model.transformer(x, attn_mask=mask))
    pooled = text_global_pool(x, ids, model.text_pool_type, eos_token_id=getattr(model, "text_eos_id", None))
    return _project(pooled, model.text_projection), _project(x, model.text_projection) if tokens else None


def _value_path(pooler: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """AttentionalPooler output when each query attends to a single token: out_proj(W_v ln_k(x) + b_v)."""
    mha: nn.MultiheadAttention = pooler.attn
    e = mha.embed_dim
    w_v = mha.in_proj_weight[2 * e:] if mha._qkv_same_embed_dim else mha.v_proj_weight
    b_v = mha.in_proj_bias[2 * e:] if mha.in_proj_bias is not None else None
    return mha.out_proj(F.linear(pooler.ln_k(x), w_v, b_v))


def resnet_tokens(attnpool: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-position tokens of a ModifiedResNet's attention pool [B, h*w, D] from its input map [B, C, h, w]:
    the pool's output when a query attends to a single position, ``c_proj(v_proj(x_n + pos_n))`` (MaskCLIP, Zhou
    et al. 2022, Sec. 3.2: CLIP's dense features are the value-embedding path of its attention pool)."""
    x = x.flatten(2).transpose(1, 2) + attnpool.positional_embedding[1:].to(x.dtype)
    return attnpool.c_proj(attnpool.v_proj(x))


def is_vit(visual: nn.Module) -> bool:
    """An open_clip ``VisionTransformer`` (patch embedding, class token, positions, a transformer)."""
    return all(hasattr(visual, a) for a in ("conv1", "transformer", "positional_embedding", "class_embedding",
                                            "ln_post", "grid_size"))


def is_resnet(visual: nn.Module) -> bool:
    """An open_clip ``ModifiedResNet`` (CLIP's RN50-style tower: conv stem, four stages, attention pooling)."""
    return all(hasattr(visual, a) for a in ("layer4", "attnpool"))


def image_grid(visual: nn.Module) -> tuple[int, int]:
    """(rows, cols) of an open_clip image tower's patch tokens: a ViT's patch grid, or the final feature map of a
    ModifiedResNet (image side / 32), whose positions :func:`resnet_tokens` turns into tokens."""
    if is_resnet(visual):
        side = math.isqrt(visual.attnpool.positional_embedding.shape[0] - 1)
        return side, side
    return tuple(visual.grid_size)


class _Capture:
    """Forward hook that keeps the last output of a module (the tower's transformer), per thread: a hook runs in the
    thread that called forward, so concurrent encodings (a server's parallel requests) each read their own."""

    def __init__(self, module: nn.Module):
        self._local = threading.local()
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        self._local.value = output[0] if isinstance(output, tuple) else output

    def pop(self) -> torch.Tensor:
        value, self._local.value = getattr(self._local, "value", None), None
        if value is None:
            raise RuntimeError("the tower's transformer did not run; cannot read its tokens")
        return value


class FrozenBackbone(nn.Module):
    """An open_clip model in eval mode with no gradients, plus its tokenizer and eval preprocessing.

    ``encode_images`` / ``encode_texts`` return :class:`ImageFeatures` / :class:`TextFeatures`. The module
    stays in eval mode even when a parent calls ``.train()`` (dropout or patch dropout would change
    cached features).

    Fine-tuning (``python -m train.adapter --unfreeze``) calls :meth:`unfreeze`: the weights then require
    gradients and ``.train()`` reaches the model; :meth:`image_features` / :meth:`token_features` are the
    same computations as ``encode_images`` / ``encode_token_ids`` without ``torch.no_grad``.
    """

    def __init__(self, model: nn.Module, tokenizer, preprocess, spec: BackboneSpec, weights: ResolvedWeights,
                 precision: str = "fp32", init_seed: int | None = None):
        super().__init__()
        self.init_seed = init_seed
        self.trainable = False
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.preprocess = preprocess
        self.spec = spec
        self.weights = weights
        self.precision = precision
        self._check_supported()
        visual = model.visual
        self.grid: tuple[int, int] = image_grid(visual)
        self.image_size: tuple[int, int] = tuple(visual.image_size) if isinstance(visual.image_size, (tuple, list)) \
            else (visual.image_size, visual.image_size)
        self.context_length: int = tokenizer.context_length
        self._vision_capture = _Capture(visual.layer4 if is_resnet(visual) else visual.transformer)
        self._text_capture = _Capture(self._text_parts()[0])
        self.embed_dim: int = visual.output_dim

    # -- structure ---------------------------------------------------------------------------------
    def _check_supported(self) -> None:
        visual = self.model.visual
        if not (is_vit(visual) or is_resnet(visual)):
            raise NotImplementedError(
                f"{self.spec.model}: patch tokens are available for open_clip VisionTransformer and ModifiedResNet "
                f"towers only; this model's image tower is {type(visual).__name__} (timm towers are not supported "
                "yet).")
        text = getattr(self.model, "text", None)
        if text is not None and not hasattr(text, "ln_final"):
            raise NotImplementedError(
                f"{self.spec.model}: token embeddings are available for open_clip text transformers only; "
                f"this model's text tower is {type(text).__name__} (Hugging Face text towers are not supported yet).")

    def _text_parts(self):
        """(transformer, ln_final, projection, has_appended_cls) for CLIP and CustomTextCLIP/CoCa alike."""
        text = getattr(self.model, "text", None)
        if text is None:  # open_clip.CLIP keeps the text tower's parts on the model itself
            m = self.model
            return m.transformer, m.ln_final, m.text_projection, False
        return text.transformer, text.ln_final, text.text_projection, getattr(text, "cls_emb", None) is not None

    def train(self, mode: bool = True):  # noqa: D401 - frozen on purpose (unless unfrozen)
        super().train(mode and self.trainable)
        # BatchNorm (the ResNet towers) keeps its pre-trained statistics when fine-tuned ("frozen BN", as detectors
        # fine-tune their backbones), its scale and shift still train: a fine-tune's batch statistics would be those
        # of each process's share of the batch, so two processes would train another model than one (measured:
        # every weight apart by ~2 steps), and small batches would make them noisy
        for m in self.model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
        return self

    def unfreeze(self) -> "FrozenBackbone":
        """Make every weight trainable (full fine-tuning): gradients on, and ``.train()`` now switches the
        model to train mode (dropout, patch dropout as configured; BatchNorm keeps its statistics: :meth:`train`).
        ``encode_*`` stay gradient-free."""
        self.trainable = True
        self.model.requires_grad_(True)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.visual.parameters()).dtype

    # -- images ------------------------------------------------------------------------------------
    def _patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
        visual = self.model.visual
        if is_resnet(visual):
            return resnet_tokens(visual.attnpool, x)
        patches = x[:, 1:]  # drop the class token; eval mode has no patch dropout, so all N patches remain
        if visual.attn_pool is None:
            return _project(visual.ln_post(patches), visual.proj)
        if visual.attn_pool_contrastive is None:  # open_clip's CoCa: attn_pool -> ln_post -> proj
            return _project(visual.ln_post(_value_path(visual.attn_pool, patches)), visual.proj)
        patches = visual.ln_post(patches)  # 'parallel' / 'cascade' poolers normalise first
        if visual.attn_pool_type == "cascade":
            patches = _value_path(visual.attn_pool, patches)
        return _project(_value_path(visual.attn_pool_contrastive, patches), visual.proj)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> ImageFeatures:
        """images: [B, 3, H, W] already preprocessed (``self.preprocess``); returns :class:`ImageFeatures`."""
        return self.image_features(images)

    def image_features(self, images: torch.Tensor) -> ImageFeatures:
        """:meth:`encode_images` with autograd as the caller has it (gradients reach unfrozen weights)."""
        images = images.to(device=self.device, dtype=self.dtype)
        embedding = self.model.encode_image(images, normalize=True)
        patches = self._patch_tokens(self._vision_capture.pop())
        return ImageFeatures(embedding=embedding.float(), patches=patches.float(), grid=self.grid)

    # -- texts -------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenizedText:
        """Token ids exactly as the backbone's tokenizer gives them, with masks, spans and truncation flags."""
        return tokenize_with_spans(self.tokenizer, list(texts), self.context_length)

    @torch.no_grad()
    def encode_token_ids(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids / attention_mask: [B, L]. Returns (normalised global [B, D], joint-space tokens [B, L, D])."""
        return self.token_features(ids, attention_mask)

    def token_features(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode_token_ids` with autograd as the caller has it (gradients reach unfrozen weights).

        A CLIP text tower runs on the columns up to the batch's last end-of-text token only
        (:func:`trimmed_text_length`); the padding columns after it, which every reader masks, hold zeros."""
        _, ln_final, projection, has_cls = self._text_parts()
        length = trimmed_text_length(self.model, ids)  # before the move: ids from the tokenizer are on the CPU, no sync
        ids = ids.to(self.device)
        if length is not None and length < ids.shape[1]:
            pooled, tokens = encode_text_columns(self.model, ids, length, tokens=True)
            self._text_capture.pop()  # the hook saw the trimmed transformer's output: not read again
            tokens = F.pad(tokens, (0, 0, 0, ids.shape[1] - length))
            return F.normalize(pooled, dim=-1).float(), tokens.float()
        embedding = self.model.encode_text(ids, normalize=True)
        x = self._text_capture.pop()
        if has_cls:  # CoCa appends a class token after the sequence; it is the global embedding's source
            x = x[:, :-1]
        tokens = _project(ln_final(x), projection)
        return embedding.float(), tokens.float()

    @torch.no_grad()
    def encode_each(self, texts: Sequence[str]) -> torch.Tensor:
        """Normalised global embeddings [n, D] of ``texts``, each computed alone: a batch of one, on its own columns
        (:func:`trimmed_text_length`), so a text's value is a function of that text only, the same bits whatever
        else is embedded with it, in this process or another (kernels choose their summation order by the
        shapes they are given; here the shape is the text's own). What the cache's phrases use
        (``extract.pipeline.ShardBuilder``): a phrase recurs across shards, ranks and reruns with other
        batch mates each time. It costs a forward per text: 2,929 toy-world phrases in 2.15 s against 0.20 s in
        batches of 512 (toy-negclip on two CPU threads, ~0.7 ms a forward of its 2-layer text tower, most of it
        module-call overhead; ``python -m train.bench.extract --only phrases --base toy-negclip``)."""
        texts = list(texts)
        out = torch.zeros(len(texts), self.embed_dim)
        if not texts:
            return out
        tok = self.tokenize(texts)  # tokenizing is per text already: one call for all
        for i in range(len(texts)):  # encode_texts([text]) exactly, without tokenizing one at a time
            out[i] = self.encode_token_ids(tok.ids[i:i + 1], tok.attention_mask[i:i + 1])[0][0].cpu()
        return out

    def encode_texts(self, texts: Sequence[str]) -> TextFeatures:
        """Tokenise and encode captions; returns :class:`TextFeatures`."""
        tok = self.tokenize(texts)
        embedding, tokens = self.encode_token_ids(tok.ids, tok.attention_mask)
        return TextFeatures(embedding=embedding, tokens=tokens, attention_mask=tok.attention_mask.to(tokens.device),
                            spans=tok.spans, truncated=tok.truncated)

    # -- identity ----------------------------------------------------------------------------------
    def describe(self, hash_weights: bool = False) -> dict:
        """Everything that determines this backbone's numbers (for cache fingerprints and checkpoints)."""
        import open_clip

        pp = getattr(self.model.visual, "preprocess_cfg", {}) or {}
        # A weights file is named by its resolved path, so `ckpt.pt`, `./ckpt.pt` and `/abs/ckpt.pt` describe (and
        # fingerprint) one backbone; a tag stays a tag.
        weights_file = str(Path(self.weights.path).resolve()) if self.weights.path else None
        pretrained = weights_file if self.weights.kind == "file" else self.spec.pretrained
        info = {
            "base": self.spec.base, "model": self.spec.model, "pretrained": pretrained,
            "weights": self.weights.kind, "weights_file": weights_file,
            "quick_gelu": self.spec.quick_gelu, "precision": self.precision, "embed_dim": self.embed_dim,
            "image_size": list(self.image_size), "grid": list(self.grid), "context_length": self.context_length,
            "preprocess": {k: (list(v) if isinstance(v, tuple) else v) for k, v in pp.items()},
            "tokenizer": type(self.tokenizer).__name__, "open_clip": open_clip.__version__,
        }
        if self.weights.kind == "random":
            info["init_seed"] = self.init_seed
        if hash_weights:
            info["weights_sha256"] = file_sha256(self.weights.path) if self.weights.path else self._parameters_sha256()
        return info

    def _parameters_sha256(self) -> str:
        """Hash of the weights in memory (random init has no file to hash)."""
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


# --------------------------------------------------------------------------------------------- loading
def load_backbone(base: str, pretrained: str | None = None, *, device: str | torch.device = "cpu", precision: str = "fp32",
                  cache_dir: str | None = None, offline: bool | None = None, init_seed: int = 0,
                  context_length: int | None = None) -> FrozenBackbone:
    """Build a frozen backbone.

    base: an alias from backbones.json (ViT-B-32, ViT-B-16, ViT-L-14, coca_ViT-B-32, NegCLIP, tiny, tiny-coca)
        or any open_clip model name.
    pretrained: an open_clip tag, a checkpoint path (.safetensors / .pt / .bin; loaded with
        ``weights_only=True``), "none" for random weights, or None for the alias's default.
    init_seed: seed of the random initialisation (what "random weights" are; overwritten by loaded weights).
    context_length: a longer text context (Long-CLIP position stretching, ``extract.models.long_context``). A
        safetensors checkpoint already saved at that length (``train.adapter --unfreeze --context-length``) is
        loaded into the stretched model as is; any other is loaded first and then stretched.
    Raises WeightsNotFoundError (before building the model) when the weights are not on this machine and
    cannot be downloaded, and :func:`load_weights_file`'s ValueErrors for a file that is damaged, cut short, not a
    checkpoint, a pickle of objects, or another architecture's.
    """
    import open_clip

    spec = resolve_spec(base, pretrained)
    if spec.requires_file and spec.pretrained is None:
        raise WeightsNotFoundError(f"{base} has no public open_clip tag; its weights come as a file.\n{spec.hint}")
    weights = resolve_weights(spec.model, spec.pretrained, cache_dir=cache_dir, offline=offline, hint=spec.hint)
    sidecar = checkpoint_sidecar(weights.path) if weights.kind == "file" else None
    if sidecar is not None:  # a python -m train.pretrain checkpoint says what it was trained as
        if sidecar.get("model") != spec.model:
            raise ValueError(f"{weights.path} was pre-trained as {sidecar.get('model')!r}, not {spec.model!r}: "
                             f"pass --base {sidecar.get('model')}")
        spec = replace(spec, quick_gelu=bool(sidecar.get("quick_gelu")))  # not the alias's OpenAI default
    tag_cfg = weights.tag_cfg or {}
    quick_gelu = spec.quick_gelu or bool(tag_cfg.get("quick_gelu", False))
    # open_clip merges a tag's preprocessing (mean/std/interpolation/resize) only when it loads the tag
    # itself; we load the file ourselves, so pass the tag's preprocessing explicitly.
    pp_kwargs = {f"image_{k}": tag_cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if k in tag_cfg}
    t0 = time.perf_counter()
    # Random weights come from a fixed seed (without touching the caller's RNG), so "tiny with random
    # weights" names one model and caches built from it can be reused.
    # A weights file replaces every parameter (loaded strictly below): nothing to draw for it.
    with torch.random.fork_rng(devices=[]), weights_come_later() if weights.path is not None else nullcontext():
        torch.manual_seed(init_seed)
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec.model, pretrained=None, device=device, precision=precision, force_quick_gelu=quick_gelu,
            **pp_kwargs)
    tokenizer = tokenizer_for(spec.model)
    stretched = False
    if context_length is not None and weights.path is not None:
        in_file = _text_positions_in_file(weights.path)
        if in_file is not None and in_file != _text_positions(model):
            # saved after stretching: stretch the random init to the same shape, then load it strictly (open_clip's
            # own loader would otherwise interpolate the file's positions back down to the config's length)
            tokenizer = _stretch(model, tokenizer, context_length)
            stretched = True
    if weights.path is not None:
        load_weights_file(model, weights.path, spec.model + (f" with a {context_length}-token context" if stretched
                                                             else ""))
        model.to(device)
    if context_length is not None and not stretched:
        tokenizer = _stretch(model, tokenizer, context_length)
    log.info("built %s (%s weights) in %.1f s", spec.model, weights.kind, time.perf_counter() - t0)
    return FrozenBackbone(model, tokenizer, preprocess, spec, weights, precision=precision, init_seed=init_seed)


def _text_positions(model: nn.Module) -> int:
    text = getattr(model, "text", None)
    return int((text if text is not None else model).positional_embedding.shape[0])


def _text_positions_in_file(path: Path) -> int | None:
    """Rows of the text position embedding in a safetensors checkpoint (None for other formats)."""
    if Path(path).suffix != ".safetensors":
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in ("positional_embedding", "text.positional_embedding"):
                if key in f.keys():
                    return int(f.get_slice(key).get_shape()[0])
    except Exception as e:  # safetensors raises its own error types for a cut or foreign file
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); re-copy it") from None
    return None


def _stretch(model: nn.Module, tokenizer, context_length: int):
    from extract.models.long_context import extend_text_context

    # no frozen-position hook: a loaded model is for inference (train.adapter.engine stretches with freeze_kept itself)
    return extend_text_context(model, tokenizer, context_length, freeze_kept=False)[1]


# --------------------------------------------------------------------------------------------- CLI
def build_parser() -> Parser:
    p = Parser(prog="python -m extract.models.backbone",
               description="Check that a frozen backbone loads and show what it returns (shapes, timings).")
    p.add_argument("--base", default="tiny", help="alias (%(default)s, ViT-B-32, coca_ViT-B-32, NegCLIP, ...; --list "
                   "shows them) or any open_clip model name")
    p.add_argument("--pretrained", default=None,
                   help="open_clip tag, checkpoint path, or 'none' for random weights (default: the alias's tag)")
    p.add_argument("--device", default="cpu", help="torch device to load it on")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="weights' precision")
    p.add_argument("--cache-dir", default=None, help="hub / download cache directory (default: open_clip's)")
    p.add_argument("--list", action="store_true", help="list the aliases and their default weights, then exit")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_backbone(args: argparse.Namespace) -> None:
    """``python -m extract.models.backbone``'s job: list the aliases, or load ``args.base`` and print what it returns.
    Raises WeightsNotFoundError / ValueError (one ``error:`` line from :func:`main`)."""
    if args.list:
        for name, a in backbone_aliases().items():
            weights = a.get("pretrained") or (f"shipped: extract/{a['file']}" if a.get("file") else "(file / random)")
            print(f"{name:16s} model={a['model']:20s} pretrained={weights}")
        return
    t0 = time.perf_counter()
    bb = load_backbone(args.base, args.pretrained, device=args.device, precision=args.precision,
                       cache_dir=args.cache_dir)
    t_load = time.perf_counter() - t0
    images = torch.zeros(2, 3, *bb.image_size)
    img = bb.encode_images(images)
    txt = bb.encode_texts(["a red circle left of a blue square", "a small green triangle"])
    print(json.dumps(bb.describe(), indent=2))
    print(f"loaded in {t_load:.1f} s; image embedding {tuple(img.embedding.shape)}, patches {tuple(img.patches.shape)} "
          f"on a {img.grid[0]}x{img.grid[1]} grid; text embedding {tuple(txt.embedding.shape)}, tokens "
          f"{tuple(txt.tokens.shape)}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(check_backbone, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
