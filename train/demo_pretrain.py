"""The demo's pre-training comparisons on a hard world: those that show their paper's effect there.

``python -m train.demo --full`` pre-trains the tiny ViT from scratch on a hard world (overlap, clutter, textured
backgrounds: ``extract/worlds/hardworld.py``) with the columns whose paper claim train/pretrain/compare_hard.md's "Pre-training on the hard
world" found beyond the interval (3 seeds there):

- **CLIP-PGS against FLIP** at the same masking ratio (CLIP-PGS §4): FLIP drops half of every image's patches
  uniformly, CLIP-PGS keeps the objects' (§3.2), and where objects are small and many that shows in retrieval and
  attributes (I2T R@1 +3.9 [+2.1, +5.9]*; +5.6 [+3.9, +7.4]* after both tune unmasked, FLIP §3);
- **PowerCLIP-R against CLIP** (PowerCLIP §4, retrieval): T2I R@1 +0.3 [+0.1, +0.6]*, small, and zero-shot the
  other way (-1.5 [-2.1, -0.9]*);
- **PowerCLIP-S against CLIP, both with NegCLIP's hard negatives** (PowerCLIP §4, binding): swap-obj +1.9
  [+0.5, +3.3]*, small; without the negatives PowerCLIP-S showed nothing beyond the interval.

Two ``train.pretrain.compare`` runs on one world, with the settings measured there: 500 steps of 64, one run per
``--seeds``, two runs at a time (``--hard-pretrain-jobs``); the first (:data:`PLAIN`) with FLIP's unmasked tuning
from every final model (300 steps: 3/5 of the steps) and the rows ``clip-pgs vs flip`` untuned and tuned, the
second (:data:`NEGATIVES`) with ``--hard-negatives all``. CLIP is each table's reference. The demo's world has its
own seed (``--seed``), so its figures are a fresh draw of the same comparisons, not train/pretrain/compare_hard.md's tables.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

HARD_PRETRAIN_N = 10000  # train/pretrain/compare_hard.md's hard world: 8,001 train images, 125 steps of 64 per epoch
HARD_PRETRAIN_STEPS = 500
HARD_PRETRAIN_JOBS = 2  # runs trained at once: the two cores here
TUNING_FRACTION = 3 / 5  # FLIP's unmasked tuning: 300 steps after 500, as measured
#: the figures the demo prints: the claims' columns and the binding rows that say whether a model binds
ROWS = ("retrieval T2I R@1", "retrieval I2T R@1", "zero-shot top-1", "toyworld replace-att", "toyworld replace-obj",
        "toyworld replace-rel", "toyworld swap-att", "toyworld swap-obj")


@dataclass(frozen=True)
class Comparison:
    """One ``train.pretrain.compare`` run of the demo: its folder, columns (CLIP first), hard negatives, whether
    every final model tunes unmasked, and the ``A vs B`` rows it prints."""

    folder: str
    methods: tuple[str, ...]
    hard_negatives: str = "none"
    tuned: bool = False
    versus: tuple[tuple[str, str], ...] = ()


PLAIN = Comparison("plain", ("clip", "flip", "clip-pgs", "powerclip-R"), tuned=True,
                   versus=(("clip-pgs", "flip"), ("clip-pgs +tune", "flip +tune")))
NEGATIVES = Comparison("hard-negatives", ("clip", "powerclip-S"), hard_negatives="all")
COMPARISONS = (PLAIN, NEGATIVES)


def tuning_steps(steps: int) -> int:
    return max(1, round(steps * TUNING_FRACTION))


def printed_table(table: dict, versus) -> str:
    """The rows the demo prints of a comparison's table: the untuned columns and the text-only floor (each column's
    difference from CLIP), then the ``versus`` rows; the rest is in its ``compare.md``."""
    from train.pretrain.compare import summary_table

    wanted = {f"{a} vs {b}" for a, b in versus}
    metrics = {name: m for name, m in table["metrics"].items() if not name.endswith(" +tune")}
    return summary_table({**table, "metrics": metrics,
                          "pairs": {k: v for k, v in (table.get("pairs") or {}).items() if k in wanted}}, ROWS)


def run_comparison(c: Comparison, out: Path, world: Path, *, n: int, steps: int, seed: int, seeds: int,
                   batch_size: int, workers: int, jobs: int, device: str | None, say=print) -> dict:
    """``c`` on ``world`` into ``out``: runs an earlier demo finished with the same settings are kept (compare
    resumes after them), a comparison with other settings makes way. Returns compare()'s result."""
    from extract.common.run_dir import NEUTRAL, claim
    from train.pretrain.compare import AFTER_TRAINING, CompareOptions, compare
    from train.pretrain.engine import PretrainOptions

    # n and seed name the world (its folder stays the same): a world made with others is a different comparison
    copts = CompareOptions(out=str(out), data=str(world), n=n, seed=seed, seeds=seeds, methods=list(c.methods),
                           hard_negatives=c.hard_negatives, steps=steps, batch_size=batch_size, workers=workers,
                           jobs=jobs, unmasked_tuning_steps=tuning_steps(steps) if c.tuned else 0, vs=list(c.versus),
                           pretrain=PretrainOptions(device=device))
    try:
        claim(out, json.loads(json.dumps(dataclasses.asdict(copts), default=str)), neutral=NEUTRAL | AFTER_TRAINING)
    except ValueError:  # the demo's own comparison with other settings: replaced, and said so
        say(f"  {out} holds a comparison with other settings; running a new one there")
        shutil.rmtree(out, ignore_errors=True)
    return compare(copts)


def hard_pretraining(out: Path, *, n: int = HARD_PRETRAIN_N, steps: int = HARD_PRETRAIN_STEPS, seed: int = 0,
                     seeds: int = 1, batch_size: int = 64, workers: int = 1, jobs: int = HARD_PRETRAIN_JOBS,
                     device: str | None = None, say=print) -> dict:
    """Generate the hard world under ``out / "hardworld"`` (the comparisons' held-out combinations kept out of its
    train split) and run :data:`COMPARISONS` on it, each into ``out / folder``; returns ``{"world", "tables":
    {folder: the demo's rows (printed_table)}, "results": {folder: compare()'s result}}``."""
    from extract.worlds import toyworld
    from train.pretrain.compare import HOLDOUT

    world = toyworld.ensure(out / "hardworld", n, seed, say=lambda line: say("  " + line), replace=True,
                            holdout=HOLDOUT, hard=True)
    results, tables = {}, {}
    for c in COMPARISONS:
        say(f"  {', '.join(c.methods)}" + (" with NegCLIP's hard negatives" if c.hard_negatives != "none" else "")
            + (", each tuned unmasked after" if c.tuned else "") + f" -> {out / c.folder}")
        results[c.folder] = run_comparison(c, out / c.folder, world, n=n, steps=steps, seed=seed, seeds=seeds,
                                           batch_size=batch_size, workers=workers, jobs=jobs, device=device,
                                           say=say)
        tables[c.folder] = printed_table(results[c.folder]["budgets"]["steps"]["table"], c.versus)
    return {"world": str(world), "tables": tables, "results": results}
