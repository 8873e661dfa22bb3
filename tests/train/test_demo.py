"""The demo runs the main job end to end on a small toy world, reports what it did, and reads well in a log."""
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from adapters.registry import ADAPTERS
from extract.models.backbone import trained_holdout
from train.demo import DEFAULT_BASES, bases_of, binding_score, main, parse_args

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n", "80", "--workers", "0", "--pretrain-epochs", "1", "--pretrain-batch-size", "16", "--epochs", "1",
         "--batch-size", "32", "--hard-n", "0"]
# the end-to-end run's hard world: 3 sets per controlled test, its head trained for one epoch
HARD = ["--hard-n", "60", "--hard-epochs", "1", "--hard-batch-size", "16"]


@pytest.fixture(scope="module")
def logged_demo(tmp_path_factory):
    """`python -m train.demo > demo.log 2>&1` on the small settings, run once for the tests that read its log and its
    outputs: (out folder, the log)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    log = subprocess.run([sys.executable, "-m", "train.demo", "--out", str(out), *SMALL, *HARD], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert log.returncode == 0, log.stdout[-3000:]
    return out, log.stdout


@pytest.mark.slow
def test_demo_end_to_end(logged_demo, capsys):
    """The default: every adapter on the shipped NegCLIP-style base, a toy world holding out what the base never saw,
    its binding table and its full table; then a hard world, the grounded head trained on it, its table beside the
    frozen hard bases and the floor, and that head served. With two bases and no hard world (--hard-n 0) the bases
    are compared and the adapter that binds best on the version-2 world's validation split over both is served."""
    out, printed = logged_demo
    argv = ["--out", str(out), *SMALL]
    assert DEFAULT_BASES == ("toy-negclip",)
    assert "[7/7]" in printed and printed.count("binding: frozen base vs base + adapter") == 1
    report = json.loads((out / "demo_report.json").read_text())
    # nothing is pre-trained: the base comes with weights
    assert report["pretrained"] == {"toy-negclip": None} and not (out / "base").exists()
    held = trained_holdout("toy-negclip")
    assert len(held) == 4 and report["holdout"] == held
    assert json.loads((out / "toyworld" / "meta.json").read_text())["holdout"] == held
    # one full table: the frozen base, its text-only floor, then every registered adapter, printed whole
    columns = ["toy-negclip", "text only (toy-negclip)", *(f"toy-negclip + {m}" for m in ADAPTERS.names())]
    results = json.loads((out / "adapters" / "results.json").read_text())
    assert list(results["results"]) == columns
    assert printed.count("frozen base vs base + adapter, every figure") == 1
    lines = report["markdown"].splitlines()
    assert all(h in lines[0] for h in ("swap-att", "same-shape swap-att", "swap-obj", "replace-rel", "4-way: caption",
                                       "4-way: image", "4-way: group"))
    heldout = report["markdown_heldout"].splitlines()
    assert all(h in heldout[0] for h in ("held-out swap-att", "held-out 4-way: caption", "T2I R@1", "I2T mAP"))
    rows = [line.split(" | ")[0][2:] for line in lines[2:]]
    assert rows == columns and rows == [line.split(" | ")[0][2:] for line in heldout[2:]]
    assert report["bases_compared"] is None
    assert printed.count(report["markdown"]) == 1 and printed.count(report["markdown_heldout"]) == 1
    assert (out / "binding.md").read_text().strip() == report["markdown"] + "\n\n" + report["markdown_heldout"]
    assert json.loads((out / "config.json").read_text())["n"] == 80
    # support and depth: a hard world, the grounded head trained on it on the first hard base with the world's own
    # boxes, and both controlled tests for the frozen hard bases, the text-only floor and the head, printed once; the
    # text alone cannot choose a caption (the four images' scores tie)
    hard = report["hard_world"]
    world = Path(hard["world"])
    assert json.loads((world / "meta.json").read_text())["hard"] is True
    head = json.loads((Path(hard["head"]["checkpoint"]).parent / "summary.json").read_text())
    assert head["data"] == str(world) and hard["head"]["steps"] == head["steps"] > 0
    assert json.loads(Path(hard["head"]["checkpoint"] + ".json").read_text())["base"]["base"] == "toy-clip-hard"
    names = [r["model"] for r in hard["rows"]]
    assert names == ["toy-clip-hard", "text only (toy-clip-hard)", "toy-negclip-hard", "toy-clip-hard + grounded"]
    for row in hard["rows"]:
        for test in ("toyworld-controlled-A", "toyworld-controlled-B"):
            assert row[test]["sets"] == 3 and all(0 <= row[test][k] <= 100 for k in ("text", "image", "group"))
        if row["model"] != names[1]:
            assert all(0 <= row["pairs"][t] <= 100 for t in ("swap-obj", "replace-rel"))
    floor = next(r for r in hard["rows"] if r["model"].startswith("text only"))
    assert floor["toyworld-controlled-A"]["text"] == floor["toyworld-controlled-B"]["text"] == 25.0
    assert printed.count(hard["markdown"]) == 1
    assert printed.index(report["markdown"]) < printed.index(hard["markdown"])  # the hard world last, then serving
    # it serves that head: an index of the hard world's test split and one depth query whose hits carry both stages'
    # ranks and scores, and the printed table is the one `serve.query` prints
    served = report["served"]
    assert (served["base"], served["method"], served["checkpoint"]) == ("toy-clip-hard", "grounded",
                                                                        hard["head"]["checkpoint"])
    from serve.search import Searcher

    searcher = Searcher.open(out / "index")
    assert searcher.has_second_stage and searcher.num_images == served["images"] == 6  # the test split of 60 scenes
    assert all(str(world) in h["path"] for h in served["hits"]["hits"])
    again = searcher.search_text(served["query"], k=5, rerank=50)
    assert [h["row"] for h in served["hits"]["hits"]] == [h.row for h in again]
    assert [h.rerank_score for h in again] == sorted((h.rerank_score for h in again), reverse=True)
    assert printed.count(served["table"]) == 1 and "stage-1 rank" in served["table"]
    assert printed.index(hard["markdown"]) < printed.index(served["table"])
    # the caption probe's graded swaps, printed: one the served model gets right, one it gets wrong
    flat = " ".join(printed.split())  # the captions are wrapped
    assert served["probes"] and all(f'true: "{p["positive"]}" false: "{p["negative"]}"' in flat
                                    for p in served["probes"])
    assert {p["verdict"].rsplit(" ", 1)[1] for p in served["probes"]} <= {"right", "wrong"}
    # a second run reuses the toy world; with both shipped bases (one adapter each is enough: two candidates) it
    # compares the frozen bases and, without a hard world, serves the adapter that binds best on the version-2 world's
    # validation split over both, an index of its test split
    assert main(argv + ["--base", "toy-clip,toy-negclip", "--methods", "comalign"]) == 0
    printed = capsys.readouterr().out
    assert "reused" in printed.split("[2/7]")[1].split("[3/7]")[0]  # two bases, no hard world: 7 steps
    report = json.loads((out / "demo_report.json").read_text())
    rows = [line.split(" | ")[0][2:] for line in report["markdown"].splitlines()[2:]]
    assert rows[-1] == "toy-negclip − toy-clip (frozen)" and rows[0] == "toy-clip" and len(rows) == 7
    # the bases' own comparison: the same frozen figures as each base's column in its table
    versus = report["bases_compared"]["metrics"]
    first = json.loads((out / "adapters" / "toy-clip" / "results.json").read_text())["table"]["metrics"]["toy-clip"]
    assert versus["toy-clip"]["toyworld swap-att"]["mean"] == pytest.approx(first["toyworld swap-att"]["mean"])
    served = report["served"]
    val = {(b, m): (binding_score(r["val"]), r["val"]["retrieval T2I R@1"]) for b, res in report["adapters"].items()
           for m, r in res["methods"].items()}
    assert report["hard_world"] is None and val[(served["base"], served["method"])] == max(val.values())
    assert f"the best binding on the validation split (mean of swap-att, swap-obj, replace-rel: " \
           f"{val[(served['base'], served['method'])][0]:.1f})" in printed
    assert Searcher.open(out / "index").num_images == 8  # the version-2 world's test split of 80 scenes


