"""Token spans: ids identical to open_clip's tokenizer, spans pointing at the right characters."""
import open_clip
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from extract.models.tokens import NO_SPAN, tokenize_with_spans

TOK = open_clip.get_tokenizer("ViT-B-32")


def _piece_text(token_id: int) -> str:
    piece = TOK.decoder[token_id].replace("</w>", "")
    return bytearray(TOK.byte_decoder[c] for c in piece).decode("utf-8", errors="replace")


def test_ids_match_tokenizer_and_spans_cover_words():
    texts = ["A small  RED circle, to the left of a blue square!?", "  naïve café  ", "two  dogs\tnext to\na car"]
    out = tokenize_with_spans(TOK, texts)
    assert torch.equal(out.ids, TOK(texts))
    covered = [[texts[0][a:b] for a, b in out.spans[0][out.attention_mask[0]].tolist() if a != NO_SPAN]]
    assert covered[0] == ["A", "small", "RED", "circle", ",", "to", "the", "left", "of", "a", "blue", "square", "!?"]
    words = [texts[2][a:b] for a, b in out.spans[2][out.attention_mask[2]].tolist() if a != NO_SPAN]
    assert words == ["two", "dogs", "next", "to", "a", "car"]
    # a word split into several BPE pieces: pieces tile the word without gaps or overlap
    pieces = [tuple(s) for s in out.spans[1][out.attention_mask[1]].tolist() if s[0] != NO_SPAN]
    assert "".join(texts[1][a:b] for a, b in pieces) == "naïvecafé"
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(pieces, pieces[1:]))


def test_specials_padding_and_bang_token():
    # id 0 is the token "!": padding must come from lengths, not from ids != 0
    out = tokenize_with_spans(TOK, ["!#!", ""])
    assert torch.equal(out.ids, TOK(["!#!", ""]))
    assert out.ids[0, 1].item() == 0  # "!" really is id 0 here
    assert out.attention_mask[0].sum().item() == 5  # sot, "!", "#", "!", eot
    assert out.attention_mask[1].sum().item() == 2  # sot, eot
    assert out.spans[0, 0].tolist() == [NO_SPAN, NO_SPAN] and out.spans[0, 4].tolist() == [NO_SPAN, NO_SPAN]
    assert (out.spans[0, 5:] == NO_SPAN).all()


def test_truncation_is_flagged_and_matches_open_clip():
    long = " ".join(["red circle"] * 60)
    out = tokenize_with_spans(TOK, [long, "short"], context_length=16)
    assert torch.equal(out.ids, TOK([long, "short"], context_length=16))
    assert out.truncated.tolist() == [True, False]
    assert out.ids[0, -1].item() == TOK.eot_token_id and out.attention_mask[0].all()


def test_html_and_ligatures_keep_ids_and_sane_spans():
    texts = ["a &lt;b&gt; c", "İstanbul ﬁne"]
    out = tokenize_with_spans(TOK, texts)
    assert torch.equal(out.ids, TOK(texts))
    for i, t in enumerate(texts):
        s = out.spans[i][out.attention_mask[i]]
        s = s[s[:, 0] != NO_SPAN]
        assert (s[:, 0] >= 0).all() and (s[:, 1] <= len(t)).all() and (s[:, 0] < s[:, 1]).all()
        assert (s[1:, 0] >= s[:-1, 0]).all()  # monotone


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abcXYZ019 .,!?'-\t\n")), max_size=60))
def test_ascii_spans_decode_to_their_characters(text):
    out = tokenize_with_spans(TOK, [text])
    assert torch.equal(out.ids, TOK([text]))
    for tid, (a, b) in zip(out.ids[0][out.attention_mask[0]].tolist(), out.spans[0][out.attention_mask[0]].tolist()):
        if a == NO_SPAN:
            assert tid in (TOK.sot_token_id, TOK.eot_token_id)
        else:
            assert _piece_text(tid) == text[a:b].lower()


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_any_unicode_ids_match(text):
    out = tokenize_with_spans(TOK, [text])
    assert torch.equal(out.ids, TOK([text]))
    s = out.spans[0][out.attention_mask[0]]
    s = s[s[:, 0] != NO_SPAN]
    assert ((s[:, 0] >= 0) & (s[:, 1] <= len(text)) & (s[:, 0] < s[:, 1])).all()


def test_unsupported_tokenizer_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="SimpleTokenizer"):
        tokenize_with_spans(object(), ["x"])


def test_encodings_are_reused_across_tokenizer_objects_of_one_vocabulary(monkeypatch):
    """A later run's tokenizer (a new object, the same vocabulary) reuses the encodings; the result is the one a
    fresh encoding gives; a tokenizer with another vocabulary does not share them."""
    import open_clip

    import extract.models.tokens as tokens

    texts = ["a small red circle to the left of a blue square", "naïve café, ﬁne print"]
    first = tokenize_with_spans(open_clip.get_tokenizer("ViT-B-32"), texts)
    calls = []
    real = tokens._simple_tokenizer_encode
    monkeypatch.setattr(tokens, "_simple_tokenizer_encode", lambda tok, text: calls.append(text) or real(tok, text))
    again = tokenize_with_spans(open_clip.get_tokenizer("ViT-B-32"), texts)
    assert calls == [] and torch.equal(again.ids, first.ids) and torch.equal(again.spans, first.spans)
    monkeypatch.setattr(tokens, "_ENCODED", tokens.OrderedDict())
    fresh = tokenize_with_spans(open_clip.get_tokenizer("ViT-B-32"), texts)
    assert calls == texts and torch.equal(fresh.ids, first.ids) and torch.equal(fresh.spans, first.spans)
    other = open_clip.get_tokenizer("ViT-B-32")
    other.encoder = {**other.encoder, "zzz": len(other.encoder)}
    assert tokens._vocabulary_key(other) != tokens._vocabulary_key(open_clip.get_tokenizer("ViT-B-32"))


def test_tokenizer_for_builds_each_models_tokenizer_once_and_hands_out_copies(monkeypatch):
    """A backbone load used to build open_clip's tokenizer (and digest its vocabulary) again each time; now once per
    model and process. Each caller gets its own copy: same ids as open_clip's own tokenizer, and an attribute set on
    one copy (a stretched context) is not seen by the next."""
    import open_clip

    import extract.models.tokens as tokens

    built = []
    real = open_clip.get_tokenizer
    monkeypatch.setattr(tokens, "_TEMPLATES", {})
    monkeypatch.setattr(open_clip, "get_tokenizer", lambda name, *a, **k: built.append(name) or real(name, *a, **k))
    first, second = tokens.tokenizer_for("ViT-B-32"), tokens.tokenizer_for("ViT-B-32")
    assert built == ["ViT-B-32"] and first is not second
    texts = ["a small red circle to the left of a blue square", "naïve café"]
    assert torch.equal(first(texts), real("ViT-B-32")(texts))
    assert tokens._vocabulary_key(first) == tokens._vocabulary_key(real("ViT-B-32"))
    first.context_length = 248
    assert second.context_length == 77 and tokens.tokenizer_for("ViT-B-32").context_length == 77
    tokens.tokenizer_for("plugvlm-tiny")  # another model: its own template
    assert built == ["ViT-B-32", "plugvlm-tiny"]
