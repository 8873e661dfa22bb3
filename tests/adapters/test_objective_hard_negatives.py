"""adapters/objectives/hard_negatives.py and train.pretrain.engine --hard-negatives: NegCLIP's extra columns for every
objective, drawn from the training captions only."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("spacy")

from adapters.objectives.base import StepContext  # noqa: E402
from adapters.objectives.hard_negatives import WithHardNegatives  # noqa: E402
from adapters.registry import PRETRAIN  # noqa: E402
from extract.worlds import toyworld  # noqa: E402
from extract.components.hard_negatives import HardNegatives  # noqa: E402

CAPTIONS = ["a red circle to the left of a blue square", "a small green star", "a cup on a table",
            "a cup under a table", "a yellow circle above a purple star", "a large blue square"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    from train.pretrain.trainer import create_model

    return create_model("plugvlm-tiny", False, 0)


@pytest.fixture(scope="module")
def generator():
    return HardNegatives.for_captions(CAPTIONS)


def test_the_softmax_holds_the_negatives_as_extra_columns(model, generator):
    net, _, _, tokenizer = model
    objective = WithHardNegatives(PRETRAIN.get("clip")(), generator, weight=0.5, seed=1)
    captions = CAPTIONS[:4]
    batch = objective.prepare(captions, ["a", "b", "c", "d"], tokenizer)
    assert batch["hn_text"].shape[:2] == (4, 5) and batch["hn_valid"].shape == (4, 5)
    # "a small green star" has one object and no relation: no replace-rel, swap-att or swap-obj
    assert batch["hn_valid"][1].tolist() == [True, True, False, False, False]
    assert batch["hn_valid"][0].all()
    batch.update(image=torch.randn(4, 3, 64, 64), text=tokenizer(captions))
    feats = objective.features(net, batch, StepContext())
    out = objective.loss(feats, StepContext())

    # by hand: image i against the 4 captions and the 20 negative slots, the invalid ones left out
    img, txt, scale = feats["image_features"], feats["text_features"], feats["logit_scale"]
    neg = F.normalize(net.encode_text(batch["hn_text"].flatten(0, 1)), dim=-1)
    logits = scale * img @ torch.cat([txt, neg]).T
    logits[:, 4:][:, ~batch["hn_valid"].flatten()] = float("-inf")
    expected = F.cross_entropy(logits, torch.arange(4))
    torch.testing.assert_close(out["hard_negatives"], expected.detach(), rtol=1e-5, atol=1e-5)
    clip = PRETRAIN.get("clip")().loss({k: feats[k] for k in ("image_features", "text_features", "logit_scale")},
                                       StepContext())["loss"]
    torch.testing.assert_close(out["loss"], clip + 0.5 * expected, rtol=1e-5, atol=1e-5)
    # the negatives' text tower gets a gradient: they are columns of the softmax, not decoration
    net.zero_grad()
    out["loss"].backward()
    assert net.token_embedding.weight.grad is not None
    grad_of = lambda: objective.negative_loss(feats, StepContext())  # noqa: E731
    valid_slot = feats["hn:text_features"][0, 0]
    g, = torch.autograd.grad(grad_of(), feats["hn:text_features"], retain_graph=True)
    assert g[0, 0].abs().sum() > 0 and g[1, 2].abs().sum() == 0  # an invalid slot takes no part
    assert valid_slot.requires_grad


def test_a_counted_type_fills_its_slots(model, generator):
    """'replace-rel*3' in pre-training: three slots of the type, filled with distinct texts where the vocabulary's
    predicates allow (a caption without a relation gets none)."""
    _, _, _, tokenizer = model
    counted = HardNegatives(generator.vocab, ("replace-rel",) * 3)
    objective = WithHardNegatives(PRETRAIN.get("clip")(), counted, seed=1)
    batch = objective.prepare(CAPTIONS[:3], ["a", "b", "c"], tokenizer)
    assert batch["hn_valid"].tolist() == [[True] * 3, [False] * 3, [True] * 3]
    for row in (0, 2):
        assert len({tuple(t.tolist()) for t in batch["hn_text"][row]}) == 3


def test_negatives_are_drawn_reproducibly_per_batch(model, generator):
    _, _, _, tokenizer = model
    objective = WithHardNegatives(PRETRAIN.get("clip")(), generator, seed=3)
    one = objective.prepare(CAPTIONS, list("abcdef"), tokenizer)
    two = objective.prepare(CAPTIONS, list("abcdef"), tokenizer)
    assert torch.equal(one["hn_text"], two["hn_text"])
    other = WithHardNegatives(PRETRAIN.get("clip")(), generator, seed=4).prepare(CAPTIONS, list("abcdef"), tokenizer)
    assert not torch.equal(one["hn_text"], other["hn_text"])


@pytest.mark.parametrize("method", ["filip", "powerclip"])
def test_every_objective_takes_negatives(model, generator, method):
    net, _, _, tokenizer = model
    objective = WithHardNegatives(PRETRAIN.get(method)(), generator)
    objective.setup(net, {"grid": tuple(net.visual.grid_size), "image_ids": None, "source": None})
    batch = objective.prepare(CAPTIONS[:3], ["a", "b", "c"], tokenizer)
    batch.setdefault("text", tokenizer(CAPTIONS[:3]))
    batch["image"] = torch.randn(3, 3, 64, 64)
    out = objective.loss(objective.features(net, batch, StepContext(global_batch=3)), StepContext(global_batch=3))
    assert torch.isfinite(out["loss"]) and out["hard_negatives"] > 0
    assert objective.name == method and "hard negatives" in objective.describe()


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    toyworld.generate(out, 64, seed=0, holdout="red circle,blue square", workers=1)
    return out


def test_a_run_with_negatives_records_them(toy, tmp_path, capsys):
    from train.pretrain.engine import main

    out = tmp_path / "run"
    assert main(["--data", str(toy), "--out", str(out), "--batch-size", "8", "--workers", "0", "--no-tensorboard",
                 "--eval-every-n-epochs", "0", "--max-steps", "2", "--log-every-n-steps", "1",
                 "--hard-negatives", "swap-att,replace-obj", "--hard-negative-weight", "2"]) == 0
    printed = capsys.readouterr().out
    assert "hard negatives: vocabulary of" in printed and "+ hard negatives (replace-obj, swap-att; weight 2)" in printed
    desc = json.loads((out / "model.json").read_text())
    assert desc["method"] == "clip" and desc["method_config"]["hard_negatives"] == ["replace-obj", "swap-att"]
    assert desc["method_config"]["hard_negative_weight"] == 2.0
    header = (out / "log.csv").read_text().splitlines()[0].split(",")
    assert "hard_negatives" in header
    # what the weights never saw is recorded with them: a demo world can hold the same combinations out
    from extract.models.backbone import trained_holdout

    assert desc["data"]["holdout"] == ["blue square", "red circle"]
    assert trained_holdout("tiny", str(out / "model.safetensors")) == ["blue square", "red circle"]
    assert trained_holdout("tiny") == [] and trained_holdout("tiny", "none") == []


def test_negatives_never_come_from_an_evaluation_split(toy, tmp_path, model):
    """The vocabulary is the training captions': a word only the validation data has never appears, and on a toy
    world no negative names a held-out combination."""
    from train.pretrain.options import PretrainOptions
    from train.pretrain.engine import fill_vocabulary, with_hard_negatives
    from train.pretrain.data import SeededTransform, build_train_data

    _, _, eval_tf, tokenizer = model
    rows = [r for r in csv.DictReader(open(toy / "train.csv"))]
    val = tmp_path / "val.csv"
    with open(val, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "title"])
        w.writerows([[str(toy / r["filepath"]), "a zebra next to a violet giraffe"] for r in rows[:5]])
    opts = PretrainOptions(data=str(toy), val_data=str(val), hard_negatives="all", workers=0)
    objective = with_hard_negatives(PRETRAIN.get("clip")(), opts)
    data = build_train_data(str(toy), batch_size=8, rank=0, world_size=1, accum_freq=1, seed=0, tokenizer=tokenizer,
                            objective=objective, transform=SeededTransform(eval_tf, random=False), workers=0)
    fill_vocabulary(objective.generator, opts, data)
    v = objective.generator.vocab
    assert "zebra" not in v.nouns and "violet" not in v.attributes["colour"]
    assert objective.generator.forbid == frozenset({("red", "circle"), ("blue", "square")})
    texts = []
    for micro in data.epoch_batches(0, 0):
        rows = micro[0]["hn_text"].flatten(0, 1)[micro[0]["hn_valid"].flatten()]
        texts += [tokenizer.decode([t for t in row.tolist() if t not in (0, 49406, 49407)]) for row in rows]
    assert len(texts) > 100 and not any("red circle" in t or "blue square" in t for t in texts)
    assert not any("zebra" in t or "violet" in t for t in texts)
