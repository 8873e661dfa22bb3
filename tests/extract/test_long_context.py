"""Long-CLIP position stretching (extract/models/long_context.py) on the tiny open_clip configs."""
from __future__ import annotations

import pytest
import torch

from extract.models.backbone import load_backbone
from extract.models.long_context import extend_backbone_context, extend_text_context, stretch_positions

CAPTION = " ".join(["a small red circle to the left of a big blue square"] * 17)  # ~200 tokens


def _long_clip_reference(pos: torch.Tensor, keep: int = 20) -> torch.Tensor:
    """Long-CLIP's own loop (beichenzbc/Long-CLIP, train.py / model loading), written out literally."""
    length, dim = pos.shape
    new = torch.zeros(4 * length - 3 * keep, dim, dtype=pos.dtype)
    for i in range(keep):
        new[i] = pos[i]
    for i in range(length - 1 - keep):
        new[4 * i + keep] = pos[i + keep]
        new[4 * i + 1 + keep] = 3 * pos[i + keep] / 4 + 1 * pos[i + 1 + keep] / 4
        new[4 * i + 2 + keep] = 2 * pos[i + keep] / 4 + 2 * pos[i + 1 + keep] / 4
        new[4 * i + 3 + keep] = 1 * pos[i + keep] / 4 + 3 * pos[i + 1 + keep] / 4
    for k in range(4):
        new[4 * length - 3 * keep - 4 + k] = pos[length - 1] + k * (pos[length - 1] - pos[length - 2]) / 4
    return new


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny")


def test_stretch_equals_long_clip_loop():
    pos = torch.randn(77, 8, dtype=torch.float64)
    out = stretch_positions(pos, 248)
    assert out.shape == (248, 8)
    torch.testing.assert_close(out, _long_clip_reference(pos), rtol=0, atol=1e-12)


def test_stretch_rejects_bad_lengths():
    pos = torch.randn(77, 4)
    with pytest.raises(ValueError, match="shorter"):
        stretch_positions(pos, 50)
    with pytest.raises(ValueError, match="keep"):
        stretch_positions(pos, 248, keep=80)


def test_tiny_model_gets_248_positions(tiny):
    model = tiny.model
    old = model.positional_embedding.detach().clone()
    model, tok = extend_text_context(model, tiny.tokenizer, 248)
    pos = model.positional_embedding
    assert pos.shape == (248, old.shape[1])
    torch.testing.assert_close(pos[:20], old[:20], rtol=0, atol=0)  # knowledge kept
    torch.testing.assert_close(pos[20::4][:57], old[20:], rtol=0, atol=1e-6)  # every 4th row is an old one
    assert model.attn_mask.shape == (248, 248)
    assert torch.isinf(model.attn_mask[0, 1]) and model.attn_mask[1, 0] == 0  # still causal
    assert model.context_length == 248 and tok.context_length == 248
    assert tiny.tokenizer.context_length == 77  # the caller's tokenizer is not modified


def test_long_caption_encodes_past_77_tokens():
    bb = load_backbone("tiny")
    short = bb.encode_texts([CAPTION])
    assert bool(short.truncated[0])
    extend_backbone_context(bb, 248)
    changed = CAPTION[: -len("blue square")] + "green square"  # differs only after token 190
    out = bb.encode_texts([CAPTION, changed])
    assert out.tokens.shape[1] == 248
    assert not out.truncated.any() and int(out.attention_mask[0].sum()) > 150
    assert torch.isfinite(out.embedding).all()
    # the tail now reaches the global embedding (at 77 tokens both captions were cut to the same ids)
    assert (out.embedding[0] - out.embedding[1]).abs().max() > 1e-4
    assert (out.embedding[0] - short.embedding[0]).abs().max() > 1e-4


def test_coca_class_position_carried_over():
    bb = load_backbone("tiny-coca")
    text = bb.model.text
    old = text.positional_embedding.detach().clone()  # 76 text positions + the appended class token
    extend_backbone_context(bb, 248)
    assert text.positional_embedding.shape == (249, old.shape[1])
    torch.testing.assert_close(text.positional_embedding[-1], old[-1], rtol=0, atol=0)
    torch.testing.assert_close(text.positional_embedding[:20], old[:20], rtol=0, atol=0)
    out = bb.encode_texts([CAPTION])
    assert out.tokens.shape[1] == 248 and torch.isfinite(out.embedding).all()


def test_kept_positions_do_not_train():
    bb = load_backbone("tiny")
    model, tok = extend_text_context(bb.model, bb.tokenizer, 248, freeze_kept=True)
    model.requires_grad_(True)  # an --unfreeze fine-tune
    ids = tok([CAPTION])
    model.encode_text(ids).sum().backward()
    grad = model.positional_embedding.grad
    assert grad[:20].abs().max() == 0
    assert grad[20:].abs().max() > 0
