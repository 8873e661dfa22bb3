"""The demo's pre-training comparisons on a hard world: the two that show their paper's effect there.

``python -m train.demo --full`` pre-trains the tiny ViT from scratch on a hard world (overlap, clutter, textured
backgrounds: ``extract/data/hardworld.py``) with the columns whose paper claim train/README's "Pre-training on the hard
world" found beyond the interval (3 seeds there):

- **CLIP-PGS against FLIP** at the same masking ratio (CLIP-PGS §4): FLIP drops half of every image's patches
  uniformly, CLIP-PGS keeps the objects' (§3.2), and where objects are small and many that shows in retrieval and
  attributes (I2T R@1 +3.9 [+2.1, +5.9]*; +5.6 [+3.9, +7.4]* after both tune unmasked);
- **PowerCLIP-R against CLIP** (PowerCLIP §4, retrieval): T2I R@1 +0.3 [+0.1, +0.6]*, small, and zero-shot the
  other way (-1.5 [-2.1, -0.9]*). PowerCLIP-S showed nothing beyond the interval and is not run here.

It runs ``train.pretrain.compare`` with the settings measured there: CLIP first (the table's reference), 500 steps of
64, FLIP's unmasked tuning from every final model (300 steps: 3/5 of the steps), two runs at a time, one run per
``--seeds``, and the rows ``clip-pgs vs flip`` (untuned and tuned). The demo's world has its own seed (``--seed``), so
its figures are a fresh draw of the same comparison, not the README's table.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

HARD_PRETRAIN_N = 10000  # train/README's hard world: 8,001 train images, 125 steps of 64 per epoch
HARD_PRETRAIN_STEPS = 500
TUNING_FRACTION = 3 / 5  # FLIP's unmasked tuning: 300 steps after 500, as measured
METHODS = ("clip", "flip", "clip-pgs", "powerclip-R")  # CLIP first: the reference of every column
VERSUS = (("clip-pgs", "flip"), ("clip-pgs +tune", "flip +tune"))  # CLIP-PGS's own comparison, untuned and tuned
#: the figures the demo prints: the claims' columns and the binding rows that say whether a model binds
ROWS = ("retrieval T2I R@1", "retrieval I2T R@1", "zero-shot top-1", "toyworld replace-att", "toyworld replace-obj",
        "toyworld replace-rel", "toyworld swap-att", "toyworld swap-obj")


def tuning_steps(steps: int) -> int:
    return max(1, round(steps * TUNING_FRACTION))


def printed_table(table: dict) -> str:
    """The rows the demo prints of the comparison's table: the untuned columns and the text-only floor (each column's
    difference from CLIP), then the :data:`VERSUS` rows; the rest is in ``compare.md``."""
    from train.pretrain.compare import summary_table

    wanted = {f"{a} vs {b}" for a, b in VERSUS}
    metrics = {name: m for name, m in table["metrics"].items() if not name.endswith(" +tune")}
    return summary_table({**table, "metrics": metrics,
                          "pairs": {k: v for k, v in (table.get("pairs") or {}).items() if k in wanted}}, ROWS)


def hard_pretraining(out: Path, *, n: int = HARD_PRETRAIN_N, steps: int = HARD_PRETRAIN_STEPS, seed: int = 0,
                     seeds: int = 1, batch_size: int = 64, workers: int = 1, device: str | None = None,
                     say=print) -> dict:
    """Generate the hard world under ``out / "hardworld"`` (the comparison's held-out combinations kept out of its
    train split) and run the comparison into ``out``; returns ``train.pretrain.compare``'s result with the demo's
    rows (:func:`printed_table`) as ``markdown_rows``."""
    from extract.common.run_dir import NEUTRAL, claim
    from extract.data import toyworld
    from train.pretrain.compare import AFTER_TRAINING, HOLDOUT, CompareOptions, compare
    from train.pretrain.engine import PretrainOptions

    world = toyworld.ensure(out / "hardworld", n, seed, say=lambda line: say("  " + line), replace=True,
                            holdout=HOLDOUT, hard=True)
    # n and seed name the world: runs an earlier demo finished on this one are kept (compare resumes), others not
    copts = CompareOptions(out=str(out), data=str(world), n=n, seed=seed, seeds=seeds, methods=list(METHODS),
                           steps=steps, batch_size=batch_size, workers=workers, jobs=2,
                           unmasked_tuning_steps=tuning_steps(steps), vs=list(VERSUS),
                           pretrain=PretrainOptions(device=device))
    try:
        claim(out, json.loads(json.dumps(dataclasses.asdict(copts), default=str)), neutral=NEUTRAL | AFTER_TRAINING)
    except ValueError:  # the demo's own comparison with other settings: replaced, and said so
        say(f"  {out} holds a comparison with other settings; running a new one there")
        shutil.rmtree(out / "steps", ignore_errors=True)
        (out / "config.json").unlink(missing_ok=True)
    result = compare(copts)
    return {**result, "world": str(world), "markdown_rows": printed_table(result["budgets"]["steps"]["table"])}
