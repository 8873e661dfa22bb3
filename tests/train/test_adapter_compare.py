"""python -m train.adapter.compare: several registered methods trained on one shared cache, one side-by-side table;
the training and evaluation jobs are called as functions with their options dataclasses (no command lines)."""
from __future__ import annotations

import json

import pytest

from adapters.registry import ADAPTERS
from extract.cache import FeatureCache
from train.adapter.compare import CompareOptions, compare, main, parse_args

from fixtures.toy import toy_root


@pytest.mark.slow
def test_side_by_side_table_of_the_base_and_each_method(tmp_path_factory, tmp_path):
    root = toy_root(tmp_path_factory)
    methods = ADAPTERS.names()[:2]
    out = tmp_path / "compare"
    assert main(["--data", str(root / "world"), "--out", str(out), "--methods", ",".join(methods), "--epochs", "1",
                 "--batch-size", "48", "--workers", "0", "--eval-tasks", "retrieval", "--",
                 "--extract-batch-size", "64"]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert list(results) == ["tiny", *[f"tiny + {m}" for m in methods]]
    md = (out / "results.md").read_text()
    assert md.startswith("| metric | tiny | " + " | ".join(f"tiny + {m}" for m in methods) + " |")
    assert "retrieval T2I R@1" in md
    summary = json.loads((out / "compare.json").read_text())
    assert set(summary["methods"]) == set(methods) and all(v["steps"] > 0 for v in summary["methods"].values())
    # one extraction served every method: a single train-split cache holds the union of their components
    train_caches = [p.parent for p in (out / "cache").glob("*/manifest.json")
                    if FeatureCache(p.parent).settings["data"]["name"].endswith(":train")]
    assert len(train_caches) == 1
    union = {c for m in methods for c in ADAPTERS.get(m).components}
    assert union <= set(FeatureCache(train_caches[0]).settings["components"])


def test_unknown_methods_are_listed(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--data", "x", "--methods", "comalign,nope"])
    assert "nope" in capsys.readouterr().err


def _fake_world(path):
    path.mkdir()
    (path / "meta.json").write_text("{}")
    (path / "annotations.json").write_text("{}")
    return path


def test_compare_calls_train_and_evaluate_with_their_options(tmp_path, monkeypatch):
    """Each method is one train(AdapterOptions) with the shared settings and the overrides after `--` (parsed once),
    the table one evaluate(EvaluateOptions); every run's settings are checked before the first trains."""
    import train.adapter.engine as ta
    import train.eval.evaluate as ev
    from train.adapter.engine import AdapterOptions
    from train.eval.evaluate import EvaluateOptions

    trained, evaluated = [], []

    def fake_train(opts):
        trained.append(opts)
        return {"steps": 3, "adapter": f"{opts.out}/adapter.safetensors", "val": {}, "inference": {}}

    def fake_evaluate(opts):
        evaluated.append(opts)
        return {"markdown": "| metric | ... |\n", "reports": [], "results": {}}

    monkeypatch.setattr(ta, "train", fake_train)
    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    world, out = _fake_world(tmp_path / "world"), tmp_path / "cmp"
    opts = parse_args(["--data", str(world), "--out", str(out), "--methods", "comalign,powerclip", "--epochs", "2",
                       "--", "--lr", "1e-4", "--max-entities", "5", "--no-learn-logit-scale"])
    assert opts.overrides == {"lr": 1e-4, "extract_options": {"max_entities": 5},
                              "head_config": {"learn_logit_scale": False}}  # a head flag both methods have
    result = compare(opts)
    assert all(type(o) is AdapterOptions for o in trained) and [o.method for o in trained] == ["comalign", "powerclip"]
    union = sorted(set(ADAPTERS.get("comalign").components) | set(ADAPTERS.get("powerclip").components))
    for o in trained:
        assert (o.lr, o.epochs, o.batch_size, o.final_eval, o.components) == (1e-4, 2, 256, False, union)
        assert (o.out, o.cache_dir, o.data) == (str(out / o.method), str(out / "cache"), str(world))
        assert o.extract_options == {"max_entities": 5} and o.head_config == {"learn_logit_scale": False}
    (table,) = evaluated
    assert type(table) is EvaluateOptions
    assert table.model == ["tiny", f"{out}/comalign/adapter.safetensors", f"{out}/powerclip/adapter.safetensors"]
    assert (table.data, table.split, table.out, table.tasks) == (str(world), "test", str(out),
                                                                 ["retrieval", "compositional"])
    assert result["markdown"] == "| metric | ... |\n" and result["methods"]["powerclip"]["steps"] == 3

    # an override one method cannot take: refused before anything trains or is written
    trained.clear()
    bad = parse_args(["--data", str(world), "--out", str(tmp_path / "bad"), "--methods", "comalign,smartclip", "--",
                      "--dropout", "0"])
    with pytest.raises(ValueError, match=r"smartclip: head_config: unknown key\(s\) dropout"):
        compare(bad)
    with pytest.raises(ValueError, match="overrides may not set out"):
        compare(parse_args(["--data", str(world), "--out", str(tmp_path / "bad"), "--", "--out", "elsewhere"]))
    with pytest.raises(ValueError, match="epochs: expected an integer >= 1, got 0"):
        compare(CompareOptions(data=str(world), out=str(tmp_path / "bad"), epochs=0))
    assert trained == [] and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_seeds_train_each_method_several_times_into_one_column(tmp_path_factory, tmp_path):
    """--seeds 2: the method is trained with seeds 3 and 4 on the same base, data and cache; the table has one
    column per method whose cells are the mean ± sd of the two runs, with the delta from the base."""
    import numpy as np

    root = toy_root(tmp_path_factory)
    out = tmp_path / "seeds"
    result = compare(CompareOptions(data=str(root / "world"), out=str(out), methods=["smartclip"], epochs=1,
                                    batch_size=48, workers=0, eval_tasks="retrieval", seed=3, seeds=2, bootstrap=200,
                                    cache_dir=str(root / "cache"), overrides={"extract_batch_size": 64}))
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["results"]) == ["tiny", "tiny + smartclip seed 3", "tiny + smartclip seed 4"]
    table = saved["table"]
    assert table["columns"] == {"tiny": ["tiny"], "tiny + smartclip": ["tiny + smartclip seed 3",
                                                                       "tiny + smartclip seed 4"]}
    base, cells = table["metrics"]["tiny"], table["metrics"]["tiny + smartclip"]
    for metric in ("retrieval T2I R@1", "retrieval T2I mAP", "retrieval I2T R@5"):
        runs = [saved["results"][label]["retrieval"] for label in table["columns"]["tiny + smartclip"]]
        if metric == "retrieval T2I R@1":  # each run's own figure, as results.json has it
            assert cells[metric]["runs"] == [r["text_to_image"]["R@1"] for r in runs]
        assert cells[metric]["mean"] == pytest.approx(np.mean(cells[metric]["runs"]))
        assert cells[metric]["sd"] == pytest.approx(np.std(cells[metric]["runs"], ddof=1))
        assert cells[metric]["delta"] == pytest.approx(cells[metric]["mean"] - base[metric]["mean"])
        lo, hi = cells[metric]["delta_ci"]
        assert lo <= cells[metric]["delta"] <= hi and cells[metric]["significant"] == (lo > 0 or hi < 0)
    assert any(c["sd"] > 0 for c in cells.values())  # two seeds, two different heads
    lines = result["markdown"].splitlines()
    assert lines[0] == "| metric | tiny | tiny + smartclip |" and sum(line.startswith("| metric |") for line in lines) == 1
    assert " ± " in result["markdown"] and "mean ± sd over 2 runs per column (training seeds" in result["markdown"]
    entry = json.loads((out / "compare.json").read_text())["methods"]["smartclip"]
    assert [r["seed"] for r in entry["runs"]] == [3, 4] and entry["best_seed"] in (3, 4)
    assert [r["checkpoint"] for r in entry["runs"]] == [str(out / "smartclip" / f"seed-{s}" / "adapter.safetensors")
                                                        for s in (3, 4)]
    assert entry["val"]["retrieval T2I R@1"] == pytest.approx(np.mean([r["val"]["retrieval T2I R@1"]
                                                                       for r in entry["runs"]]))


def test_variants_are_columns_of_their_method_with_their_own_settings(tmp_path, monkeypatch):
    """--variant "LABEL=METHOD flags": one more column, trained with the shared settings, then the flags after --,
    then its own (nested dicts merged key by key), into OUT/<method>-<label slug>, labelled "<name> (LABEL)"."""
    import train.adapter.engine as ta
    import train.eval.evaluate as ev
    from train.adapter.compare import Variant

    trained, evaluated = [], []
    monkeypatch.setattr(ta, "train", lambda o: trained.append(o) or {"steps": 1, "adapter": f"{o.out}/a.safetensors",
                                                                      "val": {}, "inference": {}})
    monkeypatch.setattr(ev, "evaluate", lambda o: evaluated.append(o) or {"markdown": "|", "reports": []})
    world, out = _fake_world(tmp_path / "world"), tmp_path / "cmp"
    opts = parse_args(["--data", str(world), "--out", str(out), "--methods", "comalign",
                       "--variant", "detector boxes=comalign --boxes yolo --detector y.pt",
                       "--variant", "random boxes=comalign --boxes random --lr 1e-3", "--", "--max-entities", "5",
                       "--lr", "1e-4"])
    assert opts.variants == [
        Variant("detector boxes", "comalign", {"extract_options": {"boxes": "yolo", "detector": "y.pt"}}),
        Variant("random boxes", "comalign", {"lr": 1e-3, "extract_options": {"boxes": "random"}})]
    result = compare(opts)
    assert [(o.out, o.lr, o.extract_options) for o in trained] == [
        (str(out / "comalign"), 1e-4, {"max_entities": 5}),
        (str(out / "comalign-detector-boxes"), 1e-4, {"max_entities": 5, "boxes": "yolo", "detector": "y.pt"}),
        (str(out / "comalign-random-boxes"), 1e-3, {"max_entities": 5, "boxes": "random"})]
    (table,) = evaluated
    assert table.model == ["tiny", *(f"{o.out}/a.safetensors" for o in trained)]
    assert table.columns == table.result_labels == [
        "{name}", "{name}", "{name} (detector boxes)", "{name} (random boxes)"]
    assert list(result["methods"]) == ["comalign", "comalign-detector-boxes", "comalign-random-boxes"]

    # with seeds, each variant's runs average into its own column
    evaluated.clear()
    compare(CompareOptions(data=str(world), out=str(tmp_path / "s"), methods=["smartclip"], seeds=2,
                           variants=[Variant("long", "smartclip", {"context_length": 248, "unfreeze": True})]))
    assert evaluated[0].columns == ["{name}", "{name}", "{name}", "{name} (long)", "{name} (long)"]
    assert evaluated[0].result_labels[3:] == ["{name} (long) seed 0", "{name} (long) seed 1"]

    # --reference: every column compared with a variant's (a fine-tune against its control), the base after it
    evaluated.clear()
    compare(CompareOptions(data=str(world), out=str(tmp_path / "r"), methods=["powerclip"], seeds=2,
                           pretrained="w.pt", reference="control",
                           variants=[Variant("tuned", "powerclip", {"unfreeze": True}),
                                     Variant("control", "powerclip", {"unfreeze": True, "head_config": {"lam": 0.0}})]))
    (table,) = evaluated
    runs = lambda key: [f"{tmp_path / 'r' / key}/seed-{s}/a.safetensors" for s in (0, 1)]  # noqa: E731
    assert table.model == [*runs("powerclip-control"), "tiny", *runs("powerclip"), *runs("powerclip-tuned")]
    assert table.pretrained == [None, None, "w.pt", None, None, None, None]  # the base's weights stay with the base
    assert table.columns == ["{name} (control)"] * 2 + ["{name}"] * 3 + ["{name} (tuned)"] * 2
    assert table.result_labels[:3] == ["{name} (control) seed 0", "{name} (control) seed 1", "{name}"]
    assert CompareOptions(data=str(world), methods=["powerclip"], reference="powerclip").reference_key() == "powerclip"

    # --methods none: only the variants' columns (a fine-tune and its control, without the frozen head's)
    evaluated.clear(), trained.clear()
    compare(parse_args(["--data", str(world), "--out", str(tmp_path / "n"), "--methods", "none", "--reference",
                        "control", "--variant", "tuned=powerclip --unfreeze",
                        "--variant", "control=powerclip --unfreeze --lam 0"]))
    assert [o.out for o in trained] == [str(tmp_path / "n" / k) for k in ("powerclip-tuned", "powerclip-control")]
    assert evaluated[0].columns == ["{name} (control)", "{name}", "{name} (tuned)"]
    with pytest.raises(ValueError, match="none: only the --variant columns"):
        CompareOptions(data=str(world), methods="none")
    with pytest.raises(ValueError, match="--reference 'ctrl': no such column"):
        CompareOptions(data=str(world), methods=["powerclip"], reference="ctrl")

    for variant, message in [("nolabel", "expected LABEL=METHOD"), ("x=nope", "unknown method 'nope'"),
                             ("a=", "expected LABEL=METHOD")]:
        with pytest.raises(ValueError, match=message):
            CompareOptions(data=str(world), methods=["comalign"], variant=[variant])
    with pytest.raises(ValueError, match="share the run folder 'comalign-a'"):  # labels "a" and "A": one folder
        CompareOptions(data=str(world), methods=["comalign"], variants=[Variant("a", "comalign"),
                                                                        Variant("A", "comalign")])
    with pytest.raises(ValueError, match="variant 'x' may not set out"):
        compare(CompareOptions(data=str(world), out=str(tmp_path / "bad"), methods=["comalign"],
                               variants=[Variant("x", "comalign", {"out": "elsewhere"})]))
