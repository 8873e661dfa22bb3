"""Evaluate plugvlm models with CLIP_benchmark (PyPI ``clip-benchmark``), the harness users compare against.

``python -m train.eval.clip_benchmark eval --model_type plugvlm --model ViT-B-32 --pretrained openai
--dataset flickr30k --dataset_root ... --task zeroshot_retrieval`` runs ``clip_benchmark eval`` unchanged, with
one extra model type: CLIP_benchmark loads models through a table of loaders, each returning ``(model,
transform, tokenizer)`` with ``encode_image`` / ``encode_text``; :func:`register` adds ours to it.

CLIP_benchmark scores with the dot product of normalised global embeddings, so only dot-product scorers
(bare backbones, and adapters whose score is a dot product) can be expressed this way; others are refused
with the reason, and ``python -m train.eval`` evaluates them with their own scoring.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from extract.common.cli import Parser, run_job

MODEL_TYPE = "plugvlm"
COMMANDS = ("eval", "build")


class _Texts:
    """What our "tokenizer" hands CLIP_benchmark: the strings themselves (a scorer tokenises on its own);
    ``.to(device)`` is the one tensor method CLIP_benchmark calls on tokenized text."""

    def __init__(self, texts: Sequence[str]):
        self.texts = list(texts)

    def to(self, device) -> "_Texts":
        return self


class ScorerAsCLIP(torch.nn.Module):
    """A dot-product scorer behind open_clip's ``encode_image`` / ``encode_text`` (normalised embeddings)."""

    def __init__(self, scorer):
        super().__init__()
        if scorer.second_stage:  # its score is more than the dot product of two global embeddings
            raise ValueError(f"{scorer.name} scores image-text pairs with its own method, which CLIP_benchmark "
                             "(dot products of global embeddings) cannot express; use python -m train.eval")
        self.scorer = scorer

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.scorer.encode_images(images)["embed"]

    def encode_text(self, texts: _Texts) -> torch.Tensor:
        return self.scorer.encode_texts(texts.texts)["embed"]


def load_plugvlm(model_name: str, pretrained: str | None = None, cache_dir: str | None = None, device="cpu"):
    """CLIP_benchmark loader signature -> (model, transform, tokenizer)."""
    from adapters.load import load_scorer

    scorer = load_scorer(model_name, pretrained or None, device=device)
    return ScorerAsCLIP(scorer), scorer.preprocess, _Texts


def register() -> None:
    """Add the ``plugvlm`` model type to CLIP_benchmark's loader table (idempotent)."""
    try:
        from clip_benchmark import models
    except ImportError as e:
        raise ImportError("CLIP_benchmark is not installed: pip install clip-benchmark") from e
    models.TYPE2FUNC[MODEL_TYPE] = load_plugvlm
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)  # the CLI's --model_type choices are this very list


def build_parser() -> Parser:
    """Only the command word is ours: everything after it is CLIP_benchmark's, passed on untouched (its own
    ``eval --help`` lists it). So ``--help`` and a mistyped command cost no import of CLIP_benchmark and the
    libraries it loads (open_clip, transformers, pandas, scikit-learn)."""
    p = Parser(prog="python -m train.eval.clip_benchmark",
               description="Run CLIP_benchmark (PyPI clip-benchmark), the harness users compare against, with one "
                           "extra model type: --model_type plugvlm evaluates a plugvlm backbone or dot-product "
                           "adapter, e.g. eval --model_type plugvlm --model ViT-B-32 --pretrained openai --dataset "
                           "flickr30k --dataset_root DIR --task zeroshot_retrieval.")
    p.add_argument("command", choices=COMMANDS, nargs="?",
                   help="CLIP_benchmark's command: eval (evaluate a model) or build (collect results)")
    p.add_argument("options", nargs=argparse.REMAINDER, metavar="...",
                   help="CLIP_benchmark's own options, passed on as they are (`python -m "
                        "train.eval.clip_benchmark eval --help` lists them)")
    return p


def run_clip_benchmark(args: argparse.Namespace) -> None:
    """``clip_benchmark COMMAND OPTIONS...`` with ``--model_type plugvlm`` available. Raises ImportError when
    CLIP_benchmark is not installed."""
    register()
    from clip_benchmark import cli

    saved = sys.argv
    sys.argv = ["clip_benchmark", args.command, *args.options]
    try:
        cli.main()
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> int:
    """``clip_benchmark`` with ``--model_type plugvlm`` available; the options after the command are
    CLIP_benchmark's own."""
    p = build_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:  # optional in the parser so that a stray flag is named as such
        p.error("a command is required: eval or build (e.g. eval --model_type plugvlm --model ViT-B-32 ...)")
    return run_job(run_clip_benchmark, args)


if __name__ == "__main__":
    raise SystemExit(main())
