"""The demo's hard world: the grounded head trained where support and depth live, beside the frozen bases and the floor.

``python -m train.demo`` ends here. It generates a hard world (``extract/worlds/hardworld.py``: overlap, where the
later-drawn object is in front; objects resting on one another; clutter; textured backgrounds; What'sUp's eight
predicates), trains the grounded relation head on it (``adapters/heads/grounded.py``) on a hard base
(:data:`HARD_BASES`' first, fine-tuned on such scenes and shipped: ``extract/models/bases``) with the world's own
boxes and the head's defaults, until its held-out score stops improving, and scores the frozen hard bases, the
text-only floor (the first base's text tower and a probe fitted on the world's training captions against their
negatives, no image) and the head on both controlled tests (What'sUp's Controlled-A: on / under / left / right;
Controlled-B: in front of / behind / left / right; the same two objects in four images; four-way caption and image
choice and the group score, chance 25 / 25 / 0) and on the test split's object swaps and replaced relations
(chance 50), through ``train.eval``'s compositional task. The demo then serves this head.

``HARD_N`` scenes give 50 sets per controlled test (one per 20 scenes) and 800 training scenes: enough for the head
to read depth (train/adapter/README, "The hard world": 97-98 on Controlled-B from 1,000 or 2,000 scenes) inside the
demo's few minutes. Detected boxes need a detector trained on the world first (minutes more), so the demo reads the
world's own boxes; the same command with ``--boxes yolo`` trains one (train/adapter/README, "The hard world").
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

HARD_N = 1000  # scenes of the demo's hard world: 50 sets per controlled test
#: the frozen bases the hard world's table shows; the head trains on the first (no hard negatives in its
#: pre-training: toy-negclip-hard was taught "Y in front of X" as a negative, extract/README "The hard world")
HARD_BASES = ("toy-clip-hard", "toy-negclip-hard")
#: the served index's example query: a depth caption, which boxes alone cannot read (:func:`example_query`)
DEPTH = "in front of"
TESTS = ("toyworld-controlled-A", "toyworld-controlled-B")
SCORES = ("text", "image", "group")
#: the test split's columns beside the controlled tests: who is where, chance 50
PAIRS = ("swap-obj", "replace-rel")


def controlled_rows(results: dict) -> list[dict]:
    """One row per evaluated model of a ``train.eval`` results dict: its name, per controlled test the four-way
    caption / image / group scores (None where the model has no such figure) and its number of sets, and the test
    split's swap-obj / replace-rel accuracies."""
    rows = []
    for name, result in results.items():
        comp = result.get("compositional") or {}
        row = {"model": name}
        for test in TESTS:
            four = ((comp.get(test) or {}).get("per_type") or {}).get("four-way") or {}
            row[test] = {s: four.get(s) for s in SCORES} | {"sets": four.get("n")}
        per_type = (comp.get("toyworld") or {}).get("per_type") or {}
        row["pairs"] = {t: (per_type.get(t) or {}).get("acc") for t in PAIRS}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a table: caption / image / group per controlled test, then swap-obj / replace-rel."""
    def cells(scores: dict) -> str:
        return " / ".join("–" if scores.get(s) is None else f"{scores[s]:.1f}" for s in SCORES)

    def pair(value) -> str:
        return "–" if value is None else f"{value:.1f}"

    sets = next((r[t]["sets"] for r in rows for t in TESTS if r[t]["sets"]), 0)
    lines = [f"| model ({sets} sets per test; chance 25 / 25 / 0, pairs 50) | Controlled-A (on, under, left, right): "
             "caption / image / group | Controlled-B (in front of, behind, left, right): caption / image / group | "
             "swap-obj | replace-rel |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {cells(r[TESTS[0]])} | {cells(r[TESTS[1]])} | "
              + " | ".join(pair(r.get("pairs", {}).get(t)) for t in PAIRS) + " |" for r in rows]
    return "\n".join(lines)


def example_query(world: Path) -> str:
    """The served index's example query: the first short depth caption ("a purple star in front of a red triangle") of
    ``world``'s test split, so the collection holds the image it was written for; any depth caption without one."""
    import json

    scenes = json.loads((world / "annotations.json").read_text(encoding="utf-8"))["scenes"]
    for scene in scenes:
        for caption in scene["captions"] if scene.get("split") == "test" else ():
            relations = caption.get("struct", {}).get("relations") or []
            if caption.get("kind") == "relation" and [r[1] for r in relations] == [DEPTH]:
                return caption["text"]
    return f"a red circle {DEPTH} a blue square"


