"""Tokenisation with character spans: which characters of the caption each backbone token covers.

Later stages map words and phrases (spaCy) onto backbone tokens, so every token needs its span in the
*original* caption. open_clip's ``SimpleTokenizer`` cleans the text first (ftfy, HTML unescape, whitespace
collapse, lower-case), then splits it with a regex and byte-level BPE; we replay those steps while keeping
offsets, and the ids we produce are checked (in the tests) to equal the tokenizer's own.
"""
from __future__ import annotations

import difflib
from collections import OrderedDict
from dataclasses import dataclass

import torch

NO_SPAN = -1  # span value for special tokens (start/end of text) and padding


@dataclass
class TokenizedText:
    """Token ids for a batch of captions, with their character spans.

    ids: LongTensor [B, L] (L = context length), exactly what the backbone's tokenizer returns.
    attention_mask: BoolTensor [B, L], True for real tokens including start/end-of-text (not padding;
        padding cannot be told from ids because id 0 is also the token "!").
    spans: LongTensor [B, L, 2], [start, end) character offsets into the original caption string;
        NO_SPAN for special tokens and padding. A BPE piece of a word covers only its own characters.
    truncated: BoolTensor [B], True where the caption did not fit in L tokens (the tail was cut).
    """

    ids: torch.Tensor
    attention_mask: torch.Tensor
    spans: torch.Tensor
    truncated: torch.Tensor


def _lowered_with_map(text: str, lower: bool) -> tuple[str, list[int]]:
    """Whitespace-collapse (and lower-case) ``text`` the way open_clip does, keeping each char's origin."""
    out: list[str] = []
    origin: list[int] = []
    pending_space = False
    for i, ch in enumerate(text):
        if ch.isspace():
            pending_space = bool(out)
            continue
        if pending_space:
            out.append(" ")
            origin.append(i - 1)
            pending_space = False
        piece = ch.lower() if lower else ch
        out.extend(piece)  # some lower-casings are longer than one char ("İ" -> "i̇")
        origin.extend([i] * len(piece))
    return "".join(out), origin


def _align(cleaned: str, text: str, lower: bool) -> list[int]:
    """Origin index in ``text`` of every char of ``cleaned`` (open_clip's cleaned form of ``text``)."""
    fast, origin = _lowered_with_map(text, lower)
    if fast == cleaned:
        return origin
    # ftfy / HTML unescaping changed the text (rare): align by longest matching blocks; a char that
    # matches nothing ("<" from "&lt;", "fi" from a ligature) points just past the previous matched char.
    mapping = [-1] * len(cleaned)
    for a, b, n in difflib.SequenceMatcher(None, cleaned, fast, autojunk=False).get_matching_blocks():
        for k in range(n):
            mapping[a + k] = origin[b + k]
    last = -1
    for k, m in enumerate(mapping):
        if m < 0:
            mapping[k] = min(last + 1, len(text) - 1)
        else:
            last = m
    return mapping


_TEMPLATES: dict = {}


def tokenizer_for(model: str):
    """open_clip's tokenizer of ``model`` (``open_clip.get_tokenizer``), as a shallow copy of one built once per process
    for that model and config. A ``SimpleTokenizer`` reads and parses its 49k-word vocabulary and 48k merges every time
    it is built (~0.1 s) and a new object's vocabulary digest (:func:`_vocabulary_key`, ~0.2 s) is computed again: every
    backbone load paid both (an eighth of the test suite's CPU time). The copy shares the read-only tables and BPE memo
    and has attributes of its own (a stretched context sets ``context_length`` on its copy only)."""
    import copy
    import json

    import open_clip

    key = (model, json.dumps(open_clip.get_model_config(model), sort_keys=True, default=str))
    template = _TEMPLATES.get(key)
    if template is None:
        template = open_clip.get_tokenizer(model)
        if hasattr(template, "encoder"):  # a SimpleTokenizer: its digest once, inherited by every copy
            _vocabulary_key(template)
        template = _TEMPLATES.setdefault(key, template)
    return copy.copy(template)


#: tokenisations kept per process (:func:`_encoded`), the least recently used dropped first (about 2 KB each)
ENCODE_CACHE = 60_000
_ENCODED: OrderedDict = OrderedDict()


