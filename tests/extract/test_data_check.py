import io
import json
import tarfile

import pytest
from PIL import Image

from extract.data.check import CheckDataOptions, check_data, main


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


def test_help_names_the_command_and_says_what_it_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m extract.data.check")
    assert "\nDecode every image and caption of a data source once" in out
    assert "ython -m extract.data.check SOURCE" not in out and "``" not in out
    assert "--csv-separator" in out and "--csv-encoding" in out


UTF16 = "filepath,title\na.png,a cat\n".encode("utf-16")


@pytest.mark.parametrize("content, flags, message", [
    (b"path,text\na.png,a cat\n", [], "no column 'filepath'"),
    (b"filepath\ttitle\na.png\ta cat\n", [], "looks tab-separated: pass --csv-separator '\\t'"),
    (b"", [], "is empty"),
    (UTF16, [], "--csv-encoding utf-16"),
    (b"image,caption\na.png,a cat\n", ["--csv-img-key", "image"], "no column 'title'"),
])
def test_a_table_that_cannot_be_read_is_one_error_line(tmp_path, capsys, content, flags, message):
    (tmp_path / "data.csv").write_bytes(content)
    assert main([str(tmp_path / "data.csv"), "--workers", "0", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and "Traceback" not in captured.err


def test_missing_source_is_one_error_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope.csv"), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.csv" in err and err.count("\n") == 1


@pytest.mark.parametrize("content, flags", [
    (b"filepath\ttitle\na.png\ta red square\n", ["--csv-separator", "\\t"]),
    (b"image;text\na.png;a red square\n", ["--csv-separator", ";", "--csv-img-key", "image", "--csv-caption-key",
                                           "text"]),
    ("filepath,title\na.png,a red square\n".encode("utf-16"), ["--csv-encoding", "utf-16"]),
])
def test_the_flags_the_errors_name_read_the_table(tmp_path, capsys, content, flags):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "data.csv").write_bytes(content)
    assert main([str(tmp_path / "data.csv"), "--workers", "0", *flags]) == 0
    assert "1 good images with 1 captions" in capsys.readouterr().out


def test_unterminated_quote_is_reported_with_its_line(tmp_path, capsys):
    for name in "abcd":
        Image.new("RGB", (8, 8), "red").save(tmp_path / f"{name}.png")
    (tmp_path / "data.csv").write_text('filepath,title\na.png,a: red\nb.png,"b: red\nc.png,c: red\nd.png,d: red\n')
    report = tmp_path / "report.json"
    assert main([str(tmp_path / "data.csv"), "--workers", "0", "--report", str(report)]) == 0
    assert "3 good images with 3 captions" in capsys.readouterr().out
    (skip,) = json.loads(report.read_text())["skipped"]
    assert (skip["location"], skip["reason"]) == (f"{tmp_path / 'data.csv'}:3", "unterminated quote")


def _shard(path, samples) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in samples:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _jpeg(mode: str, color) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (16, 16), color).save(buffer, "JPEG")
    return buffer.getvalue()


def test_webdataset_report_is_extracts_and_counts_a_conversion_once(tmp_path, capsys):
    from extract.pipeline import build_cache

    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(shards / "000.tar", [("cmyk.jpg", _jpeg("CMYK", (0, 255, 255, 0))), ("cmyk.txt", b"a red square"),
                                ("rgb.jpg", _jpeg("RGB", (0, 0, 200))), ("rgb.txt", b"a blue square")])
    _shard(shards / "001.tar", [("bad.jpg", b"\xff\xd8 not a JPEG"), ("bad.txt", b"never seen"),
                                ("gray.jpg", _jpeg("L", 90)), ("gray.txt", b"a grey square")])
    report = tmp_path / "check.json"
    assert main([str(shards), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    checked = json.loads(report.read_text())
    assert checked["summary"] in out
    assert checked["summary"].endswith("converted 1 image (1 CMYK converted to RGB)")
    cache = build_cache(shards, tmp_path / "cache", components=[], workers=0)
    extracted = json.loads((cache.path / "report.json").read_text())
    assert extracted == checked  # the same summary, counts and entries, the conversion listed once
    assert extracted["converted"] == [{"image_id": "cmyk", "location": f"{shards / '000.tar'}::cmyk",
                                       "note": "CMYK converted to RGB"}]


def test_the_job_from_python_returns_the_counts_and_gets_the_flags_checks(tmp_path, capsys):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "data.csv").write_text("filepath,title\na.png,a red square\nb.png,a missing image\n")
    result = check_data(CheckDataOptions(source=str(tmp_path / "data.csv"), workers=0))
    assert (result["images"], result["captions"], result["report"]) == (1, 1, None)
    assert result["counts"]["image"] and result["summary"].startswith("skipped 1 image")
    assert "checked" not in capsys.readouterr().out  # the command line prints; the function returns
    with pytest.raises(ValueError, match="workers: expected an integer >= 0, got -1"):
        check_data(CheckDataOptions(source=str(tmp_path / "data.csv"), workers=-1))
    with pytest.raises(ValueError, match="unusual: invalid choice"):
        check_data(CheckDataOptions(source=str(tmp_path / "data.csv"), unusual="keep"))


def test_argument_errors_are_one_line_and_quiet_keeps_the_result(tmp_path, capsys):
    from extract.common import cli

    for argv, message in (([], "the data source is required"), (["x.csv", "--workers", "-1"], "--workers"),
                          (["x.csv", "--no-such-flag"], "unrecognized arguments: --no-such-flag")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage:" not in err and message in err and err.count("\n") == 2, err
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "data.csv").write_text("filepath,title\na.png,a red square\n")
    try:
        assert main([str(tmp_path / "data.csv"), "--workers", "0", "--quiet"]) == 0
    finally:
        cli.set_verbosity(cli.NORMAL)
    assert capsys.readouterr().out.startswith("checked data.csv: 1 good images with 1 captions")
