"""python -m train.adapter_compare: several registered methods trained on one shared cache, one side-by-side table."""
from __future__ import annotations

import json

import pytest

from adapters.registry import ADAPTERS
from extract.cache import FeatureCache
from train.adapter_compare import main, parse_args

from test_adapter import toy_root


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
