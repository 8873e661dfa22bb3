"""The demo's hard-world rows: What'sUp's Controlled-A / -B analogues for the demo's own models.

``python -m train.demo`` ends by scoring its frozen bases, the text-only floor (the first base's text tower and a
probe fitted on the world's training captions against their negatives) and the adapter it serves on both
controlled tests of a small hard world (``extract/data/hardworld.py``: Controlled-A on / under / left / right,
Controlled-B in front of / behind / left / right, the same two objects in four images, four-way caption and image
choice and the group score, chance 25 / 25 / 0), through ``train.eval``'s compositional task; the served adapter
reads the world's own boxes. The demo's models were trained on the version-2 world, which has neither support nor
depth: the rows say where they stand there. What a head trained on the hard world reads is in train/README
("The hard world").

``HARD_N`` scenes give 20 sets per test (one per 20 scenes); generating them and scoring three models took about
20 s here, inside the demo's 7 minutes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

HARD_N = 400  # scenes of the demo's hard world: 20 sets per controlled test
TESTS = ("toyworld-controlled-A", "toyworld-controlled-B")
SCORES = ("text", "image", "group")


def controlled_rows(results: dict) -> list[dict]:
    """One row per evaluated model of a ``train.eval`` results dict: its name and, per test, the four-way caption /
    image / group scores (None where the model has no such figure)."""
    rows = []
    for name, result in results.items():
        comp = result.get("compositional") or {}
        row = {"model": name}
        for test in TESTS:
            four = ((comp.get(test) or {}).get("per_type") or {}).get("four-way") or {}
            row[test] = {s: four.get(s) for s in SCORES} | {"sets": four.get("n")}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a table: caption / image / group per test."""
    def cells(scores: dict) -> str:
        return " / ".join("–" if scores.get(s) is None else f"{scores[s]:.1f}" for s in SCORES)

    sets = next((r[t]["sets"] for r in rows for t in TESTS if r[t]["sets"]), 0)
    lines = [f"| model ({sets} sets per test; chance 25 / 25 / 0) | Controlled-A (on, under, left, right): caption / "
             "image / group | Controlled-B (in front of, behind, left, right): caption / image / group |",
             "|---|---|---|"]
    lines += [f"| {r['model']} | {cells(r[TESTS[0]])} | {cells(r[TESTS[1]])} |" for r in rows]
    return "\n".join(lines)


def hard_controlled(out: Path, models: Sequence[tuple[str, str | None]], *, n: int = HARD_N, seed: int = 0,
                    holdout: Sequence[str] = (), device: str | None = None, say=print) -> dict:
    """Generate the small hard world under ``out / "hardworld"`` and score ``models`` ((model, pretrained) pairs as
    ``train.eval`` takes them; the first one's text tower gives the text-only floor) on its controlled tests;
    returns ``{"world", "rows", "markdown", "reports"}``."""
    from extract.data import toyworld
    from train.eval.evaluate import EvaluateOptions, evaluate

    world = toyworld.ensure(out / "hardworld", n, seed, say=lambda line: say("  " + line), replace=True,
                            holdout=holdout, hard=True)
    result = evaluate(EvaluateOptions(model=[m for m, _ in models], pretrained=[p for _, p in models],
                                      data=str(world), tasks="compositional", out=str(out / "hardworld-eval"),
                                      device=device, seed=seed))
    rows = controlled_rows(result["results"])
    return {"world": str(world), "rows": rows, "markdown": markdown(rows), "reports": result.get("reports")}
