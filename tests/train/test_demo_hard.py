"""The demo's hard-world rows (train/demo_hard.py): the world made once and reused, the figures read off train.eval's
results as they are, a table with one row per model."""
import json

from train.demo_hard import controlled_rows, hard_world, markdown


def test_the_hard_world_is_made_once_and_remade_when_its_settings_change(tmp_path):
    said = []
    world = hard_world(tmp_path / "hw", 40, 0, say=said.append)
    meta = json.loads((world / "meta.json").read_text())
    assert meta["hard"] is True and meta["n"] == 40 and (world / "controlled_b.json").is_file()
    stamp = (world / "meta.json").stat().st_mtime_ns
    hard_world(tmp_path / "hw", 40, 0, say=said.append)
    assert "reusing" in said[-1] and (world / "meta.json").stat().st_mtime_ns == stamp
    hard_world(tmp_path / "hw", 40, 1, say=said.append)
    assert json.loads((world / "meta.json").read_text())["seed"] == 1


def test_rows_read_each_models_four_way_scores_and_the_table_shows_them():
    four = {"per_type": {"four-way": {"text": 100.0, "image": 87.5, "group": 50.0, "n": 2}}}
    results = {"base": {"compositional": {"toyworld-controlled-A": four, "toyworld-controlled-B": four}},
               "text only (base)": {"compositional": {"toyworld-controlled-A": four}}}
    rows = controlled_rows(results)
    assert [r["model"] for r in rows] == ["base", "text only (base)"]
    assert rows[0]["toyworld-controlled-B"] == {"text": 100.0, "image": 87.5, "group": 50.0, "sets": 2}
    assert rows[1]["toyworld-controlled-B"]["text"] is None
    table = markdown(rows).splitlines()
    assert "2 sets per test" in table[0] and len(table) == 4
    assert table[2] == "| base | 100.0 / 87.5 / 50.0 | 100.0 / 87.5 / 50.0 |"
    assert table[3] == "| text only (base) | 100.0 / 87.5 / 50.0 | – / – / – |"
