"""The text-only floor (train/eval/text_only.py): it never looks at the image, and it finds a caption prior when
there is one."""
from __future__ import annotations

import json

import torch

from train.eval.evaluate import item_correct
from train.eval.text_only import TextOnlyScorer, fit_probe, training_pairs


class _Texts:
    """A stand-in text tower: a caption's embedding says which of a few marker words it holds."""

    preprocess, device = None, torch.device("cpu")
    words = ("left", "right", "red", "blue", "circle", "square")

    def encode_texts(self, texts):
        rows = [[float(w in t.split()) for w in self.words] + [1.0] for t in texts]

        class Out:
            embedding = torch.tensor(rows)
        return Out()

    def tokenize(self, texts):  # pragma: no cover - not reached here
        raise NotImplementedError


def test_the_probe_finds_a_planted_prior_and_nothing_where_there_is_none():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    planted = (x[:, 0] > 0).float()  # the label is written in one direction of the text embedding
    w, b = fit_probe(x, planted)
    assert ((x @ w + b > 0).float() == planted).float().mean() > 0.97
    noise = (torch.rand(400, generator=g) > 0.5).float()  # nothing to find
    w, b = fit_probe(x, noise)
    held_out = torch.randn(400, 8, generator=g)
    guess = (held_out @ w + b > 0).float()
    assert 0.4 < (guess == (torch.rand(400, generator=g) > 0.5).float()).float().mean() < 0.6


def test_scores_never_depend_on_the_image_beyond_breaking_ties():
    scorer = TextOnlyScorer(_Texts(), torch.tensor([0.5, 0, 1.0, -1.0, 0, 0, 0]), torch.tensor(0.0), "text only")
    images = scorer.encode_images(torch.zeros(4, 3, 8, 8))
    texts = scorer.encode_texts(["a red circle", "a blue circle", "a red square left of a blue circle"])
    s = scorer.score(images, texts)
    assert s.shape == (4, 3)
    assert (s.max(0).values - s.min(0).values).max() < 1e-5  # every image scores a caption alike
    assert (s.argmax(1) == 0).all()  # and each image ranks the captions alike: the prior's order
    # on a four-way set a blind model gets exactly one image right, and its image choice is a draw (chance)
    four = scorer.score(scorer.encode_images(torch.zeros(4, 3, 8, 8)),
                        scorer.encode_texts(["red left", "red right", "blue left", "blue right"]))
    assert item_correct("set", four)["text"] == 0.25


def test_training_pairs_come_from_the_train_split_only(tmp_path):
    from extract.worlds import toyworld

    toyworld.generate(tmp_path, 40, seed=0, workers=1)
    positives, negatives = training_pairs(tmp_path)
    items = json.loads((tmp_path / "negatives.json").read_text())["items"]
    train = [i for i in items if i["split"] == "train"]
    assert positives == [i["positive"] for i in train]
    assert len(negatives) == sum(len(i["negatives"]) for i in train)
