import json

from PIL import Image

from extract.check_data import main


def test_check_data_counts_good_and_bad(tmp_path, capsys):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"")  # empty file
    (tmp_path / "data.csv").write_text("filepath,title\na.png,a red square\na.png,red\nb.png,a blank\na.png,\n")
    report = tmp_path / "report.json"
    assert main([str(tmp_path / "data.csv"), "--workers", "0", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "1 good images with 2 captions" in out and "empty file" in out
    reasons = json.dumps(json.loads(report.read_text()))
    assert "empty file" in reasons and "empty caption" in reasons
