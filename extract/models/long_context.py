"""Longer text context for open_clip models: Long-CLIP's knowledge-preserving position stretching.

CLIP's text tower has 77 learnt absolute position embeddings, so captions are cut at 77 tokens. Long-CLIP
(Zhang et al. 2024, §3.1 "knowledge-preserved stretching"; used by SmartCLIP, SmartCLIP paper §6.1
"Implementation details", to fine-tune on 248-token captions) extends them without retraining from scratch:

- the first ``keep = 20`` positions are kept as they are: they are well trained (most captions are short)
  and carry most of the knowledge;
- the remaining positions are stretched by linear interpolation to fill the new length. For CLIP's 77
  positions and 248 tokens the ratio is exactly 4 (248 = 20 + 4 x 57): new position ``20 + 4i + k`` is
  ``(1 - k/4) p[20 + i] + (k/4) p[21 + i]``, and the last four extrapolate linearly from the last two old
  positions, as in the official code. Other lengths use the same rule with ratio
  ``(new - keep) / (old - keep)``.
- during fine-tuning Long-CLIP also freezes the kept positions (its ``mask1`` / ``mask2`` split);
  ``freeze_kept=True`` does the same with a gradient hook, so an optimiser step never moves them. (A
  decoupled weight decay would still shrink them: exclude ``positional_embedding`` from weight decay.)

Works for open_clip ``CLIP`` (text parts on the model) and ``CustomTextCLIP`` / ``CoCa`` (``model.text``);
CoCa's appended class-token position is not a text position and is carried over unchanged at the end.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

LONG_CLIP_CONTEXT = 248
LONG_CLIP_KEEP = 20


def stretch_positions(pos: torch.Tensor, new_length: int, keep: int = LONG_CLIP_KEEP) -> torch.Tensor:
    """[P, W] position embeddings -> [new_length, W]: rows < keep copied, the rest linearly stretched.

    Output row ``x >= keep`` samples the old sequence at ``keep + (x - keep) / r`` with
    ``r = (new_length - keep) / (P - keep)``, interpolating between the two neighbouring old rows and
    extrapolating with the last difference past row P - 1 (Long-CLIP's rule; exact 4x for 77 -> 248).
    """
    old = pos.shape[0]
    if not 0 <= keep < old - 1:
        raise ValueError(f"keep={keep} must lie in [0, {old - 2}] for {old} positions")
    if new_length < old:
        raise ValueError(f"new_length={new_length} is shorter than the current {old} positions; "
                         "stretching only lengthens the context")
    work = pos.detach().to(torch.float64)
    ratio = (new_length - keep) / (old - keep)
    x = torch.arange(new_length - keep, dtype=torch.float64)
    src = keep + x / ratio  # fractional old index of each new row
    lo = src.floor().long().clamp(max=old - 2)  # past the last row: extrapolate from the last pair
    frac = (src - lo.to(torch.float64))[:, None]
    tail = work[lo] + frac * (work[lo + 1] - work[lo])
    return torch.cat([work[:keep], tail]).to(pos.dtype)


def _text_owner(model: nn.Module) -> nn.Module:
    """The module holding the text tower's positional_embedding / attn_mask (CLIP: the model itself)."""
    text = getattr(model, "text", None)
    owner = text if text is not None else model
    if not isinstance(getattr(owner, "positional_embedding", None), torch.Tensor):
        raise NotImplementedError(f"{type(model).__name__}: no open_clip text transformer with learnt absolute "
                                  "position embeddings (Hugging Face text towers are not supported)")
    return owner


def _causal_mask(n: int, like: torch.Tensor | None) -> torch.Tensor:
    mask = torch.full((n, n), float("-inf")).triu_(1)  # open_clip's build_causal_mask
    if like is not None:
        mask = mask.to(device=like.device, dtype=like.dtype)
    return mask


def extend_text_context(model: nn.Module, tokenizer: Any = None, context_length: int = LONG_CLIP_CONTEXT, *,
                        keep: int = LONG_CLIP_KEEP, freeze_kept: bool = True) -> tuple[nn.Module, Any]:
    """Give an open_clip model (in place) and its tokenizer a ``context_length``-token text context.

    Stretches the text position embeddings (:func:`stretch_positions`), rebuilds the causal attention mask,
    updates ``context_length`` on the model (and text tower), and returns ``(model, tokenizer)`` where the
    tokenizer is a copy of ``tokenizer`` (default: open_clip's ``SimpleTokenizer``) with the new context
    length. ``freeze_kept`` zeroes the gradient of the first ``keep`` positions (Long-CLIP trains only the
    stretched ones). Image tower and every other weight are untouched.
    """
    owner = _text_owner(model)
    old_pos = owner.positional_embedding
    old_ctx = int(getattr(owner, "context_length", getattr(model, "context_length", old_pos.shape[0])))
    extra = old_pos.shape[0] - old_ctx  # CoCa: one appended class-token position after the text positions
    if context_length == old_ctx:
        new_pos = old_pos.detach().clone()
    else:
        text_rows = stretch_positions(old_pos[:old_ctx], context_length, keep)
        new_pos = torch.cat([text_rows, old_pos.detach()[old_ctx:]])
    param = nn.Parameter(new_pos.to(device=old_pos.device, dtype=old_pos.dtype),
                         requires_grad=old_pos.requires_grad)
    owner.positional_embedding = param
    if owner is not model and isinstance(getattr(model, "positional_embedding", None), torch.Tensor):
        model.positional_embedding = param
    num_pos = context_length + extra
    # The causal mask is a (non-persistent) buffer of the old size; open_clip slices or adds it whole.
    for m in {id(model): model, id(owner): owner}.values():
        if getattr(m, "attn_mask", None) is not None:
            m.attn_mask = _causal_mask(num_pos, m.attn_mask)
        if hasattr(m, "context_length"):
            m.context_length = context_length
        if hasattr(m, "num_pos"):
            m.num_pos = num_pos
    if freeze_kept and keep > 0:
        def _zero_kept(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[:keep] = 0
            return grad

        # A hook can only be registered on a tensor that requires grad; it survives requires_grad toggles, so a
        # frozen backbone that the loop unfreezes later (--unfreeze) still keeps the first positions fixed.
        was = param.requires_grad
        param.requires_grad_(True)
        param.register_hook(_zero_kept)
        param.requires_grad_(was)
    if tokenizer is None:
        from open_clip.tokenizer import SimpleTokenizer

        tokenizer = SimpleTokenizer(context_length=context_length)
    else:
        tokenizer = copy.copy(tokenizer)
        tokenizer.context_length = context_length
    return model, tokenizer


def extend_backbone_context(backbone, context_length: int = LONG_CLIP_CONTEXT, *, keep: int = LONG_CLIP_KEEP,
                            freeze_kept: bool = True):
    """The same for an :class:`extract.models.backbone.FrozenBackbone` (model, tokenizer and its context length),
    so ``backbone.encode_texts`` encodes up to ``context_length`` tokens. Returns the backbone."""
    _, backbone.tokenizer = extend_text_context(backbone.model, backbone.tokenizer, context_length, keep=keep,
                                                freeze_kept=freeze_kept)
    backbone.context_length = context_length
    return backbone