def hard_world(out: Path, n: int, seed: int, holdout: Sequence[str] = (), say=print) -> Path:
    """The demo's hard world under ``out / "hardworld"`` (reused when there with the same settings)."""
    from extract.worlds import toyworld

    return toyworld.ensure(out / "hardworld", n, seed, say=lambda line: say("  " + line), replace=True,
                           holdout=holdout, hard=True)


def train_head(world: Path, out: Path, *, base: str = HARD_BASES[0], seed: int = 0, epochs: int | None = None,
               batch_size: int | None = None, workers: int | None = None, device: str | None = None) -> dict:
    """The grounded head on ``base`` and ``world``'s own boxes, the head's defaults, until its held-out score stops
    improving (``epochs``: a fixed length instead); ``train.adapter``'s summary (its checkpoint: ``adapter``)."""
    import shutil

    from train.adapter import AdapterOptions, train

    shutil.rmtree(out / "grounded", ignore_errors=True)  # the demo retrains its heads: its earlier run makes way
    return train(AdapterOptions(method="grounded", base=base, data=str(world), out=str(out / "grounded"),
                                cache_dir=str(out / "cache"), seed=seed, epochs=epochs, batch_size=batch_size,
                                workers=workers,
                                device=device, final_eval=False))


def hard_controlled(world: Path, out: Path, models: Sequence[tuple[str, str | None]], *, seed: int = 0,
                    device: str | None = None) -> dict:
    """Score ``models`` ((model, pretrained) pairs as ``train.eval`` takes them; the first one's text tower gives the
    text-only floor) on ``world``'s controlled tests and test split; returns ``{"world", "rows", "markdown",
    "reports"}``."""
    from train.eval.evaluate import EvaluateOptions, evaluate

    result = evaluate(EvaluateOptions(model=[m for m, _ in models], pretrained=[p for _, p in models],
                                      data=str(world), tasks="compositional", out=str(out), device=device,
                                      seed=seed))
    rows = controlled_rows(result["results"])
    return {"world": str(world), "rows": rows, "markdown": markdown(rows), "reports": result.get("reports")}


def head_stage(out: Path, n: int, seed: int, holdout: Sequence[str], *, epochs: int | None = None,
               batch_size: int | None = None, workers: int | None = None, device: str | None = None,
               say=print) -> dict:
    """The demo's first hard-world step: the world (:func:`hard_world`) and its head (:func:`train_head`). Returns
    ``{"world", "head": {"adapter", "steps", "seconds", "stopping"}}``."""
    world = hard_world(out, n, seed, holdout, say=say)
    head = train_head(world, out / "hard", seed=seed, epochs=epochs, batch_size=batch_size, workers=workers,
                      device=device)
    return {"world": str(world),
            "head": {k: head.get(k) for k in ("adapter", "steps", "seconds", "stopping")}}


def table_stage(world: Path, out: Path, adapter: str, *, seed: int = 0, device: str | None = None) -> dict:
    """The demo's second hard-world step: the frozen hard bases, the floor and the head on both controlled tests and
    the test split (:func:`hard_controlled`, into ``out / "hardworld-eval"``)."""
    return hard_controlled(world, out / "hardworld-eval", [(b, None) for b in HARD_BASES] + [(adapter, None)],
                           seed=seed, device=device)


