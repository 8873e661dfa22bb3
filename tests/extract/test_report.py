import json

from extract.data.images import BadImage
from extract.data.report import Skip, SkipReport


def test_counts_summary_dedupe_and_merge(tmp_path):
    a = SkipReport()
    a.add(Skip("image", "1", "x.csv:2", "empty file"))
    a.add(Skip("image", "1", "x.csv:2", "empty file", "again"))  # same item seen twice: counted once
    a.add(Skip.from_error("image", "2", "x.csv:3", BadImage("truncated image data", "cut")))
    a.add(Skip("caption", "x.csv:4", "x.csv:4", "empty caption"))
    a.note("3", "x.csv:5", "CMYK converted to RGB")
    b = SkipReport()
    b.add(Skip("image", "2", "x.csv:3", "truncated image data"))  # duplicate of a's
    b.add(Skip("shard", "s.tar", "s.tar", "damaged shard"))
    a.merge(b)
    assert a.counts() == {"shard": {"damaged shard": 1}, "image": {"empty file": 1, "truncated image data": 1},
                          "caption": {"empty caption": 1}, "converted": {"CMYK converted to RGB": 1}}
    assert a.summary() == ("skipped 1 shard (1 damaged shard), 2 images (1 empty file, 1 truncated image data), "
                           "1 caption (1 empty caption); converted 1 image (1 CMYK converted to RGB)")
    a.to_json(tmp_path / "r" / "report.json")
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert len(data["skipped"]) == 4 and data["skipped"][1]["detail"] == "cut"
    assert SkipReport().summary() == "skipped 0 images, 0 captions; converted 0 images"
