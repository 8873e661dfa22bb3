"""Forward passes of an open_clip ``CLIP`` model that pre-training needs beyond ``encode_image`` / ``encode_text``:
choosing which patches enter the image transformer (FLIP's random drop, CLIP-PGS's selection), and the
per-patch / per-token embeddings in the joint space, with gradients (FILIP, PowerCLIP).

They replay open_clip's own code path step by step (``VisionTransformer._embeds`` / ``forward`` and
``CLIP.encode_text``) and call the model's own modules, so with every patch kept they give exactly what
open_clip gives (tested), gradient checkpointing (``model.set_grad_checkpointing``) included. Patch and
token embeddings are made as in ``extract.models.backbone``: the tower's final norm and projection applied to every
token (``ln_post(x_i) @ proj``, ``ln_final(x_t) @ text_projection``), the map that makes the class /
end-of-text token the global embedding -- so a pre-trained checkpoint's patches match what ``python -m
extract`` caches from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.objectives.phases import phase
from extract.models.backbone import encode_text_columns, is_resnet, is_vit, resnet_tokens, trimmed_text_length


class UnsupportedModelError(NotImplementedError):
    """The model is not an open_clip CLIP with an image tower the objective can use (a ViT for every objective
    that chooses patches; a ViT or ModifiedResNet for the others)."""


def check_model(model: nn.Module, *, chooses_patches: bool = True) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is an open_clip ``CLIP`` with the built-in text
    transformer whose image tower is a ``VisionTransformer`` pooled by its class token (ViT-B-16, ViT-B-32,
    ViT-L-14, plugvlm-tiny, ...) or, where the objective does not choose which patches enter the tower
    (``chooses_patches=False``: CLIP, FILIP, PowerCLIP), a ``ModifiedResNet`` (RN50, plugvlm-tiny-rn), whose
    patch tokens are its attention pool's per-position value path (:func:`extract.models.backbone.resnet_tokens`)."""
    visual = getattr(model, "visual", None)
    if not is_vit(visual) and (chooses_patches or not is_resnet(visual)):
        towers = "a ViT image tower" if chooses_patches else "a ViT or ModifiedResNet image tower"
        why = " (it chooses which patches enter the transformer, and a ResNet has none to leave out)" \
            if chooses_patches and is_resnet(visual) else ""
        raise UnsupportedModelError(
            f"this objective needs {towers}; {type(visual).__name__} is not one{why} "
            f"(choose {'a ViT config: ViT-B-16, ViT-B-32, plugvlm-tiny' if chooses_patches else 'ViT-B-16, RN50, plugvlm-tiny-rn'}"
            ", ...)")
    if is_vit(visual) and (getattr(visual, "attn_pool", None) is not None or getattr(visual, "pool_type", "tok") != "tok"):
        raise UnsupportedModelError(
            "pre-training objectives use the class-token pooled ViT (CLIP's); this config pools with "
            f"{'an attentional pooler' if visual.attn_pool is not None else visual.pool_type!r}")
    if getattr(model, "text", None) is not None or not hasattr(model, "token_embedding"):
        raise UnsupportedModelError(
            "pre-training supports open_clip CLIP models with the built-in text transformer (custom_text / "
            "Hugging Face text towers are not supported)")


@dataclass
class ImageOut:
    """pooled: [B, D] global embedding (not normalised); patches: [B, K, D] joint-space embeddings of the
    K patches that went through the transformer (not normalised), or None when not asked for."""

    pooled: Tensor
    patches: Tensor | None = None


@phase("image_tower")
def patch_embed(model: nn.Module, images: Tensor) -> Tensor:
    """The patch-embedding layer's output [B, N, width] (before the class token and positions), N = rows * cols
    in row-major order: what CLIP-PGS measures feature similarity on before choosing patches."""
    visual = model.visual
    x = visual.conv1(images.to(visual.conv1.weight.dtype))
    return x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)


def _padding_mask(key_padding: Tensor, heads: int, dtype) -> Tensor:
    """Additive attention mask [B * heads, 1 + K, 1 + K] that hides padded keys (class token never padded)."""
    b, k = key_padding.shape
    pad = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=key_padding.device), key_padding], dim=1)
    mask = torch.zeros(b, 1, 1 + k, dtype=dtype, device=key_padding.device).masked_fill(pad[:, None, :], float("-inf"))
    return mask.expand(b, 1 + k, 1 + k).repeat_interleave(heads, dim=0)