def _vocabulary_key(tok) -> int:
    """What decides a SimpleTokenizer's output (its vocabulary and merges, its text cleaning), as one hash computed once
    per tokenizer object: tokenizers loaded again by later runs of a process share their cached encodings. Python's
    hash of the tables (~20 ms, a sha256 of their text was ~0.2 s): the key lives in this process's memory only, and
    two different vocabularies of the same sizes colliding in 64 bits is not a risk worth 10x the time."""
    key = getattr(tok, "_plugvlm_vocabulary_key", None)
    if key is None:
        merges = tuple(tok.bpe_ranks.items()) if hasattr(tok, "bpe_ranks") else ()
        key = hash((len(tok.encoder), len(merges), tuple(tok.encoder.items()), merges,
                    repr(getattr(tok.clean_fn, "__name__", tok.clean_fn))))
        tok._plugvlm_vocabulary_key = key
    return key


def _encoded(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """:func:`_simple_tokenizer_encode`, each (vocabulary, text) once per process: every adapter run and every
    evaluated model tokenises the same held-out captions and hard negatives again."""
    key = (_vocabulary_key(tok), text)
    found = _ENCODED.get(key)
    if found is None:
        found = _ENCODED[key] = _simple_tokenizer_encode(tok, text)
        while len(_ENCODED) > ENCODE_CACHE:  # least recently used first out
            _ENCODED.popitem(last=False)
    else:
        try:
            _ENCODED.move_to_end(key)
        except KeyError:  # dropped by another thread meanwhile: still a valid result
            pass
    return found


def _simple_tokenizer_encode(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Replay ``SimpleTokenizer.encode`` on one caption, returning ids and [start, end) spans."""
    cleaned = tok.clean_fn(text)
    lower = cleaned == cleaned.lower()
    origin = _align(cleaned, text, lower) if cleaned else []
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for m in tok.pat.finditer(cleaned):  # open_clip compiles it with `regex` (\p{L} classes)
        word = m.group()
        # byte offset -> char offset inside this regex match (non-ASCII chars span several bytes)
        byte_to_char = [c for c, ch in enumerate(word) for _ in ch.encode("utf-8")]
        encoded = "".join(tok.byte_encoder[b] for b in word.encode("utf-8"))
        pos = 0
        for piece in tok.bpe(encoded).split(" "):
            n_bytes = len(piece[:-4] if piece.endswith("</w>") else piece)
            c0 = m.start() + byte_to_char[pos]
            c1 = m.start() + byte_to_char[pos + n_bytes - 1]
            ids.append(tok.encoder[piece])
            spans.append((origin[c0], origin[c1] + 1))
            pos += n_bytes
    return ids, spans


def tokenize_with_spans(tokenizer, texts: list[str], context_length: int | None = None) -> TokenizedText:
    """Tokenise ``texts`` like ``tokenizer(texts)`` and also return each token's character span.

    Supports open_clip's ``SimpleTokenizer`` (every CLIP / CoCa / NegCLIP backbone this project lists).
    Truncation follows open_clip: keep the first L-1 tokens and put end-of-text last.
    """
    if not hasattr(tokenizer, "bpe") or not hasattr(tokenizer, "byte_encoder"):
        raise NotImplementedError(
            f"token spans need open_clip's SimpleTokenizer; {type(tokenizer).__name__} is not supported yet")
    if getattr(tokenizer, "reduction_fn", None) is not None:
        raise NotImplementedError("token spans are not defined for tokenizers with a reduction mask")
    length = context_length or tokenizer.context_length
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    mask = torch.zeros(len(texts), length, dtype=torch.bool)
    spans = torch.full((len(texts), length, 2), NO_SPAN, dtype=torch.long)
    truncated = torch.zeros(len(texts), dtype=torch.bool)
    for i, text in enumerate(texts):
        body, body_spans = _encoded(tokenizer, text)
        seq = [tokenizer.sot_token_id] + body + [tokenizer.eot_token_id]
        sp = [(NO_SPAN, NO_SPAN)] + body_spans + [(NO_SPAN, NO_SPAN)]
        if len(seq) > length:
            truncated[i] = True
            seq = seq[: length - 1] + [tokenizer.eot_token_id]
            sp = sp[: length - 1] + [(NO_SPAN, NO_SPAN)]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = True
        spans[i, : len(seq)] = torch.tensor(sp)
    return TokenizedText(ids=ids, attention_mask=mask, spans=spans, truncated=truncated)
