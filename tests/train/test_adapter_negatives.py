"""train/adapter/negatives.py and train.adapter.engine --hard-negatives: every head trains with NegCLIP's extra columns,
the columns are really in its softmax, and the negatives come from the training captions only."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("spacy")

from adapters.registry import ADAPTERS  # noqa: E402
from fixtures.toy import toy_root  # noqa: E402
from train.adapter.engine import AdapterOptions, AdapterRun, compute_gradients, resolve, train  # noqa: E402
from train.adapter.negatives import NegativeLoss, build_negatives, draw_negatives, world_negatives  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return toy_root(tmp_path_factory)


def _reps(b, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=-1)}


class _Cosine:
    """A stand-in head: cosine of one embedding, CLIP's loss; enough to check the extra columns by hand."""

    def encode_image(self, batch):
        return {"embed": batch["x"]}

    def encode_text(self, batch):
        return {"embed": batch["t"]}

    def score(self, i, t):
        return i["embed"] @ t["embed"].T

    def logits(self, i, t):
        return 10 * self.score(i, t)

    def loss(self, i, t, rank=0, world_size=1):
        return {"loss": torch.nn.functional.cross_entropy(self.logits(i, t), torch.arange(len(i["embed"])))}


def test_the_extra_columns_are_in_the_softmax():
    b, k = 4, 3
    x, t, n = _reps(b)["embed"], _reps(b, seed=1)["embed"], _reps(b * k, seed=2)["embed"].view(b, k, -1)
    valid = torch.tensor([[True, True, False], [True, False, False], [False, False, False], [True, True, True]])
    head = NegativeLoss(_Cosine(), weight=0.5)
    out = head.loss(head.encode_image({"x": x}), head.encode_text({"t": t, "neg:t": n, "neg_valid": valid}))
    logits = 10 * x @ torch.cat([t, n.flatten(0, 1)]).T
    logits[:, b:][:, ~valid.flatten()] = float("-inf")
    expected = torch.nn.functional.cross_entropy(logits, torch.arange(b))
    torch.testing.assert_close(out["hard_negatives"], expected)
    plain = _Cosine().loss({"embed": x}, {"embed": t})["loss"]
    torch.testing.assert_close(out["loss"], plain + 0.5 * expected)
    # an invalid slot changes nothing
    n2 = n.clone()
    n2[2, 0] += 1
    again = head.loss({"embed": x}, head.encode_text({"t": t, "neg:t": n2, "neg_valid": valid}))
    torch.testing.assert_close(again["loss"], out["loss"])


def test_accumulated_steps_give_the_whole_batch_gradient_with_negatives():
    """Gradient caching slices the negatives with their captions: ComAlign's gradient with negatives is the same
    in 3 micro-batches as in one pass."""
    from accelerate import Accelerator

    ctx = AdapterRun(Accelerator(cpu=True), 0, 1, torch.device("cpu"), None)
    g = torch.Generator().manual_seed(0)
    n, d, k = 12, 32, 2

    def text(*lead):
        return {"text_embed": torch.randn(*lead, d, generator=g), "entity_embed": torch.randn(*lead, 3, d, generator=g),
                "entity_valid": torch.rand(*lead, 3, generator=g) > 0.3,
                "relation_embed": torch.randn(*lead, 2, d, generator=g),
                "relation_valid": torch.rand(*lead, 2, generator=g) > 0.3}

    img = {"image_embed": torch.randn(n, d, generator=g), "ventity_embed": torch.randn(n, 3, d, generator=g),
           "ventity_valid": torch.rand(n, 3, generator=g) > 0.3, "vrelation_embed": torch.randn(n, 2, d, generator=g),
           "vrelation_valid": torch.rand(n, 2, generator=g) > 0.3}
    txt = {**text(n), **{"neg:" + key: v for key, v in text(n, k).items()}, "neg_valid": torch.rand(n, k, generator=g) > 0.2}
    grads = []
    for accum in (1, 3):
        torch.manual_seed(0)
        head = ADAPTERS.get("comalign").from_config({"heads": 4, "dropout": 0.0, "residual": False}, d)
        out = compute_gradients(NegativeLoss(head, 1.0), img, txt, accum, ctx)
        assert torch.isfinite(out["loss"]) and out["hard_negatives"] > 0
        grads.append({key: p.grad.clone() for key, p in head.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], atol=1e-5, rtol=1e-4)


def test_negatives_are_drawn_from_training_captions_and_encoded_once():
    texts = ["a red circle to the left of a blue square", "a small green star", "a zebra next to a violet giraffe"]
    calls = []

    def arrays(batch):
        calls.append(list(batch))
        return {"text_embed": np.ones((len(batch), 4), dtype=np.float32)}

    neg = build_negatives(texts, np.array([0, 1]), ("replace-att", "swap-att", "replace-obj"), arrays, seed=0,
                          say=lambda *a: None)
    encoded = [t for c in calls for t in c]
    assert len(encoded) == len(set(encoded)) == int((neg.rows >= 0).sum())
    assert not any("zebra" in t or "violet" in t or "giraffe" in t for t in encoded)
    assert (neg.rows[2] == -1).all()  # the row that is not trained on gets none
    assert neg.rows[0].tolist() != [-1, -1, -1] and neg.rows[1, 1] == -1  # one object: nothing to swap
    batch = neg.batch(np.array([1, 0]), ["text_embed"])
    assert batch["neg:text_embed"].shape == (2, 3, 4) and batch["neg_valid"].tolist()[1] == (neg.rows[0] >= 0).tolist()


