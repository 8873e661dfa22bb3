"""Frozen backbones: global embeddings equal open_clip's, patch/token embeddings equal independent references."""
import json

import pytest
import torch

from extract.models.backbone import load_backbone, main, resolve_spec


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny")


@pytest.fixture(scope="module")
def tiny_coca():
    return load_backbone("tiny-coca")


@pytest.fixture(scope="module")
def tiny_rn():
    return load_backbone("tiny-rn")


def _images(n=3, size=64, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


TEXTS = ["a small red circle to the left of a blue square", "a green triangle", "two large yellow stars above a cup"]


@pytest.mark.parametrize("name", ["tiny", "tiny-coca", "tiny-rn"])
def test_globals_equal_open_clip(name, request):
    bb = request.getfixturevalue(name.replace("-", "_"))
    x = _images(size=bb.image_size[0])
    img = bb.encode_images(x)
    txt = bb.encode_texts(TEXTS)
    torch.testing.assert_close(img.embedding, bb.model.encode_image(x, normalize=True))
    torch.testing.assert_close(txt.embedding, bb.model.encode_text(bb.tokenizer(TEXTS), normalize=True))
    assert torch.allclose(img.embedding.norm(dim=-1), torch.ones(3)) and torch.allclose(txt.embedding.norm(dim=-1), torch.ones(3))


def test_vit_patches_match_manual_forward(tiny):
    x = _images()
    out = tiny.encode_images(x)
    v = tiny.model.visual
    with torch.no_grad():
        h = v.transformer(v._embeds(x))
        ref = v.ln_post(h[:, 1:]) @ v.proj
        cls = torch.nn.functional.normalize(v.ln_post(h[:, 0]) @ v.proj, dim=-1)
    assert out.patches.shape == (3, 64, 64) and out.grid == (8, 8)
    torch.testing.assert_close(out.patches, ref)
    # the class token through the same map is the global embedding: patches live in the joint space
    torch.testing.assert_close(cls, out.embedding)


def test_coca_patches_are_the_pooler_attending_to_one_patch(tiny_coca):
    x = _images(2)
    out = tiny_coca.encode_images(x)
    v = tiny_coca.model.visual
    with torch.no_grad():
        h = v.transformer(v._embeds(x))
        for i in (0, 5, 63):
            single = v.attn_pool(h[:, 1 + i:2 + i])[:, 0]  # every query sees only patch i
            ref = v.ln_post(single) @ v.proj
            torch.testing.assert_close(out.patches[:, i], ref, rtol=1e-4, atol=1e-5)


def test_resnet_patches_are_the_pool_attending_to_one_position(tiny_rn):
    """A ModifiedResNet's tokens (MaskCLIP's dense features): its attention pool's own forward with the mean
    query and the one key/value of position i, for each position of the final map."""
    x = _images(2, size=128)
    out = tiny_rn.encode_images(x)
    v = tiny_rn.model.visual
    pool = v.attnpool
    assert out.grid == (4, 4) and out.patches.shape == (2, 16, 64)
    with torch.no_grad():
        h = v.layer4(v.layer3(v.layer2(v.layer1(v.stem(x)))))
        seq = h.flatten(2).permute(2, 0, 1)  # (h*w, B, C), as the pool reads it
        seq = torch.cat([seq.mean(0, keepdim=True), seq]) + pool.positional_embedding[:, None]
        for i in (0, 5, 15):
            one = seq[1 + i:2 + i]
            ref, _ = torch.nn.functional.multi_head_attention_forward(
                seq[:1], one, one, seq.shape[-1], pool.num_heads, None,
                torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]), None, None, False, 0.0,
                pool.c_proj.weight, pool.c_proj.bias, training=False, need_weights=False,
                use_separate_proj_weight=True, q_proj_weight=pool.q_proj.weight, k_proj_weight=pool.k_proj.weight,
                v_proj_weight=pool.v_proj.weight)
            torch.testing.assert_close(out.patches[:, i], ref[0], rtol=1e-4, atol=1e-5)


