"""The demo's hard-world rows (train/demo_hard.py): the figures read off train.eval's results as they are, a table with
one row per model (the world itself: toyworld.ensure(hard=True), tested with it; the head and the whole step: the
demo's end-to-end test)."""
from train.demo_hard import controlled_rows, markdown


def test_rows_read_each_models_four_way_scores_and_pair_accuracies_and_the_table_shows_them():
    four = {"per_type": {"four-way": {"text": 100.0, "image": 87.5, "group": 50.0, "n": 2}}}
    pairs = {"per_type": {"all": {"acc": 80.0, "n": 10}, "swap-obj": {"acc": 97.5, "n": 4},
                          "replace-rel": {"acc": 62.5, "n": 4}}}
    results = {"base": {"compositional": {"toyworld-controlled-A": four, "toyworld-controlled-B": four,
                                          "toyworld": pairs}},
               "text only (base)": {"compositional": {"toyworld-controlled-A": four}}}
    rows = controlled_rows(results)
    assert [r["model"] for r in rows] == ["base", "text only (base)"]
    assert rows[0]["toyworld-controlled-B"] == {"text": 100.0, "image": 87.5, "group": 50.0, "sets": 2}
    assert rows[0]["pairs"] == {"swap-obj": 97.5, "replace-rel": 62.5}
    assert rows[1]["toyworld-controlled-B"]["text"] is None and rows[1]["pairs"]["swap-obj"] is None
    table = markdown(rows).splitlines()
    assert "2 sets per test" in table[0] and len(table) == 4
    assert table[2] == "| base | 100.0 / 87.5 / 50.0 | 100.0 / 87.5 / 50.0 | 97.5 | 62.5 |"
    assert table[3] == "| text only (base) | 100.0 / 87.5 / 50.0 | – / – / – | – | – |"