def branch(out: str, n: int, seed: int, holdout: list[str], epochs: int | None, batch_size: int | None,
           workers: int | None, device: str | None) -> dict:
    """Both hard-world steps as one job (:mod:`train.child`: the demo runs it beside the version-2 world's adapters;
    its output goes to the job's log, which the demo prints step by step when it reaches them). Returns
    :func:`head_stage`'s result with the table as ``"hard"`` and ``"log_split"``: where in the log the second step's
    output starts (bytes)."""
    import os
    import sys

    out = Path(out)
    result = head_stage(out, n, seed, holdout, epochs=epochs, batch_size=batch_size, workers=workers, device=device)
    sys.stdout.flush()
    sys.stderr.flush()
    result["log_split"] = os.lseek(1, 0, os.SEEK_CUR)
    result["hard"] = table_stage(Path(result["world"]), out, result["head"]["adapter"], seed=seed, device=device)
    return result


class HardSteps:
    """The demo's two hard-world steps (:func:`head_stage`, then :func:`table_stage`). With ``jobs`` > 1 they start
    at once, in a process of their own (:func:`branch`), while the demo goes on with the version-2 world, each
    process with its share of the CPU threads; the demo reads their output and results when it reaches them. They
    need nothing of the version-2 world, and on two cores the two halves of the demo each spend much of their time
    in one thread (spaCy, Python), so side by side they take the longer one's time, not the sum. ``jobs`` 1: in
    line, when the demo reaches them."""

    def __init__(self, out: Path, n: int, seed: int, holdout: Sequence[str], *, epochs: int | None,
                 batch_size: int | None, workers: int | None, device: str | None, jobs: int, say=print):
        self.out, self.seed, self.device, self.say = Path(out), seed, device, say
        self.args = {"out": str(out), "n": n, "seed": seed, "holdout": list(holdout), "epochs": epochs,
                     "batch_size": batch_size, "workers": workers, "device": device}
        self.job = self.result = self._threads = None
        if jobs > 1:
            import torch

            from train.child import Child, cores, job_plan, spawn

            threads = job_plan(jobs, cores(), 0)[0]
            self._threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            # spawned: a fork server would hold this process up while it imports torch (~4 s here); a spawned
            # interpreter imports it beside the demo
            self.job = Child("the hard world's steps", "train.demo_hard:branch", self.args,
                             self.out / "hard" / "steps.log", threads=threads, ctx=spawn())
            say(f"  the hard world's steps start now, beside the next ones, in a process of their own "
                f"({threads} CPU thread{'s' if threads > 1 else ''} each; its output: {self.job.log})")

    def head(self) -> dict:
        """The first step's result (:func:`head_stage`), its output said."""
        if self.job is None:
            args = {k: v for k, v in self.args.items() if k not in ("out", "n", "seed", "holdout")}
            self.result = head_stage(self.out, self.args["n"], self.seed, self.args["holdout"], say=self.say, **args)
            return self.result
        try:
            self.result = self.job.join()
        finally:
            self._restore()
        self._say(self.job.log.read_bytes()[:self.result["log_split"]])
        return self.result

    def table(self) -> dict:
        """The second step's result (:func:`table_stage`), its output said."""
        if self.job is None:
            return table_stage(Path(self.result["world"]), self.out, self.result["head"]["adapter"], seed=self.seed,
                               device=self.device)
        self._say(self.job.log.read_bytes()[self.result["log_split"]:])
        return self.result["hard"]

    def stop(self) -> None:
        """No step outlives the demo (it failed or was interrupted first)."""
        if self.job is not None:
            self.job.stop()
        self._restore()

    def _restore(self) -> None:
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = None

    def _say(self, output: bytes) -> None:
        for line in output.decode("utf-8", "replace").splitlines():
            self.say(line)
