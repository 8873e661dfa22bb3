"""Every entry point that reads data, configs, checkpoints or caches, run against the bad-input corpus
(``tests/fixtures/bad_inputs.py``): each bad input ends in a report line (the good rows kept, unchanged) or in one
``error:`` line naming the file and what to do, with exit status 2 -- never a traceback (an exception
escaping ``main`` fails the test), never a silently wrong result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures import bad_inputs as bi
from fixtures.bad_inputs import Corpus


def _error_line(err: str) -> str:
    """The one ``error:`` line a failed command printed (tqdm bars may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("error:") or ": error:" in line]
    assert lines, f"no error line in: {err[-2000:]}"
    assert "Traceback" not in err
    return lines[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return bi.build(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(scope="module")
def full_corpus(corpus, tmp_path_factory, tiny_toy_cache):
    """The corpus plus tampered checkpoints (of the session's trained ComAlign run) and a truncated cache."""
    from fixtures.toy import toy_root, trained_comalign

    run = trained_comalign(toy_root(tmp_path_factory))
    bi.add_checkpoints(corpus, run / "adapter.safetensors", run / "checkpoints" / "last.safetensors")
    bi.add_truncated_cache(corpus, tiny_toy_cache([]).path)
    return corpus


# --------------------------------------------------------------------------------------------- data sources
DATA_COMMANDS = ["check_data", "extract", "evaluate", "adapter", "adapter_compare", "pretrain", "index"]


def _run(command: str, spec: Path, tmp_path: Path) -> int:
    """Run one data-reading entry point on ``spec`` in this process (tiny backbone, no workers)."""
    out = tmp_path / command
    if command == "check_data":
        from extract.data.check import main

        return main([str(spec), "--workers", "0", "--report", str(out / "report.json")])
    if command == "extract":
        from extract.pipeline import main

        return main(["--data", str(spec), "--out", str(out), "--workers", "0", "--components", "tokens"])
    if command == "evaluate":
        from train.eval.evaluate import main

        return main(["--model", "tiny", "--retrieval-data", str(spec), "--tasks", "retrieval", "--out", str(out)])
    if command == "index":
        from serve.index import main

        return main(["--model", "tiny", "--data", str(spec), "--out", str(out / "index"), "--cache-dir",
                     str(out / "cache"), "--workers", "0"])
    if command == "adapter":
        from train.adapter.engine import main

        return main(["--method", "comalign", "--data", str(spec), "--out", str(out), "--cache-dir", str(out / "cache"),
                     "--workers", "0"])
    if command == "adapter_compare":
        from train.adapter.compare import main

        return main(["--data", str(spec), "--out", str(out), "--methods", "comalign", "--workers", "0"])
    from train.pretrain.engine import main

    # one epoch of one step over the whole table (12 records), no evaluation: every row is read once
    return main(["--data", str(spec), "--out", str(out), "--workers", "0", "--no-tensorboard", "--epochs", "1",
                 "--batch-size", "12", "--eval-every-n-epochs", "0", "--save-every-n-steps", "0"])


@pytest.mark.parametrize("command", DATA_COMMANDS)
@pytest.mark.parametrize("table", sorted(bi.UNREADABLE_TABLES))
def test_an_unreadable_table_is_one_error_line_naming_the_fix(corpus, tmp_path, capsys, command, table):
    path, message = corpus.tables[table]
    assert _run(command, path, tmp_path) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(path) in line and message in line, line


def _report(path: Path) -> list[dict]:
    return json.loads(path.read_text())["skipped"]


def test_check_data_reports_every_bad_row_of_the_mixed_table_with_its_line(corpus, tmp_path, capsys):
    from extract.data.check import main

    report = tmp_path / "report.json"
    assert main([str(corpus.mixed_csv), "--workers", "0", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    good_images = len({image for image, _ in bi.MIXED_GOOD})
    assert f"{good_images} good images with {len(bi.MIXED_GOOD)} captions" in out
    skips = _report(report)
    for line, image, _, outcome in bi.MIXED_ROWS:
        if outcome is None:
            continue
        where = f"{corpus.mixed_csv}:{line}"
        if outcome == "image":  # the image's row is where it was declared; the reason says why it was refused
            hits = [s for s in skips if s["kind"] == "image" and s["location"] == where]
            assert hits and hits[0]["reason"].startswith(bi.BAD_IMAGES[image]), (image, hits, skips)
        else:
            assert any(s["location"] == where and s["reason"] == outcome for s in skips), (line, outcome, skips)
    notes = json.loads(report.read_text())["converted"]
    assert sorted(n["image_id"] for n in notes) == sorted(bi.CONVERTED)  # converted once each, and noted


def test_extraction_keeps_exactly_the_good_rows_of_the_mixed_table(corpus, tmp_path, capsys):
    """No silent change to the good rows: the cache holds every good caption under its own image, nothing else,
    and the bad rows are in the cache's report.json with their lines."""
    from extract.cache import FeatureCache
    from extract.pipeline import main

    assert main(["--data", str(corpus.mixed_csv), "--out", str(tmp_path / "cache"), "--workers", "0",
                 "--components", "tokens"]) == 0
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    cache = FeatureCache.open(folder)
    rows = list(csv_rows(corpus.mixed_csv))
    text_of = {f"{corpus.mixed_csv.name}:{line}": (image, caption) for line, image, caption in rows}
    cached = {text_of[cid] for cid in cache.caption_ids()}
    assert {(image, caption.strip('"')) for image, caption in cached} == bi.MIXED_GOOD
    image_of = dict(zip(range(cache.num_images), cache.image_ids()))
    assert all(image_of[i] == text_of[c][0] for c, i in zip(cache.caption_ids(), cache.caption_image_index()))
    reasons = {s["location"].rsplit(":", 1)[1]: s["reason"] for s in _report(folder / "report.json")}
    assert reasons["16"] == "unterminated quote" and reasons["6"] == "caption has no letters"
    assert "error" not in capsys.readouterr().err


def csv_rows(path: Path):
    """(line, image, caption as written) of the corpus table, read naively line by line (its ground truth)."""
    for line, text in enumerate(path.read_text().splitlines()[1:], start=2):
        image, caption = text.split(",", 1)
        yield line, image, caption


def test_evaluation_skips_the_bad_images_and_counts_them(corpus, tmp_path, capsys):
    from train.eval.evaluate import main

    out = tmp_path / "eval"
    assert main(["--model", "tiny", "--retrieval-data", str(corpus.mixed_csv), "--tasks", "retrieval",
                 "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())["results"]
    (result,) = r.values()
    good_images = len({image for image, _ in bi.MIXED_GOOD})
    assert result["retrieval"]["images"] == good_images and result["retrieval"]["captions"] == len(bi.MIXED_GOOD)
    assert result["retrieval"]["skipped_images"] == len(bi.BAD_IMAGES)
    assert "warning: retrieval: only 6 images" in capsys.readouterr().out  # too few for the metrics to mean much


def _assert_bad_rows_reported(corpus: Corpus, report: Path) -> None:
    """Every bad row of the mixed table is in ``report`` (a data_report.json / a cache's report.json) at its line,
    and each converted image is noted once."""
    where = {(s["location"], s["kind"]) for s in _report(report)}
    for line, _, _, outcome in bi.MIXED_ROWS:
        if outcome is not None:
            assert (f"{corpus.mixed_csv}:{line}", "image" if outcome == "image" else "caption") in where, line
    notes = json.loads(report.read_text())["converted"]
    assert sorted(n["image_id"] for n in notes) == sorted(bi.CONVERTED), notes


def test_pretraining_uses_every_good_row_and_reports_the_bad_ones(corpus, tmp_path, capsys, monkeypatch):
    """One epoch visits every record once: the good images are all drawn, each with one of its own captions; the
    bad images (replaced by good ones) and captions are in data_report.json, and the converted images are counted
    (they were "converted 0 images")."""
    from train.pretrain.data import TrainData

    drawn, records = [], []
    epoch_batches = TrainData.epoch_batches

    def spy(self, epoch, start_step):
        records[:] = self.loader.dataset.records
        for micro in epoch_batches(self, epoch, start_step):
            drawn.extend(pair for b in micro for pair in zip(b["image_ids"], b["captions"]))
            yield micro

    monkeypatch.setattr(TrainData, "epoch_batches", spy)
    assert _run("pretrain", corpus.mixed_csv, tmp_path) == 0
    good_images = {image for image, _ in bi.MIXED_GOOD}
    indexed = {(r.image_id, c.text) for r in records for c in r.captions if r.image_id not in bi.BAD_IMAGES}
    assert indexed == bi.MIXED_GOOD  # the index holds every good row, unchanged, and no bad caption
    assert len(drawn) == 12 and set(drawn) <= bi.MIXED_GOOD and {i for i, _ in drawn} == good_images
    _assert_bad_rows_reported(corpus, tmp_path / "pretrain" / "data_report.json")
    out = capsys.readouterr().out
    assert "converted 3 images" in out and "Traceback" not in out


def test_an_index_of_the_mixed_table_holds_exactly_its_good_rows(corpus, tmp_path, capsys):
    from pyarrow import feather

    assert _run("index", corpus.mixed_csv, tmp_path) == 0
    texts = feather.read_table(tmp_path / "index" / "index" / "text.arrow").to_pylist()
    assert {(t["image_id"], t["text"]) for t in texts} == bi.MIXED_GOOD and len(texts) == len(bi.MIXED_GOOD)
    images = feather.read_table(tmp_path / "index" / "index" / "image.arrow").to_pylist()
    assert sorted(i["image_id"] for i in images) == sorted({image for image, _ in bi.MIXED_GOOD})
    (report,) = (tmp_path / "index" / "cache").glob("*/report.json")
    _assert_bad_rows_reported(corpus, report)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check_data", "extract", "evaluate"])
def test_coco_with_an_unknown_image_and_a_cut_shard_are_reported_and_reading_goes_on(corpus, tmp_path, capsys,
                                                                                      command):
    assert _run(command, corpus.coco, tmp_path / "coco") == 0
    assert _run(command, corpus.cut_shard, tmp_path / "shard") == 0
    assert "Traceback" not in capsys.readouterr().err
    if command == "check_data":
        coco, shard = _report(tmp_path / "coco" / command / "report.json"), \
            _report(tmp_path / "shard" / command / "report.json")
        assert any("unknown image" in s["reason"] for s in coco) and any(s["reason"] == "caption is not text"
                                                                          for s in coco)
        assert shard and all(str(corpus.cut_shard) in s["location"] for s in shard)


# --------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("command, config", [("adapter", c) for c in sorted(bi.BAD_CONFIGS)]
                         + [("pretrain", c) for c in sorted(bi.BAD_CONFIGS) if c != "schedule_linear.yaml"])
def test_a_bad_config_value_fails_the_flags_own_check(corpus, tmp_path, capsys, command, config):
    """(train.pretrain.engine has no --schedule: that file is an unknown key there, tested in tests/extract/test_config.py.)"""
    path, message = corpus.configs[config]
    if command == "adapter":
        from train.adapter.engine import parse_args

        argv = ["--method", "comalign", "--data", "x", "--out", str(tmp_path), "--config", str(path)]
    else:
        from train.pretrain.options import parse_args

        argv = ["--data", "x", "--config", str(path)]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--config {path}" in line and message in line, line


def _unknown(key: str) -> str:
    return f"unknown key(s) {key}; accepted: "


# extract, train.eval.evaluate and extract.data.check take fewer keys: one they lack is refused by name, the others checked
@pytest.mark.parametrize("command, config, message", [
    *[("extract", c, bi.BAD_CONFIGS[c][1]) for c in ("precision_fp64.yaml", "workers_true.yaml",
                                                      "batch_size_zero.yaml", "syntax_error.yaml")],
    ("extract", "lr_true.yaml", _unknown("lr")),
    ("evaluate", "batch_size_zero.yaml", bi.BAD_CONFIGS["batch_size_zero.yaml"][1]),
    ("evaluate", "syntax_error.yaml", "not valid YAML"), ("evaluate", "lr_true.yaml", _unknown("lr")),
    ("check_data", "workers_true.yaml", bi.BAD_CONFIGS["workers_true.yaml"][1]),
    ("check_data", "syntax_error.yaml", "not valid YAML"), ("check_data", "lr_true.yaml", _unknown("lr")),
])
def test_a_bad_config_is_refused_by_the_extraction_and_evaluation_commands_too(corpus, tmp_path, capsys, command,
                                                                                config, message):
    path = corpus.configs[config][0]
    if command == "extract":
        from extract.pipeline import parse_args

        argv = ["--data", "x", "--out", str(tmp_path), "--config", str(path)]
    elif command == "evaluate":
        from train.eval.evaluate import parse_args

        argv = ["--model", "tiny", "--config", str(path)]
    else:
        from extract.data.check import parse_args

        argv = ["x", "--config", str(path)]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--config {path}" in line and message in line, line


# --------------------------------------------------------------------------------------------- checkpoints, caches
@pytest.mark.parametrize("name, message", [
    ("adapter_flipped", "is damaged: its tensor data do not match the digest"),
    ("adapter_nan", "non-finite"),
    ("pretrain_flipped", "is damaged: its tensor data do not match the digest"),
])
@pytest.mark.parametrize("command", ["evaluate", "index"])
def test_a_tampered_checkpoint_is_refused_naming_the_file(full_corpus, tmp_path, capsys, name, message, command):
    path = full_corpus.checkpoints[name]
    if command == "evaluate":
        from train.eval.evaluate import main

        code = main(["--model", str(path), "--tasks", "retrieval", "--retrieval-data", str(full_corpus.mixed_csv),
                     "--out", str(tmp_path)])
    else:
        from serve.index import main

        code = main(["--model", str(path), "--data", str(full_corpus.mixed_csv), "--out", str(tmp_path / "index"),
                     "--cache-dir", str(tmp_path / "cache"), "--workers", "0"])
    assert code == 2
    line = _error_line(capsys.readouterr().err)
    assert str(path) in line and message in line, line
    assert not (tmp_path / "cache").exists()  # refused before any extraction


def test_resuming_from_a_tampered_training_state_is_refused_naming_the_file(full_corpus, tmp_path_factory, tmp_path,
                                                                           capsys):
    """The run's own data and cache (reused): only the state is damaged."""
    from fixtures.toy import adapter_argv, toy_root
    from train.adapter.engine import main

    path = full_corpus.checkpoints["state_flipped"]
    root = toy_root(tmp_path_factory)
    assert main(adapter_argv(root, "comalign", tmp_path / "run", "--epochs", "2", "--resume", str(path))) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(path) in line and "is damaged: its tensor data do not match the digest" in line, line


def _with_pretrained(command: str, path: Path, corpus: Corpus, tmp_path: Path) -> int:
    """Run an entry point that takes ``--pretrained path`` (each fails on it before reading any data)."""
    if command == "backbone":
        from extract.models.backbone import main

        return main(["--base", "tiny", "--pretrained", str(path)])
    if command == "extract":
        from extract.pipeline import main

        return main(["--data", str(corpus.mixed_csv), "--out", str(tmp_path), "--pretrained", str(path),
                     "--components", "tokens"])
    if command == "evaluate":
        from train.eval.evaluate import main

        return main(["--model", "tiny", "--pretrained", str(path), "--retrieval-data", str(corpus.mixed_csv),
                     "--tasks", "retrieval", "--out", str(tmp_path)])
    if command == "adapter":
        from train.adapter.engine import main

        return main(["--method", "comalign", "--pretrained", str(path), "--data", str(corpus.mixed_csv), "--out",
                     str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--workers", "0"])
    from train.pretrain.engine import main

    return main(["--data", str(corpus.mixed_csv), "--out", str(tmp_path), "--pretrained", str(path)])


@pytest.mark.parametrize("command", ["backbone", "extract", "evaluate", "pretrain"])
def test_a_foreign_pickle_is_never_unpickled_and_the_message_says_how_to_convert(full_corpus, tmp_path, capsys,
                                                                                 command):
    path = str(full_corpus.checkpoints["foreign_pickle"])
    assert _with_pretrained(command, Path(path), full_corpus, tmp_path) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights_only=False" not in err.split("will not")[0]
    assert path in err and "safetensors" in err and "argparse.Namespace" in err


@pytest.mark.parametrize("command", ["backbone", "evaluate", "adapter", "pretrain"])
@pytest.mark.parametrize("name", sorted(bi.UNUSABLE_WEIGHTS))
def test_pretrained_weights_torch_cannot_use_are_one_error_line(full_corpus, tmp_path, capsys, command, name):
    """A cut .pt was diagnosed as "does not fit architecture" with a traceback, a 404 page ended in torch's unpickler
    error, another architecture's state dict in a RuntimeError traceback listing every key."""
    path = full_corpus.checkpoints[name.removesuffix(".pt")]
    assert _with_pretrained(command, path, full_corpus, tmp_path) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {path} ") and bi.UNUSABLE_WEIGHTS[name] in line, line
    assert len(line.replace(str(path), "PATH")) < 400  # a few key names, not all of them (the path is the tmp folder's)
    assert not (tmp_path / "cache").exists()  # refused before any extraction


@pytest.mark.parametrize("command", ["evaluate", "adapter"])
def test_a_truncated_cache_is_refused_naming_the_shard_file(full_corpus, tmp_path, capsys, command):
    cache = full_corpus.caches["truncated"]
    (folder,) = list(cache.iterdir())
    if command == "evaluate":
        from train.eval.evaluate import main

        code = main(["--model", "tiny", "--cache", str(folder), "--tasks", "retrieval", "--out", str(tmp_path)])
    else:
        from train.adapter.engine import main

        code = main(["--method", "comalign", "--cache", str(folder), "--out", str(tmp_path), "--workers", "0"])
    assert code == 2
    line = _error_line(capsys.readouterr().err)
    assert str(full_corpus.caches["truncated_file"]) in line and "rebuild" in line, line


# --------------------------------------------------------------------------------------------- --out
@pytest.mark.parametrize("command", ["adapter", "pretrain"])
def test_an_unusable_out_is_refused_before_any_extraction_or_training(corpus, tmp_path, capsys, command):
    """--out under a file (as /etc/passwd/x): the adapter failed only after extraction, with [Errno 20] alone."""
    out = corpus.mixed_csv / "run"
    if command == "adapter":
        from train.adapter.engine import main

        code = main(["--method", "comalign", "--data", str(corpus.mixed_csv), "--out", str(out), "--cache-dir",
                     str(tmp_path / "cache"), "--workers", "0", "--batch-size", "2"])
    else:
        from train.pretrain.engine import main

        code = main(["--data", str(corpus.mixed_csv), "--out", str(out), "--workers", "0", "--epochs", "1"])
    assert code == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--out {out} cannot be used as the run folder (Not a directory" in line, line
    assert not (tmp_path / "cache").exists()
