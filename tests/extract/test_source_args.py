"""extract/common/source_args.py: one group of data-source flags for every command that reads data."""
from __future__ import annotations

import argparse
import json

import pytest
from PIL import Image

from extract.data.sources import COCOSource, CSVSource, open_source
from extract.common.source_args import DEFAULTS, add_source_args, source_flags, source_options


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    add_source_args(p)
    return p


def test_defaults_read_a_plain_csv():
    args = parser().parse_args([])
    assert source_options(args) == {"img_key": "filepath", "caption_key": "title", "sep": None, "encoding": "utf-8"}
    assert source_options(argparse.Namespace()) == source_options(args)  # a Namespace built by hand
    assert source_flags(args) == {}


@pytest.mark.parametrize("spelling", ["\t", "\\t", "tab", "TAB"])
def test_a_tab_can_be_typed(spelling):
    args = parser().parse_args(["--csv-separator", spelling])
    assert source_options(args)["sep"] == "\t"


@pytest.mark.parametrize("argv, flag", [(["--csv-separator", "ab"], "--csv-separator"),
                                        (["--csv-separator", '"'], "--csv-separator"),
                                        (["--csv-encoding", "no-such-codec"], "--csv-encoding")])
def test_bad_values_are_parser_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=flag):  # and for a Namespace that no parser checked
        source_options(argparse.Namespace(**{flag[2:].replace("-", "_"): argv[1]}))


def test_options_open_any_source(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "t.csv").write_bytes("image\tcaption\na.png\ta dark square\n".encode("utf-16"))
    args = parser().parse_args(["--csv-img-key", "image", "--csv-caption-key", "caption", "--csv-separator", "tab",
                                "--csv-encoding", "utf-16"])
    source = open_source(tmp_path / "t.csv", **source_options(args))
    assert isinstance(source, CSVSource)
    assert [(s.image_id, s.captions[0].text) for s in source] == [("a.png", "a dark square")]
    # the other sources ignore them, so one set of flags serves every spec
    (tmp_path / "c.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}],
                                                 "annotations": [{"id": 5, "image_id": 1, "caption": "a square"}]}))
    assert isinstance(open_source(tmp_path / "c.json", **source_options(args)), COCOSource)


def test_flags_pass_on_what_differs_from_the_defaults():
    args = parser().parse_args(["--csv-img-key", "image", "--csv-separator", "tab"])
    flags = source_flags(args)
    assert flags == {"csv_img_key": "image", "csv_separator": "\t"}
    argv = [x for dest, value in flags.items() for x in (f"--{dest.replace('_', '-')}", value)]
    assert source_options(parser().parse_args(argv)) == source_options(args)


def test_values_from_a_config_file(tmp_path):
    from extract.common.config import parse_with_config

    (tmp_path / "c.yaml").write_text("csv_separator: '\\t'\ncsv-img-key: image\n")
    args = parse_with_config(parser(), ["--config", str(tmp_path / "c.yaml")])
    assert source_options(args)["sep"] == "\t" and args.csv_img_key == "image"


@pytest.mark.parametrize("build", ["extract.pipeline", "extract.data.check", "train.pretrain.engine"])
def test_every_command_that_reads_data_has_the_group(build):
    import importlib

    p = importlib.import_module(build).build_parser()
    required = {"extract.pipeline": ["--data", "d", "--out", "o"], "extract.data.check": ["d"]}.get(build, [])
    args = p.parse_args([*required, "--csv-img-key", "image", "--csv-separator", "tab", "--csv-encoding", "latin-1"])
    assert source_options(args) == {"img_key": "image", "caption_key": DEFAULTS["csv_caption_key"], "sep": "\t",
                                    "encoding": "latin-1"}
    assert "data source" in p.format_help()