@phase("image_tower")
def encode_image(model: nn.Module, images: Tensor | None = None, *, keep: Tensor | None = None,
                 key_padding: Tensor | None = None, patches: bool = False,
                 embedded: Tensor | None = None) -> ImageOut:
    """open_clip's ``VisionTransformer.forward`` with a choice of patches.

    images: [B, 3, H, W] preprocessed (or ``embedded``: :func:`patch_embed`'s output, to reuse it).
    keep: [B, K] long indices (into the N patches) of the patches that enter the transformer, as FLIP's
    patch dropout does -- after the position embeddings are added, before ``ln_pre``; None keeps all.
    key_padding: [B, K] bool, True where ``keep`` is padding (rows keeping fewer patches than K): those tokens
    are hidden from attention, so they change nothing. patches: also return the kept patches' embeddings.
    A ModifiedResNet tower runs its own forward; its patches are the final feature map's positions, embedded as
    ``python -m extract`` embeds them (the attention pool's value path); it has no patches to keep.
    """
    visual = model.visual
    if not is_vit(visual):  # a ModifiedResNet: its own forward; its tokens are the attention pool's value path
        if keep is not None or key_padding is not None or embedded is not None:
            raise UnsupportedModelError(f"{type(visual).__name__} has no patch tokens to keep or drop; "
                                        "this objective needs a ViT image tower")
        x = images.to(next(visual.parameters()).dtype)
        if not patches:
            return ImageOut(pooled=visual(x))
        fmap = visual.layer4(visual.layer3(visual.layer2(visual.layer1(visual.stem(x)))))  # ModifiedResNet.forward
        return ImageOut(pooled=visual.attnpool(fmap), patches=resnet_tokens(visual.attnpool, fmap))
    x = patch_embed(model, images) if embedded is None else embedded
    pos = visual.positional_embedding.to(x.dtype)
    x = x + pos[1:]
    if keep is not None:
        x = torch.gather(x, 1, keep[..., None].expand(-1, -1, x.shape[-1]))
    cls = (visual.class_embedding.to(x.dtype) + pos[0]).expand(x.shape[0], 1, -1)
    x = visual.ln_pre(torch.cat([cls, x], dim=1))
    attn_mask = None
    if key_padding is not None:  # not asked whether any is True: that would wait for the device
        heads = visual.transformer.resblocks[0].attn.num_heads
        attn_mask = _padding_mask(key_padding, heads, x.dtype)
    x = visual.transformer(x, attn_mask=attn_mask)
    pooled, tokens = visual._pool(x)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    out = ImageOut(pooled=pooled)
    if patches:
        if getattr(visual, "final_ln_after_pool", False):
            tokens = visual.ln_post(tokens)  # _pool left them un-normalised in this mode
        out.patches = tokens @ visual.proj if visual.proj is not None else tokens
    return out


@dataclass
class TextOut:
    """pooled: [B, D] global embedding (not normalised); tokens: [B, L, D] joint-space token embeddings (not
    normalised; padding positions hold whatever the tower computed, mask them with :func:`token_mask`)."""

    pooled: Tensor
    tokens: Tensor | None = None


@phase("text_tower")
def encode_text(model: nn.Module, ids: Tensor, *, tokens: bool = False, trim: bool = False) -> TextOut:
    """open_clip's ``CLIP.encode_text``, optionally also returning every token's joint-space embedding.

    ``trim`` (pooled output only): run the tower on the columns up to the batch's longest end-of-text alone. The
    mask is causal and pooling takes the end-of-text token, so the padding after it never reaches the result: the
    same embedding up to float rounding, at the cost of the batch's longest caption (``trimmed_text_length``)."""
    length = trimmed_text_length(model, ids) if trim and not tokens else None
    pooled, token_out = encode_text_columns(model, ids, ids.shape[1] if length is None else length, tokens=tokens)
    return TextOut(pooled=pooled, tokens=token_out)


def token_mask(ids: Tensor, *, include_sot: bool = True) -> Tensor:
    """[B, L] bool: the real tokens of open_clip's SimpleTokenizer output (start-of-text through end-of-text).

    Padding cannot be told from ids (id 0 is also the token "!"); end-of-text has the largest id in the vocabulary
    and comes last, which is why open_clip pools at ``argmax``, and so does this.
    """
    positions = torch.arange(ids.shape[1], device=ids.device)
    eot = ids.argmax(dim=-1, keepdim=True)
    mask = positions[None, :] <= eot
    if not include_sot:
        mask &= positions[None, :] >= 1
    return mask


#: torch.compile's modes (``--compile-mode``): True where inductor replays each compiled block as CUDA graphs
COMPILE_MODES = {"default": False, "reduce-overhead": True, "max-autotune": True, "max-autotune-no-cudagraphs": False}


def uses_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether towers compiled in ``mode`` run as CUDA graphs on ``device``: then every step must begin with
    ``torch.compiler.cudagraph_mark_step_begin()`` (the graphs replay into the same memory)."""
    return COMPILE_MODES[mode] and device.type == "cuda"


def compile_towers(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
    """``torch.compile``, in place, the blocks that hold nearly all of a step's FLOPs: the image tower's transformer
    (a ModifiedResNet's four stages and attention pool) and the text transformer. ``nn.Module.compile`` keeps the
    parameter names, so checkpoints and DDP see the same model. The objectives' own code (patch choice, regions,
    losses) stays eager: it reads the step number and seeds generators from it, which a compiled graph would guard
    on and recompile for at every step. A token count that changes (CLIP-PGS's ratio drawn per step, captions
    trimmed to the batch's longest) makes that dimension dynamic after its first recompilation (dynamo's
    automatic dynamic shapes), not a graph per count."""
    visual = model.visual
    blocks = [visual.transformer] if is_vit(visual) else [visual.layer1, visual.layer2, visual.layer3,
                                                           visual.layer4, visual.attnpool]
    for block in (*blocks, model.transformer):
        block.compile(backend=backend, mode=None if mode == "default" else mode)


def keep_count(n: int, mask_ratio: float) -> int:
    """Patches kept when dropping ``mask_ratio`` of ``n``: open_clip's PatchDropout rule, max(1, int(n (1 - r)))."""
    return max(1, int(n * (1.0 - mask_ratio)))


def random_keep(noise: Tensor, n_keep: int) -> Tensor:
    """FLIP's random patch drop: for each row of U[0,1) ``noise`` [B, N], the ``n_keep`` patches with the smallest
    noise, in ascending patch order. Returns [B, n_keep] long."""
    return noise.argsort(dim=1)[:, :n_keep].sort(dim=1).values


def normalize(x: Tensor) -> Tensor:
    return F.normalize(x, dim=-1)
