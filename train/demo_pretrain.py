"""The demo's pre-training comparison on a hard world: CLIP-PGS against FLIP at the same masking ratio.

``python -m train.demo --full`` ends its long run with the one pre-training claim that shows its paper's effect on
the hard world (train/README, "Pre-training on the hard world"): CLIP-PGS keeps the objects' patches where FLIP drops
half of every patch uniformly (CLIP-PGS §3.2), and where objects are small, many and overlapping that shows in
retrieval and attributes (CLIP-PGS §4; 3 seeds there: I2T R@1 +3.9 [+2.1, +5.9]*, and +5.6 after both tune
unmasked). The demo runs ``train.pretrain.compare`` with the settings measured there: a hard world of
``hard_pretrain_n`` scenes, the tiny ViT, 500 steps of 64, FLIP's unmasked tuning (300 steps, 3/5 of the steps) from
both final models, two runs at a time, one run per ``--seeds``. The demo's world has its own seed (``--seed``), so
its figures are a fresh draw of the same comparison, not the README's table.

About 12 min at one seed on a 2-core CPU (two 500-step runs at once, the tuning, the world and the evaluation).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

HARD_PRETRAIN_N = 10000  # train/README's hard world: 8,001 train images, 125 steps of 64 per epoch
HARD_PRETRAIN_STEPS = 500
TUNING_FRACTION = 3 / 5  # FLIP's unmasked tuning: 300 steps after 500, as measured
METHODS = ("flip", "clip-pgs")  # FLIP first: the table's reference, each CLIP-PGS figure its difference from FLIP
#: the rows the demo prints: the claim's columns and the binding rows that say neither model binds
ROWS = ("retrieval T2I R@1", "retrieval I2T R@1", "zero-shot top-1", "toyworld replace-att", "toyworld replace-obj",
        "toyworld replace-rel", "toyworld swap-att", "toyworld swap-obj")


def tuning_steps(steps: int) -> int:
    return max(1, round(steps * TUNING_FRACTION))


def clip_pgs_vs_flip(out: Path, *, n: int = HARD_PRETRAIN_N, steps: int = HARD_PRETRAIN_STEPS, seed: int = 0,
                     seeds: int = 1, batch_size: int = 64, workers: int = 1, device: str | None = None,
                     say=print) -> dict:
    """Generate the hard world under ``out / "hardworld"`` (the comparison's held-out combinations kept out of its
    train split) and run the comparison into ``out``; returns ``train.pretrain.compare``'s result with the demo's
    table (:data:`ROWS`: FLIP, the text-only floor, CLIP-PGS as its difference from FLIP, both tuned) as
    ``markdown_rows``."""
    from extract.common.run_dir import NEUTRAL, claim
    from extract.data import toyworld
    from train.pretrain.compare import AFTER_TRAINING, HOLDOUT, CompareOptions, compare, summary_table
    from train.pretrain.engine import PretrainOptions

    world = toyworld.ensure(out / "hardworld", n, seed, say=lambda line: say("  " + line), replace=True,
                            holdout=HOLDOUT, hard=True)
    tuned = [f"{m} +tune" for m in METHODS]
    # n and seed name the world: runs an earlier demo finished on this one are kept (compare resumes), others not
    copts = CompareOptions(out=str(out), data=str(world), n=n, seed=seed, seeds=seeds, methods=list(METHODS),
                           steps=steps, batch_size=batch_size, workers=workers, jobs=2,
                           unmasked_tuning_steps=tuning_steps(steps), vs=[tuple(reversed(tuned))],
                           pretrain=PretrainOptions(device=device))
    try:
        claim(out, json.loads(json.dumps(dataclasses.asdict(copts), default=str)), neutral=NEUTRAL | AFTER_TRAINING)
    except ValueError:  # the demo's own comparison with other settings: replaced, and said so
        say(f"  {out} holds a comparison with other settings; running a new one there")
        shutil.rmtree(out / "steps", ignore_errors=True)
        (out / "config.json").unlink(missing_ok=True)
    result = compare(copts)
    table = result["budgets"]["steps"]["table"]
    return {**result, "world": str(world), "markdown_rows": summary_table(table, ROWS)}