@pytest.mark.slow
def test_a_base_without_weights_is_pre_trained_first_and_reused(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--out", str(out), *SMALL, "--base", "tiny", "--methods", "comalign"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "demo_report.json").read_text())
    assert report["pretrained"] == {"tiny": str(out / "base" / "model.safetensors")} and report["holdout"] == []
    assert json.loads((out / "base" / "model.json").read_text())["method"] == "clip"
    # the base keeps its last checkpoint only, not one per epoch
    assert len([p for p in (out / "base" / "checkpoints").iterdir() if p.is_dir()]) == 1
    # one base: its table where it always was, printed in full after the binding table
    columns = list(json.loads((out / "adapters" / "results.json").read_text())["results"])
    base = f"tiny:{out / 'base' / 'model.safetensors'}"
    assert columns == [base, f"text only ({base})", "tiny + comalign"]
    assert printed.count("frozen base vs base + adapter, every figure") == 1 and printed.count("| metric |") == 1
    assert main(argv) == 0  # the same settings: the toy world and the base are reused, not redone
    printed = capsys.readouterr().out
    assert "reused" in printed.split("[2/5]")[1].split("[3/5]")[0]
    assert "reusing" in printed.split("[3/5]")[1].split("[4/5]")[0]
    with pytest.raises(ValueError, match="--pretrained names the weights of one --base"):
        bases_of(parse_args(["--base", "toy-clip,toy-negclip", "--pretrained", "x.safetensors"]))


@pytest.mark.slow
def test_demo_log_reads_well(logged_demo):
    """`python -m train.demo > demo.log 2>&1`: no line over 300 characters (tqdm frames once made a 26 KB line),
    no warning repeated, the table printed once."""
    _, log = logged_demo
    lines = log.splitlines()
    assert max(len(line) for line in lines) <= 300, max(lines, key=len)
    assert "\r" not in log
    warnings = Counter(line for line in lines if "warning" in line.lower() or "No pretrained weights" in line)
    assert not [w for w, n in warnings.items() if n > 1], warnings
    assert "No pretrained weights loaded" not in log
    assert sum(line.startswith("| model |") for line in lines) == 2  # the binding table and the held-out one


def test_demo_without_weights_says_what_to_supply(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--n", "20", "--base", "ViT-B-32"]) == 2
    err = capsys.readouterr().err
    assert "--pretrained /path/to/" in err and err.startswith("error: ")
    assert not (tmp_path / "toyworld").exists()  # nothing was generated before the weights check failed


@pytest.mark.slow
def test_the_long_run_adds_comalign_on_boxes_a_user_has_and_smartclip_on_long_captions(tmp_path, capsys):
    """--full: a YOLO trained on the toy world gives ComAlign's detected-boxes column, random boxes its control, and a
    long-caption world the second table (base, frozen SmartCLIP, --unfreeze with 248 tokens, trained on short
    captions); both tables printed once. PowerCLIP: its frozen head's control (CLIP loss only), and the fine-tune of
    the backbone against the same fine-tune without the powerset loss, with paired intervals, on the toy world only
    (on a hard world it shows no effect: train/adapter/powerclip.md)."""
    out = tmp_path / "demo"
    assert main(["--out", str(out), *SMALL, "--base", "tiny", "--full", "--detector-epochs", "1", "--methods",
                 "comalign,smartclip,powerclip", "--hard-pretrain-n", "40",
                 "--hard-pretrain-steps", "2", "--hard-pretrain-jobs", "1", "--world3d-n", "20", "--hard-epochs",
                 "1", "--hard-batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "[10/10]" in printed and printed.count("frozen base vs base + adapter, every figure") == 1
    report = json.loads((out / "demo_report.json").read_text())
    assert Path(report["detector"]["weights"]).is_file()
    columns = list(json.loads((out / "adapters" / "results.json").read_text())["results"])
    assert columns[1].startswith("text only (") and columns[2:] == [
        "tiny + comalign", "tiny + smartclip", "tiny + powerclip", "tiny + comalign (detector boxes)",
        "tiny + comalign (random boxes)", "tiny + powerclip (CLIP loss only)"]
    # the fine-tune: both columns trained the backbone (their own backbone.safetensors), one of them with lam 0; the
    # table compares each column with that control
    tuned = json.loads((out / "powerclip-fine-tune" / "results.json").read_text())
    control = "tiny fine-tuned + powerclip (CLIP loss only)"
    assert list(tuned["results"])[0] == control and tuned["table"]["reference"] == control
    assert "tiny fine-tuned + powerclip (powerset loss)" in tuned["results"]
    for key, lam in (("powerclip-powerset-loss", 0.1), ("powerclip-clip-loss-only", 0.0)):
        config = json.loads((out / "powerclip-fine-tune" / key / "config.json").read_text())
        assert config["unfreeze"] and (out / "powerclip-fine-tune" / key / "backbone.safetensors").is_file()
        assert config["head_config"].get("lam", 0.1) == lam and config["extract_options"]["segmenter"] == "toy"
    paired = report["powerclip_fine_tune"]["paired"]
    assert printed.count(paired) == 1 and paired.splitlines()[2].startswith(f"| {control} | ")
    cell = re.compile(r"^\d+\.\d \([+-]\d+\.\d \[[+-]\d+\.\d, [+-]\d+\.\d\]\*?\)$")  # figure (difference [interval])
    assert all(cell.match(c.strip(" |")) for line in paired.splitlines()[3:] for c in line.split(" | ")[1:]), paired
    assert not (out / "powerclip-fine-tune-hard").exists() and "powerclip_fine_tune_hard" not in report
    # pre-training on one hard world: every column from scratch, CLIP each table's reference; without hard negatives
    # every final model tuned unmasked and CLIP-PGS against FLIP untuned and tuned, with them PowerCLIP-S; the
    # printed rows: the untuned columns, the text-only floor and those pairs
    assert json.loads((out / "pretrain-hard" / "hardworld" / "meta.json").read_text())["hard"] is True
    expected = {"plain": (["clip", "flip", "clip-pgs", "powerclip-R"], ["clip-pgs vs flip",
                                                                       "clip-pgs +tune vs flip +tune"]),
                "hard-negatives": (["clip +hn all", "powerclip-S +hn all"], [])}
    for folder, (columns, pairs) in expected.items():
        pre = json.loads((out / "pretrain-hard" / folder / "compare.json").read_text())
        assert pre["config"]["data"] == str(out / "pretrain-hard" / "hardworld")
        runs = pre["budgets"]["steps"]["runs"]
        tuned = [f"{c} +tune" for c in columns] if folder == "plain" else []
        assert list(runs) == columns + tuned
        assert [r["steps"] for rs in runs.values() for r in rs] == [2] * len(columns) + [1] * len(tuned)
        assert pre["budgets"]["steps"]["table"]["reference"] == columns[0]
        rows = report["pretrain_hard"]["tables"][folder]
        names = [line.split(" | ")[0].strip("| ") for line in rows.splitlines()[2:] if line.startswith("| ")]
        floor = f"text only (tiny:{runs[columns[0]][0]['weights']})"
        assert printed.count(rows) == 1 and names == [columns[0], floor, *columns[1:], *pairs], names
    from extract.cache import FeatureCache

    boxes = {FeatureCache(p.parent).settings.get("boxes", {}).get("source")
             for p in (out / "adapters" / "cache").glob("*/manifest.json")}
    assert {"gt", "yolo", "random"} <= boxes
    long_run = json.loads((out / "long-captions" / "results.json").read_text())
    assert list(long_run["results"])[2:] == ["tiny + smartclip", "tiny fine-tuned + smartclip (248 tokens)",
                                             "tiny + smartclip (trained on short captions)"]
    assert json.loads((out / "long-captions" / "toyworld" / "meta.json").read_text())["long_captions"] is True
    assert printed.count("SmartCLIP on long captions (") == 1 and printed.count("| metric |") == 2
    # the 3D world: rendered, the head trained on the mixed 3D base with its own boxes, scored beside the frozen base
    # and the floor on both controlled tests (one set each from 20 scenes)
    meta = json.loads((out / "world3d" / "meta.json").read_text())
    base = "toy-clip-3d-mixed"
    assert (meta["world"], meta["n"], meta["holdout"]) == ("3d", 20, sorted(trained_holdout(base, None)))
    world3d = report["world3d"]
    assert [r["model"] for r in world3d["rows"]] == [base, f"text only ({base})", f"{base} + grounded"]
    assert all(r["toyworld-controlled-B"]["sets"] == 1 for r in world3d["rows"])
    assert printed.count(world3d["markdown"]) == 1 and (out / "3d" / "grounded" / "adapter.safetensors").is_file()


@pytest.mark.slow
def test_the_hard_worlds_steps_beside_the_demo_fail_with_one_line_naming_their_log(tmp_path, capsys):
    """The hard world's steps run in a process of their own beside the version-2 world's (train/demo_hard.py's
    HardSteps, jobs 2): a failure there ends the demo when it reaches them, one error line with the job's own error and
    where its traceback is, the process gone."""
    from train.child import ChildFailed
    from train.demo_hard import HardSteps

    steps = HardSteps(tmp_path, 4, 0, [], epochs=1, batch_size=8, workers=0, device=None, jobs=2, say=print)
    with pytest.raises(ChildFailed) as failure:
        steps.head()
    steps.stop()
    assert steps.job is not None and not steps.job.process.is_alive()
    message = str(failure.value)
    assert message.startswith("the hard world's steps failed (ValueError: the global batch (8) exceeds the 3 training "
                              "images") and message.endswith(f"the traceback is in {tmp_path / 'hard' / 'steps.log'}")
    assert "Traceback" in (tmp_path / "hard" / "steps.log").read_text()
    from extract.common.cli import JobFailed, run_job

    def job(_):
        raise failure.value

    assert run_job(job, None) == JobFailed.exit_code and capsys.readouterr().err == f"error: {message}\n"
