"""The grounded relation head (adapters/heads/grounded.py) on hand-built caches: what it reads, what it learns."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from adapters.heads.grounded import Grounded, GroundedConfig, box_features, pair_features
from adapters.registry import ADAPTERS
from extract.components.overlap import FEATURES as OVERLAP_FEATURES, RULES as OVERLAP_RULES

D, E, R, P = 16, 4, 3, 4
SIZE = 64.0
# four objects and four predicates, each an orthogonal direction: nothing in the embeddings says which predicate
# means what, so whatever the head gets right about them it learned from the captions
OBJECTS = torch.eye(D)[:4]
PREDICATES = torch.eye(D)[8:12]
GEOMETRY = {0: "left of", 1: "right of", 2: "above", 3: "below"}  # what predicate k means in this world


def holds(meaning: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The world's truth for box centres a, b (px), with a margin as the toy world keeps."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    return {"left of": dx > 10, "right of": dx < -10, "above": dy > 10, "below": dy < -10}[meaning]


def box_at(cx: float, cy: float, side: float = 12.0) -> list[float]:
    return [cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2]


def image_batch(items: list[tuple[tuple[int, list[float]], ...]]) -> dict[str, torch.Tensor]:
    """items: per image, (object index, box) for each of its boxes (at most E)."""
    n = len(items)
    out = {"image_embed": torch.zeros(n, D), "ventity_embed": torch.zeros(n, E, D),
           "ventity_valid": torch.zeros(n, E, dtype=torch.bool), "ventity_boxes": torch.zeros(n, E, 4),
           "ventity_image_size": torch.full((n, 2), SIZE),
           "ventity_overlap": torch.zeros(n, E, E, OVERLAP_FEATURES)}  # boxes that do not overlap
    for i, boxes in enumerate(items):
        for k, (obj, box) in enumerate(boxes):
            out["ventity_embed"][i, k] = OBJECTS[obj]
            out["ventity_boxes"][i, k] = torch.tensor(box)
            out["ventity_valid"][i, k] = True
        out["image_embed"][i] = F.normalize(sum(OBJECTS[o] for o, _ in boxes), dim=0)  # a bag of its objects
    return out


def text_batch(triplets: list[list[tuple[int, int, int]]]) -> dict[str, torch.Tensor]:
    """triplets: per caption, (subject object, predicate, object object) for each relation (at most R)."""
    n = len(triplets)
    out = {"text_embed": torch.zeros(n, D), "entity_embed": torch.zeros(n, P, D),
           "entity_valid": torch.zeros(n, P, dtype=torch.bool), "entity_count": torch.zeros(n, P, dtype=torch.long)}
    for role in ("subject", "predicate", "object"):
        out[f"role_{role}_embed"] = torch.zeros(n, R, D)
    out["role_valid"] = torch.zeros(n, R, dtype=torch.bool)
    for t, rels in enumerate(triplets):
        names = []
        for r, (s, p, o) in enumerate(rels):
            out["role_subject_embed"][t, r], out["role_object_embed"][t, r] = OBJECTS[s], OBJECTS[o]
            out["role_predicate_embed"][t, r] = PREDICATES[p]
            out["role_valid"][t, r] = True
            names += [s, o]
        for k, obj in enumerate(dict.fromkeys(names)):
            out["entity_embed"][t, k], out["entity_valid"][t, k] = OBJECTS[obj], True
        # the pooled caption embedding is a bag of words: the same for a relation and its converse
        out["text_embed"][t] = F.normalize(sum((OBJECTS[o] for o in names), torch.zeros(D)) + 0.1 * sum(
            (PREDICATES[p] for _, p, _ in rels), torch.zeros(D)), dim=0)
    return out


def random_scene(g: torch.Generator) -> tuple[tuple[int, list[float]], tuple[int, list[float]]]:
    a, b = torch.randperm(4, generator=g)[:2].tolist()
    while True:
        ca, cb = torch.rand(2, generator=g) * 44 + 10, torch.rand(2, generator=g) * 44 + 10
        if (ca - cb).abs().max() > 14:
            return (a, box_at(*ca.tolist())), (b, box_at(*cb.tolist()))


def training_set(n: int, seed: int):
    """n two-object scenes, each with a true relation caption and a negative that only changes who is where (the
    subject and object swapped, or the predicate replaced by one that does not hold)."""
    g = torch.Generator().manual_seed(seed)
    scenes, pos, neg = [], [], []
    while len(scenes) < n:
        (a, ba), (b, bb) = scene = random_scene(g)
        ca, cb = torch.tensor(ba).view(2, 2).mean(0), torch.tensor(bb).view(2, 2).mean(0)
        true = [k for k, m in GEOMETRY.items() if holds(m, ca, cb)]
        false = [k for k, m in GEOMETRY.items() if not holds(m, ca, cb)]
        if not true or not false:
            continue
        p = true[int(torch.randint(len(true), (1,), generator=g))]
        scenes.append(scene)
        pos.append([(a, p, b)])
        swap = bool(torch.rand(1, generator=g) < 0.5)
        neg.append([(b, p, a)] if swap else [(a, false[int(torch.randint(len(false), (1,), generator=g))], b)])
    return image_batch(scenes), text_batch(pos), text_batch(neg)


def trained_head(steps: int = 300, seed: int = 0) -> Grounded:
    torch.manual_seed(seed)
    head = Grounded(GroundedConfig(hidden=32), D)
    images, pos, neg = training_set(256, seed)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        img, txt, nt = head.encode_image(images), head.encode_text(pos), head.encode_text(neg)
        neg_reps = {k: v[:, None] for k, v in nt.items()}  # one negative slot per caption
        out = head.negatives_loss(img, txt, neg_reps, torch.ones(len(pos["text_embed"]), 1, dtype=torch.bool),
                                  ("swap-obj",))
        loss = out["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def spread_head(seed: int, **config) -> Grounded:
    """An untrained head with its matrices drawn away from the zero init, so the geometry terms count."""
    torch.manual_seed(seed)
    head = Grounded(GroundedConfig(**config), D)
    for p in head.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.3)
    return head


@pytest.fixture(scope="module")
def head() -> Grounded:
    return trained_head()


def test_registered_with_its_components_and_negatives():
    cls = ADAPTERS.get("grounded")
    assert cls is Grounded
    assert set(cls.components) == {"entities", "roles"}
    assert cls.hard_negatives == "all"  # the relation term learns from converses (module docstring)
    assert "ventity_image_size" in cls.image_keys and "role_predicate_embed" in cls.text_keys


def test_untrained_grounding_is_the_base_cosine_and_a_caption_without_relations_scores_no_relation_term():
    head = Grounded(GroundedConfig(), D)
    img = head.encode_image(image_batch([((0, box_at(20, 32)), (1, box_at(44, 32)))]))
    txt = head.encode_text(text_batch([[]]))  # no triplet, no entity
    txt["entity"][0, 0], txt["entity_valid"][0, 0] = OBJECTS[1], True
    img, txt = head.trimmed(img, txt)
    g = head.grounding(txt["entity"], img)
    assert torch.allclose(g[0, 0, 0, :2], torch.tensor([0.0, 1.0]))  # <phrase, crop>, the geometry term at zero
    parts = head.parts(img, txt)
    assert parts["relation"].item() == 0.0
    assert parts["entity"].item() == pytest.approx(1.0)
    expected = parts["base"] + head.entity_weight * parts["entity"]
    assert torch.allclose(head.score(img, txt), expected)


@pytest.mark.slow
def test_trimming_unused_slots_leaves_every_score_unchanged(head):
    images, pos, neg = training_set(12, seed=5)
    img, txt = head.encode_image(images), head.encode_text({k: torch.cat([pos[k], neg[k]]) for k in pos})
    full = head.combine(head.parts(img, txt))  # on all E, P, R slots
    assert torch.allclose(head.score(img, txt), full, atol=1e-6)


def test_features_are_in_image_units():
    boxes = torch.tensor([[[8.0, 8.0, 24.0, 24.0], [40.0, 8.0, 56.0, 24.0]]])
    small = box_features(boxes, torch.tensor([[64.0, 64.0]]))
    large = box_features(boxes * 4, torch.tensor([[256.0, 256.0]]))
    assert torch.allclose(small, large)
    pairs = pair_features(small)
    assert pairs.shape == (1, 2, 2, 12)
    assert pairs[0, 0, 1, 0].item() == pytest.approx(0.5)   # the second box is half the image to the right
    assert pairs[0, 1, 0, 0].item() == pytest.approx(-0.5)  # and the first to the left of it


@pytest.mark.slow
def test_only_positions_differ_and_the_converse_caption_scores_lower(head):
    """Two images holding the same two objects, mirrored; a caption and its converse: the pooled embeddings
    cannot tell any of them apart, the trained head must."""
    red, blue = 0, 1
    left_right = image_batch([((red, box_at(16, 32)), (blue, box_at(48, 32))),
                              ((red, box_at(48, 32)), (blue, box_at(16, 32)))])
    top_bottom = image_batch([((red, box_at(32, 14)), (blue, box_at(32, 50))),
                              ((red, box_at(32, 50)), (blue, box_at(32, 14)))])
    with torch.no_grad():
        for images, k in ((left_right, 0), (top_bottom, 2)):  # "left of" / "above" of the hidden meaning
            captions = text_batch([[(red, k, blue)], [(red, k + 1, blue)], [(blue, k, red)]])
            s = head.score(head.encode_image(images), head.encode_text(captions))
            assert images["image_embed"][0].equal(images["image_embed"][1])  # same bag of objects
            # image 0: red left of (above) blue is true; its converse and the swapped caption are false
            assert s[0, 0] > s[0, 1] and s[0, 0] > s[0, 2]
            # image 1, mirrored: the other way round
            assert s[1, 1] > s[1, 0] and s[1, 2] > s[1, 0]
            # each caption prefers the image where it holds
            assert s[0, 0] > s[1, 0] and s[1, 1] > s[0, 1]


@pytest.mark.slow
def test_learned_meanings_follow_the_captions_not_the_names():
    """The same world with the predicate embeddings permuted (what "left of" says is now said by another vector):
    the head learns the new assignment to the same accuracy."""
    global PREDICATES
    original = PREDICATES
    accuracy = []
    try:
        for perm in ([0, 1, 2, 3], [2, 3, 1, 0]):
            PREDICATES = original[perm]
            head = trained_head(steps=200, seed=1)
            images, pos, neg = training_set(200, seed=9)  # held-out scenes
            with torch.no_grad():
                img = head.encode_image(images)
                sp = head.score(img, head.encode_text(pos)).diagonal()
                sn = head.score(img, head.encode_text(neg)).diagonal()
            accuracy.append((sp > sn).float().mean().item())
    finally:
        PREDICATES = original
    assert min(accuracy) > 0.95, accuracy
    assert abs(accuracy[0] - accuracy[1]) < 0.04, accuracy


def test_negatives_loss_trains_the_relation_term_only_on_relational_negatives():
    head = Grounded(GroundedConfig(), D)
    images, pos, neg = training_set(8, seed=2)
    img, txt, nt = head.encode_image(images), head.encode_text(pos), head.encode_text(neg)
    neg_reps = {k: v[:, None] for k, v in nt.items()}
    valid = torch.ones(8, 1, dtype=torch.bool)
    attribute = head.negatives_loss(img, txt, neg_reps, valid, ("replace-att",))
    assert set(attribute) == {"loss", "hard_negatives"}  # the choice among the own negatives only
    out = head.negatives_loss(img, txt, neg_reps, valid, ("replace-rel",))
    assert set(out) == {"loss", "hard_negatives", "relation_bce"}
    # with counts, the count term's loss is there on every rank (DDP reduces the same terms), 0 without numerals
    counting = Grounded(GroundedConfig(counts=True), D)
    counted = counting.negatives_loss(counting.encode_image(images), counting.encode_text(pos),
                                      {k: v[:, None] for k, v in counting.encode_text(neg).items()}, valid,
                                      ("replace-att",))
    assert set(counted) == {"loss", "hard_negatives", "count_nll"} and counted["count_nll"].item() == 0
    assert math.isfinite(out["loss"].item()) and out["relation_bce"].item() > 0
    out["relation_bce"].backward()
    assert head.pair_code[0].weight.grad.abs().sum() > 0 and head.predicate.weight.grad.abs().sum() > 0
    control = Grounded(GroundedConfig(relations=False), D)
    assert "relation_bce" not in control.negatives_loss(img, txt, neg_reps, valid, ("swap-obj",))
    # an invalid negative slot takes no part: the choice is then among the positive alone
    none = head.negatives_loss(img, txt, neg_reps, torch.zeros(8, 1, dtype=torch.bool), ("swap-att",))
    assert none["hard_negatives"].item() == 0.0


def test_paired_parts_equal_the_diagonal_of_the_full_matrices():
    head = spread_head(3)
    images, pos, _ = training_set(16, seed=3)
    img, txt = head.encode_image(images), head.encode_text(pos)
    full = head.parts(*head.trimmed(img, txt))
    paired = head.paired_parts(img, txt)
    for name in ("base", "entity", "relation"):
        assert torch.allclose(full[name].diagonal(), paired[name], atol=1e-5), name
    assert torch.allclose(head.score(img, txt).diagonal(), head.combine(paired), atol=1e-5)


def test_negative_parts_in_one_call_equal_paired_parts_per_negative():
    """The fast path (every image against its K negatives in one call) against its reference, one call per negative
    slot; the slots name different numbers of phrases and relations, so the joint trimming pads some of them."""
    head = spread_head(5)
    images, pos, neg = training_set(12, seed=5)
    img, txt, nt = head.encode_image(images), head.encode_text(pos), head.encode_text(neg)
    order = torch.randperm(12)
    plain = {k: v[order] for k, v in txt.items()}
    plain["role_valid"] = plain["role_valid"] & (torch.arange(12) >= 6)[:, None]  # six captions without a relation
    slots = [nt, plain, {k: v[order.flip(0)] for k, v in nt.items()}]
    negative_reps = {k: torch.stack([slot[k] for slot in slots], 1) for k in nt}
    fast = head.negative_parts(img, negative_reps)
    for j, slot in enumerate(slots):
        reference = head.paired_parts(img, slot)
        for name, value in reference.items():
            assert fast[name].shape == (12, 3)
            assert torch.allclose(fast[name][:, j], value, atol=1e-5), (name, j)
    assert fast["has_relation"].any() and not fast["has_relation"].all()  # both kinds of slot are in the check


def test_pair_codes_only_on_used_slots_give_the_full_codes_scores_losses_and_gradients():
    """encode_image codes the box pairs only up to the last slot any image uses (zeros after): every score, the
    hard-negative loss and every gradient equal those of the reference that codes all E x E pairs, here with junk
    boxes in the unused slots (a padded cache's slots are not read, whatever they hold)."""
    head = spread_head(6)
    images, pos, neg = training_set(10, seed=6)
    images["ventity_boxes"][:, 2:] = torch.rand(10, E - 2, 4) * SIZE  # slots 2.. are invalid in every image
    assert not images["ventity_valid"][:, 2:].any()

    def reference(batch):  # the pair code of every ordered pair of the E slots
        reps = head.encode_image(batch)
        geom = box_features(batch["ventity_boxes"], batch["ventity_image_size"])
        return {**reps, "pairs": head.code_pairs(pair_features(geom), batch["ventity_overlap"])}

    trained = [(name, p) for name, p in head.named_parameters() if p.requires_grad]

    def outputs(img):
        txt, nt = head.encode_text(pos), head.encode_text(neg)
        negs = {k: torch.stack([nt[k], nt[k].flip(0)], 1) for k in nt}
        loss = head.negatives_loss(img, txt, negs, torch.ones(10, 2, dtype=torch.bool), ("swap-obj", "swap-att"))
        total = loss["loss"] + head.loss(img, txt)["loss"]
        grads = torch.autograd.grad(total, [p for _, p in trained], allow_unused=True)
        return head.score(img, txt), head.combine(head.paired_parts(img, txt)), total, grads

    got, want = head.encode_image(images), reference(images)
    assert got["pairs"].shape == want["pairs"].shape == (10, E, E, head.config.hidden)  # the shape two ranks gather
    assert not got["pairs"][:, 2:].any() and not got["pairs"][:, :, 2:].any()
    assert want["pairs"][:, 2:].abs().sum() > 0  # the reference does code the junk slots
    (*fast, fast_grads), (*full, full_grads) = outputs(got), outputs(want)
    for a, b in zip(fast, full):
        assert torch.allclose(a, b, atol=1e-6)
    for (name, _), g, w in zip(trained, fast_grads, full_grads):
        assert (g is None) == (w is None), name
        if g is not None:
            assert torch.allclose(g, w, atol=1e-6, rtol=1e-5), name
    assert fast_grads[[name for name, _ in trained].index("pair_code.0.weight")].abs().sum() > 0


def test_the_one_process_loss_scores_the_batch_once_with_both_directions_gradients():
    """One process scores the [B, B] matrix once and reads it both ways: the loss and every gradient are those of
    CLIP's two directions scored apart (the image rows against every text, the text rows against every image)."""
    head = spread_head(4)
    images, pos, _ = training_set(12, seed=4)
    calls = []
    score = head.score
    head.score = lambda *a, **k: calls.append(1) or score(*a, **k)  # noqa: E731 - counts the batch's scorings
    loss = head.loss(head.encode_image(images), head.encode_text(pos))["loss"]
    assert len(calls) == 1
    trained = [(name, p) for name, p in head.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, [p for _, p in trained], allow_unused=True)
    img, txt = head.encode_image(images), head.encode_text(pos)
    scale = head.logit_scale.exp()
    labels = torch.arange(12)
    reference = 0.5 * (F.cross_entropy(scale * score(img, txt), labels) + F.cross_entropy((scale * score(img, txt)).T,
                                                                                          labels))
    want = torch.autograd.grad(reference, [p for _, p in trained], allow_unused=True)
    assert torch.allclose(loss, reference, atol=1e-6)
    for (name, _), g, w in zip(trained, got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert torch.allclose(g, w, atol=1e-6, rtol=1e-5), name
    assert any(g is not None and g.abs().sum() > 0 for g in got)


# --------------------------------------------------------------------------- in front of / behind: the same boxes
FRONT, BEHIND = torch.eye(D)[12], torch.eye(D)[13]  # two more predicate words, meaning nothing by themselves
COLOURS_RGB = [(230, 25, 25), (40, 90, 255), (30, 190, 50), (250, 225, 30)]


def overlapping_scene(g: torch.Generator):
    """Two objects of the four, overlapping squares with the same two boxes whichever is drawn last: (the pair, the
    boxes, the ventity_overlap of each drawing order, computed from rendered pixels by the cache's component)."""
    import numpy as np
    from PIL import Image, ImageDraw

    from extract.components.overlap import ownership

    a, b = torch.randperm(4, generator=g)[:2].tolist()
    x, y = (torch.rand(2, generator=g) * 30 + 8).tolist()
    boxes = [[x, y, x + 16, y + 16], [x + 4, y + 7, x + 20, y + 23]]
    codes = []
    for last in (1, 0):  # object b drawn last (in front), then object a
        image = Image.new("RGB", (64, 64), (40, 40, 40))
        pen = ImageDraw.Draw(image)
        for k in ((0, 1) if last == 1 else (1, 0)):
            pen.rectangle([round(v) for v in boxes[k][:2]] + [round(v) - 1 for v in boxes[k][2:]],
                          fill=COLOURS_RGB[(a, b)[k]])
        codes.append(torch.from_numpy(ownership(np.asarray(image), np.asarray(boxes, np.float32), E)))
    return (a, b), boxes, codes


def occlusion_batches(n: int, seed: int):
    """n scenes, each in the order its coin says: images, captions "front-object in front of back-object" or the same
    fact said as "back behind front" (even odds), and each caption's swap-obj negative."""
    g = torch.Generator().manual_seed(seed)
    scenes, pos, neg = [], [], []
    codes = []
    for _ in range(n):
        (a, b), boxes, (b_front, a_front) = overlapping_scene(g)
        front, back, code = (b, a, b_front) if bool(torch.rand(1, generator=g) < 0.5) else (a, b, a_front)
        scenes.append(((a, boxes[0]), (b, boxes[1])))
        codes.append(code)
        said = [(front, 0, back)] if bool(torch.rand(1, generator=g) < 0.5) else [(back, 1, front)]
        pos.append(said)
        neg.append([(said[0][2], said[0][1], said[0][0])])
    images = image_batch(scenes)
    images["ventity_overlap"] = torch.stack(codes)
    return images, occlusion_text(pos), occlusion_text(neg)


def occlusion_text(triplets):
    out = text_batch([[(s, 0, o) for s, _, o in rels] for rels in triplets])
    for t, rels in enumerate(triplets):
        out["role_predicate_embed"][t, 0] = FRONT if rels[0][1] == 0 else BEHIND
    return out


def occlusion_trained(appearance: bool, steps: int = 80) -> Grounded:
    """The head trained on :func:`occlusion_batches` (64 scenes, 80 full-batch steps; 60 steps read the held-out
    scenes at 100 % with the overlap code for five seeds of weights and data), with or without the overlap code: the
    same seed, data and steps either way."""
    torch.manual_seed(0)
    head = Grounded(GroundedConfig(hidden=32, appearance=appearance), D)
    images, pos, neg = occlusion_batches(64, seed=3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        out = head.negatives_loss(head.encode_image(images), head.encode_text(pos),
                                  {k: v[:, None] for k, v in head.encode_text(neg).items()},
                                  torch.ones(len(pos["text_embed"]), 1, dtype=torch.bool), ("swap-obj",))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    return head.eval()


def held_out_occlusion(head: Grounded, n: int = 40) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the share of held-out images where "b in front of a" and "b behind a" are ranked as the drawing order says,
    each scene's two score rows [b drawn last, a drawn last]): the same two boxes, only the pixels' order differs."""
    g = torch.Generator().manual_seed(99)  # held-out scenes
    right, rows = [], []
    for _ in range(n):
        (a, b), boxes, (b_front, a_front) = overlapping_scene(g)
        captions = occlusion_text([[(b, 0, a)], [(b, 1, a)]])  # "b in front of a", "b behind a"
        pair = []
        for code, b_is_front in ((b_front, True), (a_front, False)):
            img = image_batch([((a, boxes[0]), (b, boxes[1]))])
            img["ventity_overlap"] = code[None]
            with torch.no_grad():
                s = head.score(head.encode_image(img), head.encode_text(captions))[0]
            right.append(bool(s[0] > s[1]) == b_is_front)
            pair.append(s)
        rows.append(tuple(pair))
    return sum(right) / len(right), rows


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_in_front_of_is_learned_from_who_owns_the_overlap_and_the_control_trained_alike_cannot():
    """Hand-built caches where only the drawing order differs (the same two boxes, the overlap code from rendered
    pixels): trained on captions and their swap-obj negatives, the head scores "X in front of Y" above "X behind Y"
    for the image where X is drawn last, and the reverse for the other. The control (``appearance=False``), trained
    the same way on the same data, cannot: it scores the two drawing orders the same to the last bit, so it ranks
    exactly half of the images right, whatever it learned."""
    head, control = occlusion_trained(True), occlusion_trained(False)
    accuracy, _ = held_out_occlusion(head)
    assert accuracy >= 0.95, accuracy
    accuracy, rows = held_out_occlusion(control)
    assert accuracy == 0.5, accuracy
    for b_front, a_front in rows:
        assert torch.equal(b_front, a_front)  # geometry alone: the same boxes, the same scores
    assert head.overlap_code.abs().sum() > 0 and "overlap_code" not in dict(control.named_parameters())
    untrained = Grounded(GroundedConfig(hidden=32, appearance=False), D)
    assert not torch.equal(control.pair_code[0].weight, untrained.pair_code[0].weight)  # the control was trained too


def test_the_overlap_weights_start_at_zero_and_the_head_starts_as_the_geometry_only_one_to_the_bit():
    """With ``appearance`` the overlap code enters through weights that are zero and drawn from no random stream: under
    one seed every other parameter equals the control's bit for bit, the random stream is left where the control
    leaves it, and on images whose boxes overlap (a non-zero overlap code) every score and pair code is the control's,
    to the bit."""
    images, pos, neg = occlusion_batches(8, seed=4)
    assert images["ventity_overlap"].abs().sum() > 0
    for seed in (0, 1):
        torch.manual_seed(seed)
        head = Grounded(GroundedConfig(hidden=32), D)
        after_head = torch.get_rng_state()
        torch.manual_seed(seed)
        control = Grounded(GroundedConfig(hidden=32, appearance=False), D)
        assert torch.equal(after_head, torch.get_rng_state())  # the overlap weights took nothing from the stream
        assert head.overlap_code.shape == (OVERLAP_FEATURES, 32)
        assert torch.equal(head.overlap_code, torch.zeros(OVERLAP_FEATURES, 32))
        own = dict(head.named_parameters())
        assert set(own) - set(dict(control.named_parameters())) == {"overlap_code"}
        for name, value in control.named_parameters():
            assert torch.equal(own[name], value), name
        with torch.no_grad():
            img, ctl = head.encode_image(images), control.encode_image(images)
            assert torch.equal(img["pairs"], ctl["pairs"])
            texts = {k: torch.cat([pos[k], neg[k]]) for k in pos}
            assert torch.equal(head.score(img, head.encode_text(texts)), control.score(ctl, control.encode_text(texts)))


@pytest.mark.slow
def test_a_triplet_costs_at_most_log_of_the_floor_and_no_floor_is_the_plain_log_probability(head):
    """relation_floor eps: log(eps + (1 - eps) P), so one triplet that fails (or a box the detector missed) moves a
    score by at most log(eps) x w_R; at eps = 0 the term is the log-probability itself, to the bit."""
    images = image_batch([((0, box_at(16, 32)), (1, box_at(48, 32))), ((2, box_at(32, 14)), (3, box_at(32, 50)))])
    captions = text_batch([[(0, p, 1)] for p in range(4)] + [[(1, p, 0)] for p in range(4)])
    plain = Grounded(GroundedConfig(hidden=32, relation_floor=0.0, same_box_prior=0.0), D).eval()
    plain.load_state_dict(head.state_dict())
    floored = Grounded(GroundedConfig(hidden=32, relation_floor=0.02, same_box_prior=0.0), D).eval()
    floored.load_state_dict(head.state_dict())
    with torch.no_grad():
        img, txt = plain.encode_image(images), plain.encode_text(captions)
        p = plain.relation_triplets(img, txt)[..., 0]
        q = floored.relation_triplets(img, txt)[..., 0]
    assert p.min() < math.log(0.02)  # the trained head says the converses fail outright
    assert q.min() >= math.log(0.02) - 1e-6
    assert torch.allclose(q.exp(), 0.02 + 0.98 * p.exp(), atol=1e-6)


@pytest.mark.slow
def test_where_subject_and_object_ground_to_one_box_every_predicate_reads_the_prior(head):
    """The object's own box missing, its phrase lands on the subject's box (a crop showing both, as the front
    object's crop shows the hidden one): the boxes cannot tell the relation, so with same_box_prior every predicate
    scores alike and the caption falls back to what the image still says; without it the predicates read the one
    other box, far away, and rank each other."""
    images = image_batch([((0, box_at(20, 32)), (2, box_at(52, 32)))])
    images["ventity_embed"][0, 0] = F.normalize(OBJECTS[0] + OBJECTS[1], dim=0)  # red, and blue behind it
    captions = text_batch([[(0, p, 1)] for p in range(4)])  # "red <p> blue", blue's box missing
    off = Grounded(GroundedConfig(hidden=32, same_box_prior=0.0, relation_floor=0.0), D).eval()
    off.load_state_dict(head.state_dict())
    on = Grounded(GroundedConfig(hidden=32, same_box_prior=0.5, relation_floor=0.0), D).eval()
    on.load_state_dict(head.state_dict())
    with torch.no_grad():
        r_off = off.relation_triplets(off.encode_image(images), off.encode_text(captions))[0, :, 0]
        r_on = on.relation_triplets(on.encode_image(images), on.encode_text(captions))[0, :, 0]
    assert (r_off.max() - r_off.min()) > 1.0, r_off
    assert (r_on.max() - r_on.min()) < 0.05, r_on
    assert torch.allclose(r_on, torch.full_like(r_on, math.log(0.5)), atol=0.05)


# --------------------------------------------------------------------------- explain_score: the overlap evidence
def ownership_code(subject_front: bool | None) -> torch.Tensor:
    """ventity_overlap [E, E, F] of boxes 0 and 1 as extract/components/overlap.py lays it out, hand-built: the front
    object's colour fills the overlap (seen), spans its box (extent), bites the hull of the one behind and shows its
    whole, mirror-symmetric shape (mirror, flip); entry (b, c) describes b against c. None: boxes apart (zeros, as
    overlap.py writes them)."""
    code = torch.zeros(E, E, OVERLAP_FEATURES)
    if subject_front is None:
        return code
    front, back = (0, 1) if subject_front else (1, 0)
    seen, extent, bite = {front: 1.0, back: 0.1}, {front: 1.0, back: 0.7}, {front: 0.0, back: 0.25}
    mirror, flip = {front: 0.95, back: 0.6}, {front: 0.9, back: 0.7}
    for b, c in ((0, 1), (1, 0)):
        code[b, c] = torch.tensor([1.0, seen[b], seen[c], seen[b] - seen[c], extent[b], extent[c],
                                   extent[b] - extent[c], bite[b], bite[c], bite[c] - bite[b], 0.1, 0.1,
                                   mirror[b], mirror[c], mirror[b] - mirror[c], flip[b], flip[c], flip[b] - flip[c]])
    return code


def explained_overlaps(head: Grounded, boxes, code: torch.Tensor, triplet=(0, 0, 1)) -> list[dict]:
    """explain_score's overlap evidence for the caption "object s <FRONT> object o" on one image of objects 0 and 1
    in ``boxes``, its overlap features ``code``."""
    images = image_batch([((0, boxes[0]), (1, boxes[1]))])
    images["ventity_overlap"] = code[None]
    with torch.no_grad():
        return head.explain_score(head.encode_image(images), head.encode_text(occlusion_text([[triplet]])),
                                  images)["overlaps"]


OVERLAPPING = ([10.0, 10.0, 40.0, 40.0], [30.0, 30.0, 60.0, 60.0])


def test_explain_score_says_who_owns_the_overlap_of_the_boxes_a_relation_was_grounded_in():
    """Each triplet's evidence is that of the pair its subject and object were grounded in: where the two boxes
    overlap (their intersection, px) and whose pixels fill it by the overlap features; the same boxes with the
    evidence flipped name the object; boxes apart have no overlap and no owner; rules that split name nobody."""
    head = Grounded(GroundedConfig(hidden=32, relation_floor=0.0, same_box_prior=0.0), D).eval()
    [said] = explained_overlaps(head, OVERLAPPING, ownership_code(True))
    assert (said["subject"], said["object"], said["same_box"]) == (0, 1, False)
    assert said["region"] == (30.0, 30.0, 40.0, 40.0) and said["subject_box"] == tuple(OVERLAPPING[0])
    assert said["read"] and said["owner"] == "subject" and said["agree"] == len(OVERLAP_RULES)
    assert said["votes"] == {"seen": 1, "extent": 1, "bite": 1, "mirror": 1}
    assert said["differences"]["seen"] == pytest.approx(0.9)
    [flipped] = explained_overlaps(head, OVERLAPPING, ownership_code(False))
    assert flipped["region"] == said["region"] and flipped["owner"] == "object"
    assert flipped["agree"] == len(OVERLAP_RULES)
    assert flipped["votes"] == {"seen": -1, "extent": -1, "bite": -1, "mirror": -1}
    # the caption the other way round ("object 1 <FRONT> object 0"): its subject is box 1, which the evidence of
    # ownership_code(False) puts in front
    [turned] = explained_overlaps(head, OVERLAPPING, ownership_code(False), triplet=(1, 0, 0))
    assert (turned["subject"], turned["object"], turned["owner"]) == (1, 0, "subject")
    [apart] = explained_overlaps(head, (box_at(16, 32), box_at(48, 32)), ownership_code(None))
    assert apart["region"] is None and not apart["read"] and apart["owner"] is None and apart["agree"] == 0
    split = ownership_code(True)
    # seen and mirror say nothing, extent says the subject, bite the object
    split[0, 1, 3], split[0, 1, 9], split[0, 1, 14] = 0.0, -0.2, 0.0
    [undecided] = explained_overlaps(head, OVERLAPPING, split)
    assert undecided["read"] and undecided["owner"] is None and undecided["votes"] == {"seen": 0, "extent": 1,
                                                                                       "bite": -1, "mirror": 0}
    # the head's own reading of the pair: P(holds) with the evidence is this triplet's P (its grounding is sharp, no
    # floor, no prior); an untrained head reads nothing of the overlap yet (its overlap weights are zero)
    images = image_batch([((0, OVERLAPPING[0]), (1, OVERLAPPING[1]))])
    images["ventity_overlap"] = ownership_code(True)[None]
    with torch.no_grad():
        parts = head.explain_score(head.encode_image(images), head.encode_text(occlusion_text([[(0, 0, 1)]])), images)
    relation = next(c for c in parts["components"] if c[0] == "relation")
    assert parts["overlaps"][0]["holds"] == pytest.approx(relation[2], abs=1e-4)
    assert said["holds"] == said["holds_without"]
    # without the arrays there is no evidence to give, and the rest of the explanation is the same
    with torch.no_grad():
        plain = head.explain_score(head.encode_image(images), head.encode_text(occlusion_text([[(0, 0, 1)]])))
    assert plain["overlaps"] == [] and plain["components"] == parts["components"] and plain["terms"] == parts["terms"]


def test_the_evidence_is_what_the_head_reads_and_what_the_pixels_say():
    """A head whose overlap weights are not zero reads the evidence: P(holds) of the pair moves with it, and the
    control (appearance off) reads the same with and without it. On rendered squares (overlap.py on drawn pixels:
    the same two boxes, only the drawing order differs) the owner is the square drawn last."""
    torch.manual_seed(0)
    head = Grounded(GroundedConfig(hidden=32), D).eval()
    with torch.no_grad():
        head.overlap_code.normal_(std=1.0)
    front, back = (explained_overlaps(head, OVERLAPPING, ownership_code(s))[0] for s in (True, False))
    assert abs(front["holds"] - front["holds_without"]) > 1e-3 and front["holds"] != back["holds"]
    assert front["holds_without"] == pytest.approx(back["holds_without"], abs=1e-6)  # the same boxes
    control = Grounded(GroundedConfig(hidden=32, appearance=False), D).eval()
    [c] = explained_overlaps(control, OVERLAPPING, ownership_code(True))
    assert c["holds"] == pytest.approx(c["holds_without"], abs=1e-6) and c["owner"] == "subject"
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        (a, b), boxes, (b_front, a_front) = overlapping_scene(g)
        for code, b_is_front in ((b_front, True), (a_front, False)):
            images = image_batch([((a, boxes[0]), (b, boxes[1]))])
            images["ventity_overlap"] = code[None]
            with torch.no_grad():
                [e] = head.explain_score(head.encode_image(images), head.encode_text(occlusion_text([[(b, 0, a)]])),
                                         images)["overlaps"]  # "b in front of a": subject b (box 1), object a
            assert (e["subject"], e["object"]) == (1, 0) and e["region"] is not None and e["read"]
            assert e["owner"] == ("subject" if b_is_front else "object"), (e["votes"], b_is_front)


# --------------------------------------------------------------------------------------------- counts
def counted_text(items: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Captions of one counted phrase each: (object index, the numeral it says; 0 for none)."""
    out = text_batch([[] for _ in items])
    for t, (obj, n) in enumerate(items):
        out["entity_embed"][t, 0], out["entity_valid"][t, 0], out["entity_count"][t, 0] = OBJECTS[obj], True, n
        out["text_embed"][t] = OBJECTS[obj]
    return out


def crowd(g: torch.Generator, copies: int) -> tuple[tuple[int, list[float]], ...]:
    """``copies`` boxes of object 0 and the rest of the E slots other objects, anywhere."""
    objs = [0] * copies + [int(k) for k in torch.randint(1, 4, (E - copies,), generator=g)]
    return tuple((o, box_at(*(torch.rand(2, generator=g) * 44 + 10).tolist())) for o in objs)


def test_the_count_is_poisson_binomial_over_the_boxes_as_every_subset_of_them_says():
    """The fast path (a pass over the boxes) against the reference: the probability of each subset of boxes
    holding the phrase, summed by size."""
    import itertools

    torch.manual_seed(0)
    head = spread_head(1, counts=True)
    with torch.no_grad():
        head.count_threshold.fill_(0.1)
    g = torch.Generator().manual_seed(2)
    img = head.encode_image(image_batch([crowd(g, 2), crowd(g, 1)]))
    img["box_valid"][1, 3] = False  # an empty slot holds nothing
    phrases, numerals = F.normalize(torch.randn(3, D), dim=-1), torch.tensor([1, 2, 5])
    got = head.count_log_probs(img, phrases, numerals).exp()                          # [I, K]
    temperature = head.count_log_temperature.exp()
    ask = phrases @ head.count_geometry.T  # the count's own ask of the box geometry
    g = torch.einsum("kd,ied->ike", phrases, img["crops"]) + torch.einsum("kh,ieh->ike", ask, img["box_geom"])
    p = torch.sigmoid((g - head.count_threshold) / temperature)
    p = p * img["box_valid"][:, None]
    eps = head.config.relation_floor
    for i in range(2):
        for k, n in enumerate(numerals.tolist()):
            exact = sum(math.prod(float(p[i, k, b]) if b in chosen else 1 - float(p[i, k, b]) for b in range(E))
                        for chosen in itertools.combinations(range(E), n)) if n <= E else 0.0
            assert float(got[i, k]) == pytest.approx(eps + (1 - eps) * exact, rel=1e-5, abs=1e-7)
    paired = head.count_log_probs(img, phrases[:2], numerals[:2], paired=True).exp()
    assert torch.allclose(paired, torch.stack([got[0, 0], got[1, 1]]))


def test_a_numeral_is_read_from_how_many_boxes_hold_its_phrase_once_the_count_term_has_learned():
    """Scenes with one to three copies of one object among others: trained on its own loss (the caption's
    numeral in its own image), the count term puts each caption above the same caption with another number, in
    scenes it never saw; a caption without a numeral gets no count term, and --no-counts has none."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    copies = torch.randint(1, 4, (96,), generator=g).tolist()
    images = image_batch([crowd(g, c) for c in copies])
    head = Grounded(GroundedConfig(hidden=16, counts=True), D)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.0)
    text = counted_text([(0, c) for c in copies])
    for _ in range(60):
        pos = head.paired_parts(head.encode_image(images), head.encode_text(text))
        loss = -(pos["count_sum"] * pos["has_count"]).sum() / pos["has_count"].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    test_copies = torch.randint(1, 4, (48,), generator=g).tolist()
    img = head.encode_image(image_batch([crowd(g, c) for c in test_copies]))
    right = head.paired_parts(img, head.encode_text(counted_text([(0, c) for c in test_copies])))["count"]
    wrong = head.paired_parts(img, head.encode_text(counted_text([(0, c % 3 + 1) for c in test_copies])))["count"]
    assert (right > wrong).float().mean() >= 0.9
    plain = head.paired_parts(img, head.encode_text(counted_text([(0, 0)] * 48)))
    assert not plain["has_count"].any() and (plain["count"] == 0).all()
    # the count's loss trains its own parts only: the grounding the entity and relation terms read is left alone
    head.zero_grad()
    pos = head.paired_parts(head.encode_image(images), head.encode_text(text))
    (-(pos["count_sum"]).sum()).backward()
    assert head.count_geometry.grad.abs().sum() > 0 and head.count_threshold.grad != 0
    assert all(p.grad is None or not p.grad.any() for p in (*head.box_code.parameters(),
                                                             *head.phrase_geometry.parameters()))
    off = Grounded(GroundedConfig(hidden=16), D)  # the default, for now (GroundedConfig.counts)
    assert (off.paired_parts(off.encode_image(images), off.encode_text(text))["count"] == 0).all()


def test_explain_score_gives_each_counted_phrase_the_probability_of_its_number():
    head = spread_head(4, counts=True)
    g = torch.Generator().manual_seed(1)
    img = head.encode_image(image_batch([crowd(g, 2)]))
    txt = head.encode_text(counted_text([(0, 2)]))
    parts = head.explain_score(img, txt)
    (count,) = [c for c in parts["components"] if c[0] == "count"]
    expected = head.count_log_probs(img, txt["entity"][0, :1], txt["entity_count"][0, :1]).exp()[0, 0]
    assert count[1] == 0 and count[3] is None and count[2] == pytest.approx(float(expected))
    assert parts["weights"]["count"] == head.config.count_weight
    score = sum(parts["weights"][k] * parts["terms"][k] for k in parts["weights"])
    assert score == pytest.approx(float(head.score(img, txt)[0, 0]), abs=1e-5)
    assert not [c for c in head.explain_score(img, head.encode_text(counted_text([(0, 0)])))["components"]
                if c[0] == "count"]


# --------------------------------------------------------------------------------------------- the boxes' pixels
SHINY, MATTE = torch.eye(D)[12], torch.eye(D)[13]  # two material words: directions the crops' embeddings never show


def thumbnail(g: torch.Generator, shiny: bool) -> torch.Tensor:
    """A box's pixels [SIDE, SIDE, 3] uint8: a shiny object has a bright highlight near its upper middle, a matte one
    is flat; both of a random dull colour."""
    from extract.components.thumbnails import SIDE

    pix = torch.full((SIDE, SIDE, 3), 90, dtype=torch.uint8) + torch.randint(0, 30, (1, 1, 3), generator=g).byte()
    if shiny:
        y, x = torch.randint(2, 5, (2,), generator=g).tolist()
        pix[y:y + 4, x:x + 4] = 250
    return pix


def material_batch(g: torch.Generator, n: int) -> tuple[dict, list[list[bool]]]:
    """n scenes of two boxes of different objects, each box shiny or matte at random; the crops' embeddings are the
    objects' alone, so only the pixels tell the materials."""
    from extract.components.thumbnails import SIDE

    scenes = [random_scene(g) for _ in range(n)]
    images = image_batch(scenes)
    images["ventity_pixels"] = torch.zeros(n, E, SIDE, SIDE, 3, dtype=torch.uint8)
    shiny = [[bool(torch.rand(1, generator=g) < 0.5) for _ in range(2)] for _ in range(n)]
    for i, flags in enumerate(shiny):
        for k, flag in enumerate(flags):
            images["ventity_pixels"][i, k] = thumbnail(g, flag)
    return images, [[(a, flags[0]), (b, flags[1])] for ((a, _), (b, _)), flags in zip(scenes, shiny)]


def material_text(phrases: list[tuple[int, bool]]) -> dict[str, torch.Tensor]:
    """Captions of one phrase each, "a shiny <object k>" / "a matte <object k>"."""
    out = text_batch([[] for _ in phrases])
    for t, (obj, shiny) in enumerate(phrases):
        out["entity_embed"][t, 0] = F.normalize(OBJECTS[obj] + (SHINY if shiny else MATTE), dim=0)
        out["entity_valid"][t, 0] = True
        out["text_embed"][t] = OBJECTS[obj]  # the pooled caption does not say the material either
    return out


def test_the_pixel_code_starts_where_it_changes_no_score_and_leaves_every_other_weight_as_it_was():
    """``pixels``: a head that reads the boxes' thumbnails starts as the one that does not, score for score, to the bit
    (the phrase's ask of a box is zero at the start); under one seed every other weight is the control's."""
    g = torch.Generator().manual_seed(1)
    images, objects = material_batch(g, 6)
    texts = material_text([objs[0] for objs in objects])
    torch.manual_seed(3)
    head = Grounded(GroundedConfig(hidden=16, pixels=True, counts=True), D)
    torch.manual_seed(3)
    control = Grounded(GroundedConfig(hidden=16, counts=True), D)
    own = dict(head.named_parameters())
    assert {n.split(".")[0] for n in set(own) - set(dict(control.named_parameters()))} == {"pixel_code"}
    # only the head that reads the thumbnails asks a cache for them (an index over an older cache serves the other)
    assert "ventity_pixels" in head.image_keys and "ventity_pixels" not in control.image_keys
    assert set(control.image_keys) | {"ventity_pixels"} == set(Grounded.image_keys)
    for name, value in control.named_parameters():
        assert torch.equal(own[name], value), name
    with torch.no_grad():
        img, ctl = head.encode_image(images), control.encode_image(images)
        assert not torch.equal(img["box_geom"], ctl["box_geom"])  # the pixels are read...
        assert torch.equal(head.score(img, head.encode_text(texts)), control.score(ctl, control.encode_text(texts)))


@pytest.mark.slow
def test_a_material_the_crops_embeddings_do_not_show_is_learned_from_the_pixels_and_the_control_cannot():
    """Two boxes per scene, each shiny or matte in its pixels only; captions name one box's material, negatives the
    other material. Trained on the head's own choice among a caption and its negative, the head with ``pixels`` puts
    the true material above the false one in scenes it never saw; the same head without reads them at chance."""
    def train(pixels: bool) -> Grounded:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        head = Grounded(GroundedConfig(hidden=16, pixels=pixels), D)
        images, objects = material_batch(g, 128)
        picks = [objs[int(torch.randint(2, (1,), generator=g))] for objs in objects]
        pos, neg = material_text(picks), material_text([(o, not s) for o, s in picks])
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(100):
            img, txt, nt = head.encode_image(images), head.encode_text(pos), head.encode_text(neg)
            out = head.negatives_loss(img, txt, {k: v[:, None] for k, v in nt.items()},
                                      torch.ones(len(picks), 1, dtype=torch.bool), ("replace-att",))
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
        return head.eval()

    g = torch.Generator().manual_seed(9)
    images, objects = material_batch(g, 48)
    picks = [objs[k % 2] for k, objs in enumerate(objects)]
    # without the pixels the head can learn one material word's preference, which is right for the half of the
    # items whose true material it prefers: chance, not a reading of the box
    for pixels, low, high in ((True, 0.9, 1.0), (False, 0.0, 0.6)):
        head = train(pixels)
        with torch.no_grad():
            img = head.encode_image(images)
            right = head.combine(head.paired_parts(img, head.encode_text(material_text(picks))))
            wrong = head.combine(head.paired_parts(img, head.encode_text(material_text([(o, not s) for o, s in picks]))))
        assert low <= (right > wrong + 1e-6).float().mean() <= high, pixels


def entity_loss_setup():
    """16 scenes of two boxes of one object; each caption names box 0's material ("a shiny <object>") and, unchanged
    in its negative, the bare object; its negative says the other material, which box 1 has: a text-only negative
    true of another object of the scene."""
    g = torch.Generator().manual_seed(3)
    images, objects = material_batch(g, 16)
    images["ventity_embed"][:, 1] = images["ventity_embed"][:, 0]
    for i, objs in enumerate(objects):
        images["ventity_pixels"][i, 1] = thumbnail(g, not objs[0][1])
        objects[i] = [objs[0], (objs[0][0], not objs[0][1])]
    picks = [objs[0] for objs in objects]
    pos, neg = material_text(picks), material_text([(o, not s) for o, s in picks])
    for text in (pos, neg):
        for t, objs in enumerate(objects):
            text["entity_embed"][t, 1], text["entity_valid"][t, 1] = OBJECTS[objs[1][0]], True
    torch.manual_seed(0)
    head = Grounded(GroundedConfig(hidden=16, pixels=True, entity_loss=1.0), D)
    nt = {k: torch.stack([v, v], 1) for k, v in head.encode_text(neg).items()}  # two slots, the same negative
    valid = torch.ones(16, 2, dtype=torch.bool)
    valid[3, 0] = False
    with torch.no_grad():
        head.phrase_geometry.weight.normal_(0, 0.3)  # away from zero, so the pixels count
    return head, images, pos, nt, valid


def test_the_entity_loss_is_a_logistic_on_each_changed_phrase_in_the_box_the_captions_phrase_grounds_to():
    """``entity_loss``: -log sigmoid((g(x, b*) - g(x', b*)) / tau), x a phrase the negative changed into x', b* the
    box x grounds to best, averaged over the changed phrases of the replace-att / replace-obj slots (the reference,
    written out here, one phrase and one box at a time); unchanged phrases and the other types' slots take no part;
    absent when off."""
    head, images, pos, nt, valid = entity_loss_setup()
    img, txt = head.encode_image(images), head.encode_text(pos)
    out = head.negatives_loss(img, txt, nt, valid, ("replace-att", "swap-att"))
    tau = head.log_temperature.exp()

    def g(x, i, b):  # the grounding of phrase x in box b of image i, as the module docstring writes it
        return x @ img["crops"][i, b] + head.phrase_geometry(x) @ img["box_geom"][i, b]

    losses = []
    for i in range(16):
        for p in range(P):
            x, x_neg = txt["entity"][i, p], nt["entity"][i, 0, p]
            if not (valid[i, 0] and txt["entity_valid"][i, p] and not torch.equal(x, x_neg)):
                continue
            best = max((b for b in range(E) if img["box_valid"][i, b]), key=lambda b: float(g(x, i, b)))
            losses.append(F.softplus(-(g(x, i, best) - g(x_neg, i, best)) / tau))
    assert len(losses) == 15  # one changed phrase per caption, one caption without a valid slot
    assert torch.allclose(out["entity_logistic"], torch.stack(losses).mean(), rtol=1e-5)
    assert "entity_logistic" not in head.negatives_loss(img, txt, nt, valid, ("swap-att", "swap-obj"))
    # a toy world's own negatives say which attribute they replace (--hard-negatives world): the same loss
    by_kind = head.negatives_loss(img, txt, nt, valid, ("replace-material", "swap-att"))["entity_logistic"]
    torch.testing.assert_close(by_kind, out["entity_logistic"])
    off = Grounded(GroundedConfig(hidden=16, pixels=True), D)
    assert "entity_logistic" not in off.negatives_loss(off.encode_image(images), off.encode_text(pos), nt, valid,
                                                       ("replace-att", "replace-obj"))


@pytest.mark.slow
def test_the_entity_loss_alone_teaches_a_phrase_to_ground_better_than_its_negative():
    """Its gradient reaches the phrase's ask of a box and not the grounding temperature; a few steps of it alone put
    each caption's phrase above its negative's in the box it names."""
    head, images, pos, nt, valid = entity_loss_setup()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(40):
        out = head.negatives_loss(head.encode_image(images), head.encode_text(pos), nt, valid, ("replace-att",) * 2)
        opt.zero_grad()
        out["entity_logistic"].backward()
        if step == 0:
            assert head.phrase_geometry.weight.grad.abs().sum() > 0 and head.log_temperature.grad is None
        opt.step()
    with torch.no_grad():
        margin, ok = head.entity_margins(head.encode_image(images), head.encode_text(pos), nt, valid, [0])
    assert (margin[ok] > 0).float().mean() >= 0.9