def test_clip_text_tokens_consistent_with_global(tiny):
    out = tiny.encode_texts(TEXTS)
    eot = out.attention_mask.sum(1) - 1
    at_eot = out.tokens[torch.arange(3), eot]
    torch.testing.assert_close(torch.nn.functional.normalize(at_eot, dim=-1), out.embedding)
    assert out.tokens.shape == (3, 77, 64) and out.attention_mask.dtype == torch.bool
    assert out.spans.shape == (3, 77, 2) and not out.truncated.any()


def test_text_tower_runs_on_the_real_columns_only_and_equals_the_full_length_tower():
    """The fast path (the columns up to the batch's last end-of-text) against open_clip's full 77 columns: the same
    embedding, the same tokens where the mask is set, zeros in the columns after the longest caption; the gradients
    of an unfrozen tower too. CoCa (its class token comes after the padding) keeps the full length."""
    from extract.models.backbone import trimmed_text_length

    bb = load_backbone("tiny").unfreeze()
    tok = bb.tokenize(TEXTS)
    m = bb.model
    length = trimmed_text_length(m, tok.ids)
    assert length == int(tok.attention_mask.sum(1).max()) < 77
    assert trimmed_text_length(load_backbone("tiny-coca").model, tok.ids) is None
    emb, tokens = bb.token_features(tok.ids, tok.attention_mask)
    x = m.transformer(m.token_embedding(tok.ids) + m.positional_embedding, attn_mask=m.attn_mask)  # all 77
    reference = m.ln_final(x) @ m.text_projection
    mask = tok.attention_mask
    torch.testing.assert_close(emb, m.encode_text(tok.ids, normalize=True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tokens[mask], reference[mask], rtol=1e-5, atol=1e-6)
    assert tokens.shape == reference.shape and not tokens[:, length:].any()  # the columns no caption reaches
    grads = []
    for out in ((emb, tokens), (m.encode_text(tok.ids, normalize=True), reference)):
        m.zero_grad()
        (out[0].square().sum() + out[1][mask].sin().sum()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "positional_embedding" in grads[0]
    for name in grads[0]:  # float rounding of sums over 13 columns instead of 77, relative to the gradient's scale
        scale = float(grads[1][name].abs().max())
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-5 * scale, msg=name)


def test_coca_text_tokens_match_tower_output(tiny_coca):
    out = tiny_coca.encode_texts(TEXTS)
    t = tiny_coca.model.text
    with torch.no_grad():
        _, raw = t(tiny_coca.tokenizer(TEXTS))  # CoCa's tower returns un-normalised, un-projected tokens
        ref = t.ln_final(raw) @ t.text_projection
    assert out.tokens.shape == (3, 76, 64)
    torch.testing.assert_close(out.tokens, ref)


def test_batch_equals_one_by_one(tiny):
    x = _images(4)
    whole = tiny.encode_images(x)
    for i in range(4):
        one = tiny.encode_images(x[i:i + 1])
        torch.testing.assert_close(one.patches[0], whole.patches[i], rtol=1e-4, atol=1e-5)
    t_whole = tiny.encode_texts(TEXTS)
    t_one = tiny.encode_texts(TEXTS[1:2])
    m = t_one.attention_mask[0]
    torch.testing.assert_close(t_one.tokens[0][m], t_whole.tokens[1][m], rtol=1e-4, atol=1e-5)


def test_frozen(tiny):
    assert not any(p.requires_grad for p in tiny.parameters())
    tiny.train()
    assert not tiny.training and not tiny.model.training
    out = tiny.encode_images(_images(1))
    assert not out.embedding.requires_grad and not out.patches.requires_grad


def test_long_caption_truncated_flag(tiny):
    out = tiny.encode_texts(["red circle " * 60, "blue square"])
    assert out.truncated.tolist() == [True, False]


def test_unknown_base_lists_choices():
    with pytest.raises(ValueError, match="Aliases: .*ViT-B-32.*NegCLIP"):
        resolve_spec("ViT-B-33")


def test_cli(capsys):
    assert main(["--list"]) == 0
    assert "NegCLIP" in capsys.readouterr().out
    assert main(["--base", "tiny-coca"]) == 0
    out = capsys.readouterr().out
    assert '"model": "plugvlm-tiny-coca"' in out and "patches (2, 64, 64)" in out and "tokens (2, 76, 64)" in out
    assert main(["--base", "ViT-B-32"]) == 2
    assert "--pretrained" in capsys.readouterr().err


def test_describe_is_json(tiny):
    d = tiny.describe()
    json.dumps(d)
    assert d["model"] == "plugvlm-tiny" and d["weights"] == "random" and d["grid"] == [8, 8]


# Each architecture the project lists, with random weights (no hub here): shapes as documented.
@pytest.mark.slow
@pytest.mark.parametrize("base,grid,dim,ctx", [
    ("ViT-B-32", (7, 7), 512, 77),
    ("ViT-B-16", (14, 14), 512, 77),
    ("ViT-L-14", (16, 16), 768, 77),
    ("coca_ViT-B-32", (7, 7), 512, 76),
    ("RN50", (7, 7), 1024, 77),
])
def test_listed_architectures_build_with_random_weights(base, grid, dim, ctx):
    bb = load_backbone(base, "none")
    assert bb.spec.quick_gelu == (base != "coca_ViT-B-32")
    img = bb.encode_images(torch.randn(1, 3, 224, 224))
    txt = bb.encode_texts(["a dog next to a car", "a man riding a horse"])
    assert img.embedding.shape == (1, dim) and img.grid == grid
    assert img.patches.shape == (1, grid[0] * grid[1], dim)
    assert txt.embedding.shape == (2, dim) and txt.tokens.shape == (2, ctx, dim)
    torch.testing.assert_close(txt.embedding, bb.model.encode_text(bb.tokenizer(["a dog next to a car", "a man riding a horse"]), normalize=True))
    assert torch.isfinite(img.patches).all() and torch.isfinite(txt.tokens).all()


def test_random_init_is_seeded_and_hashed():
    a, b, c = load_backbone("tiny"), load_backbone("tiny"), load_backbone("tiny", init_seed=1)
    da, db, dc = (m.describe(hash_weights=True) for m in (a, b, c))
    assert da["weights_sha256"] == db["weights_sha256"] != dc["weights_sha256"]
    x = _images(2)
    torch.testing.assert_close(a.encode_images(x).embedding, b.encode_images(x).embedding)
    before = torch.rand(1)
    torch.manual_seed(123)
    ref = torch.rand(1)
    torch.manual_seed(123)
    load_backbone("tiny")  # must not consume the caller's random stream
    assert torch.equal(torch.rand(1), ref) and before.shape == (1,)


def test_a_weights_file_is_described_by_its_resolved_path(tiny, tmp_path, monkeypatch):
    """How a checkpoint path is spelled must not change the fingerprint of what it builds."""
    from safetensors.torch import save_file

    (tmp_path / "w").mkdir()
    save_file({k: v.contiguous() for k, v in tiny.model.state_dict().items()}, str(tmp_path / "w" / "ckpt.safetensors"))
    monkeypatch.chdir(tmp_path)
    spelled = ["w/ckpt.safetensors", "./w/../w/ckpt.safetensors", str(tmp_path / "w" / "ckpt.safetensors")]
    described = [load_backbone("tiny", p).describe(hash_weights=True) for p in spelled]
    assert described[0] == described[1] == described[2]
    assert described[0]["pretrained"] == str((tmp_path / "w" / "ckpt.safetensors").resolve())