def test_a_type_counted_twice_fills_two_slots_with_distinct_negatives():
    """--hard-negatives 'replace-rel*2': two slots of the type, two different predicates in them where the vocabulary
    has them, counted together in the run's summary; the flag's text as the run records it."""
    texts = ["a red circle to the left of a blue square", "a green star above a red circle",
             "a blue square below a green star", "a red circle on a green star"]
    neg = build_negatives(texts, np.arange(4), ("replace-rel", "replace-rel"),
                          lambda batch: {"text_embed": np.ones((len(batch), 4), dtype=np.float32)}, seed=0,
                          say=lambda *a: None)
    assert (neg.rows >= 0).all() and all(a != b for a, b in neg.rows.tolist())
    drawn = draw_negatives(texts, np.arange(4), ("replace-rel", "replace-rel"), seed=0)
    assert drawn.summary(4).endswith("(replace-rel 8)")
    assert resolve(AdapterOptions(method="grounded", hard_negatives="all,replace-rel*2")).hard_negatives == \
        "replace-att,replace-obj,replace-rel*2,swap-att,swap-obj"


@pytest.mark.slow
@pytest.mark.parametrize("method", ADAPTERS.names())
def test_every_head_trains_with_hard_negatives(method, root, tmp_path):
    out = tmp_path / method
    summary = train(AdapterOptions(method=method, data=str(root / "world"), out=str(out), cache_dir=str(root / "cache"),
                                   workers=0, extract_batch_size=64, batch_size=48, eval_batch_size=256, epochs=1,
                                   final_eval=False, hard_negatives="all", hard_negative_weight=0.5))
    assert (out / "adapter.safetensors").is_file() and summary["adapter"]
    rows = (out / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "hard_negatives" in header
    values = [float(r.split(",")[header.index("hard_negatives")]) for r in rows[1:] if r.split(",")[
        header.index("hard_negatives")]]
    assert values and all(np.isfinite(values)) and max(values) > 0
    config = json.loads((out / "config.json").read_text())
    assert config["hard_negatives"] == ",".join(("replace-att", "replace-obj", "replace-rel", "swap-att", "swap-obj"))
    assert config["hard_negative_weight"] == 0.5


def test_an_unknown_type_is_refused_clearly():
    with pytest.raises(ValueError, match="unknown hard-negative type"):
        resolve(AdapterOptions(method="comalign", hard_negatives="swap-everything"))


def _world_captions(world):
    """Every caption of a toy world's train split as a cache lists them: (texts, caption ids)."""
    coco = json.loads((world / "train_coco.json").read_text())
    return [a["caption"] for a in coco["annotations"]], [str(a["id"]) for a in coco["annotations"]]


def test_world_negatives_are_the_worlds_own_of_each_training_caption(root):
    """--hard-negatives world: each training caption's slots hold exactly the world's negatives of it (negatives.json,
    split train), one slot per type the world writes; a caption not trained on gets none; a cache whose captions are
    not the world's is refused, saying which caption differs."""
    world = root / "world"
    texts, ids = _world_captions(world)
    train_rows = np.arange(0, len(texts), 2)
    drawn = world_negatives(world, texts, ids, train_rows)
    listed = json.loads((world / "negatives.json").read_text())["items"]
    own = {str(e["caption_id"]): {n["type"]: n["text"] for n in e["negatives"]}
           for e in listed if e["split"] == "train"}
    assert set(drawn.types) == {t for negs in own.values() for t in negs}
    for r in range(len(texts)):
        got = {drawn.types[k]: drawn.texts[i] for k, i in enumerate(drawn.rows[r]) if i >= 0}
        assert got == (own.get(ids[r], {}) if r % 2 == 0 else {}), r
    assert (drawn.rows >= 0).sum() > len(train_rows)
    wrong = list(texts)
    wrong[2] = "a zebra"
    with pytest.raises(ValueError, match=f"caption {ids[2]} reads 'a zebra'"):
        world_negatives(world, wrong, ids, train_rows)


def test_world_negatives_take_drawn_slots_after_their_own(root):
    """'world,swap-obj*2': the world's slots as they are, then the drawn ones, each text the draw's own, each distinct
    text encoded once."""
    world = root / "world"
    texts, ids = _world_captions(world)
    train_rows = np.arange(len(texts))
    own = world_negatives(world, texts, ids, train_rows)
    drawn = draw_negatives(texts, train_rows, ("swap-obj", "swap-obj"), seed=0)
    both = own.joined(drawn)
    assert both.types == own.types + ("swap-obj", "swap-obj") and len(set(both.texts)) == len(both.texts)
    k = len(own.types)
    assert (both.rows[:, :k] == own.rows).all()
    got = [[both.texts[i] if i >= 0 else None for i in row] for row in both.rows[:, k:]]
    assert got == [[drawn.texts[i] if i >= 0 else None for i in row] for row in drawn.rows]
    assert (drawn.rows >= 0).sum() > 0


def test_world_negatives_are_a_setting_of_their_own():
    """'world' passes resolve as it is (not a type list), first before drawn types, and is refused with --unfreeze,
    which draws per batch."""
    assert resolve(AdapterOptions(method="grounded", hard_negatives="world")).hard_negatives == "world"
    assert resolve(AdapterOptions(method="grounded", hard_negatives="replace-rel*2,world")).hard_negatives == \
        "world,replace-rel*2"
    assert resolve(AdapterOptions(method="grounded", hard_negatives=["world", "swap-obj"])).hard_negatives == \
        "world,swap-obj"  # a list, as a config file gives it
    with pytest.raises(ValueError, match="--hard-negatives world"):
        resolve(AdapterOptions(method="smartclip", hard_negatives="world", unfreeze=True, backbone_lr=1e-5))
