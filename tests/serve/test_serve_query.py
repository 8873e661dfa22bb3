"""python -m serve.query: the table and --json, filters and paging from the command line, and every bad input on
the query side -- each one `error:` line with exit status 2 (a traceback only with --debug / PLUGVLM_DEBUG=1), the
index directory left exactly as it was.

Uses the session setup of tests/serve/test_serve_search.py (a trained ComAlign and flat indexes of a toy world's test
split).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fixtures.bad_inputs import flip_bit, overwrite_block
from serve.query import main
from serve.search import Searcher
from fixtures.serve import QUERY, serve_setup

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return serve_setup(tmp_path_factory)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(capsys, argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------------------------- output
@pytest.mark.slow
def test_the_table_lists_the_hits_with_both_ranks_and_scores(setup, capsys):
    rc, out, err = _run(capsys, [setup.adapter_index, QUERY, "--k", "3", "--rerank", "8"])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"images for {QUERY!r} (tiny + comalign; ") and "12 images, 53 captions; first 8 " \
        "re-ranked)" in lines[0]
    assert lines[1].split() == ["rank", "stage-1", "rank", "stage-1", "score", "re-ranked", "score", "image_id", "path"]
    expected = Searcher.open(setup.adapter_index).search_text(QUERY, k=3, rerank=8)
    for line, hit in zip(lines[2:5], expected):
        cells = line.split()
        assert cells == [str(hit.rank_after), str(hit.rank_before), f"{hit.score:.4f}", f"{hit.rerank_score:.4f}",
                         hit.id, hit.path]
    assert len(lines) == 5  # no notes


@pytest.mark.slow
def test_json_is_the_searchers_result_and_nothing_else(setup, capsys):
    image = setup.world / "images" / "000008.png"
    rc, out, err = _run(capsys, [setup.adapter_index, "--image", image, "--k", "4", "--rerank", "100", "--json"])
    assert rc == 0, err
    data = json.loads(out)  # the whole of stdout is one JSON object
    expected = Searcher.open(setup.adapter_index).search_image(str(image), k=4, rerank=100)
    assert data["hits"] == json.loads(json.dumps(expected.to_dict()["hits"]))
    assert data["direction"] == "i2t" and data["rerank"] == 53 and data["model"] == "tiny + comalign"
    assert data["notes"] == ["rerank=100 is more than the 53 captions in the collection: clamped to 53"]
    assert data["collection"] == {"images": 12, "captions": 53} and data["has_second_stage"]
    assert {"row", "caption_id", "text", "image_row", "image_id", "cache_row"} <= set(data["hits"][0]["metadata"])


@pytest.mark.slow
def test_an_image_query_with_coco_instances_keyed_by_integer_ids(setup, tmp_path, capsys):
    """--annotations in COCO's own layout (int ids, bbox [x, y, w, h]): the query image is found by its file name,
    and its boxes (the toy world's, converted) re-rank exactly as the toy world's own do. An image the file does not
    name is one error line naming the file and the image, not a re-ranking without boxes."""
    scenes = json.loads((setup.world / "annotations.json").read_text())["scenes"]
    scene = next(s for s in scenes if s["file_name"].endswith("000008.png"))
    coco = {"images": [{"id": int(scene["image_id"]), "file_name": scene["file_name"], "width": scene["width"],
                        "height": scene["height"]}],
            "annotations": [{"id": k, "image_id": int(scene["image_id"]), "category_id": 1, "iscrowd": 0,
                             "bbox": [o["box"][0], o["box"][1], o["box"][2] - o["box"][0], o["box"][3] - o["box"][1]]}
                            for k, o in enumerate(scene["objects"])],
            "categories": [{"id": 1, "name": "shape"}]}
    (tmp_path / "instances.json").write_text(json.dumps(coco))
    image = setup.world / "images" / "000008.png"
    rc, out, err = _run(capsys, [setup.adapter_index, "--image", image, "--k", "4", "--rerank", "20", "--json",
                                 "--annotations", tmp_path / "instances.json"])
    assert rc == 0, err
    expected = Searcher.open(setup.adapter_index).search_image(str(image), k=4, rerank=20)  # the world's own boxes
    assert [h["row"] for h in json.loads(out)["hits"]] == [h.row for h in expected]
    assert [h["rerank_score"] for h in json.loads(out)["hits"]] == pytest.approx([h.rerank_score for h in expected],
                                                                                 abs=1e-5)
    other = setup.world / "images" / "000009.png"
    rc, out, err = _run(capsys, [setup.adapter_index, "--image", other, "--k", "4", "--rerank", "20",
                                 "--annotations", tmp_path / "instances.json"])
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert "instances.json (COCO instances) holds no boxes for image" in err and "000009.png" in err


@pytest.mark.slow
def test_filters_and_pages_from_the_command_line(setup, capsys):
    searcher = Searcher.open(setup.backbone_index)
    full = searcher.search_text(QUERY, k=12)
    ids = [h.id for h in full]
    chosen = ids[3:8]
    argv = [setup.backbone_index, QUERY, "--json", "--k", "2", "--offset", "1"] + \
        [a for i in chosen for a in ("--where", f"image_id={i}")]
    rc, out, err = _run(capsys, argv)
    assert rc == 0, err
    assert [h["id"] for h in json.loads(out)["hits"]] == chosen[1:3]
    rc, out, err = _run(capsys, [setup.backbone_index, QUERY, "--rerank", "5", "--k", "2"])
    assert rc == 0 and out.splitlines()[-1].startswith("note: tiny has no second stage")
    assert "re-ranked score" not in out


@pytest.mark.slow
def test_recall_prints_the_served_and_evaluated_rows_and_they_agree(setup, capsys):
    """--recall: the first stage, re-ranked with K = 10, 50, 100 and train.eval.evaluate from the same cache; the flat
    index with K covering the 12 images re-ranks every image, so K=50 and K=100 equal the evaluation row in T2I."""
    rc, out, err = _run(capsys, [setup.adapter_index, "--recall"])
    assert rc == 0, err
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| |")}
    assert list(rows) == ["served, first stage", "served, re-ranked K=10", "served, re-ranked K=50",
                          "served, re-ranked K=100", "train.eval"]
    t2i = slice(0, 3)
    assert rows["served, re-ranked K=50"][t2i] == rows["served, re-ranked K=100"][t2i] == rows["train.eval"][t2i]
    assert all(0 <= v <= 100 for r in rows.values() for v in r)
    rc, out, err = _run(capsys, [setup.backbone_index, "--recall"])  # a bare backbone: no second stage
    assert rc == 0 and "re-ranked" not in out and "| served, first stage |" in out
    first, evaluated = (line.split("|")[2:] for line in out.splitlines()
                        if line.startswith(("| served, first stage", "| train.eval |")))
    assert first == evaluated
    # --live: every caption and image file encoded alone, as a user's query (served_recall(queries="live"))
    rc, live, err = _run(capsys, [setup.backbone_index, "--recall", "--live"])
    assert rc == 0, err
    assert "encoded alone as a user's" in live and "read from the cache" in out
    with pytest.raises(SystemExit) as e:  # --live belongs to --recall
        main([str(setup.backbone_index), QUERY, "--live"])
    assert e.value.code == 2 and "--live applies to --recall" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- bad input
def _bomb(path: Path) -> Path:
    Image.new("1", (12000, 12000)).save(path, "PNG")  # 144 Mpx from a few kB: refused from its header
    return path


BAD_QUERIES = [  # (argv after the index, the error's start or a fragment of it)
    (["   "], "error: bad query: empty query"),
    ([""], "error: bad query: empty query"),
    (["12 34"], "error: bad query: query has no letters"),
    (["a\x01b"], "error: bad query: binary data in query"),
    (["a" * 100_001], "error: query of 100,001 characters refused"),
    (["--image", "CORRUPT"], "corrupt or unrecognised image data"),
    (["--image", "NOT_AN_IMAGE"], "corrupt or unrecognised image data"),
    (["--image", "BOMB"], "decompression bomb"),
    (["--image", "MISSING"], "file not found"),
    (["--where", "image_id"], "expected COLUMN=VALUE"),
    ([QUERY, "--where", "colour=red"], "filter on 'colour'"),
    ([QUERY, "--model", "tiny"], "was built with tiny + comalign"),
    ([("a large red circle to the left of a small blue square " * 200)[:10_000]],
     "query of 10,000 characters refused: a search phrase has at most 2,000"),
    ([QUERY, "--k", "500"], "--k 500 is more than the 12 images in the collection: ask for at most --k 12"),
    (["--image", "CAPTIONED", "--k", "54"], "--k 54 is more than the 53 captions in the collection"),
    (["--vector", "ZERO.npy"], "a query vector with no direction"),
    (["--vector", "TINY.json"], "a query vector with no direction"),
    (["--vector", "HUGE.json"], "beyond float32's range"),
    (["--vector", "NAN.json"], "non-finite numbers"),
    (["--vector", "WORDS.json"], "a query vector is a list of numbers"),
    (["--vector", "PICKLE.npy"], "--vector"),
    (["--vector", "SHORT.json"], "a query vector of 3 numbers"),
    (["--vector", "GOOD.json", "--rerank", "5"], "--rerank needs a text or an image"),
]


WIDTH = 64  # the tiny test model's first-stage width (a wrong width is caught only once the index is open)
VECTORS = {"ZERO": np.zeros(WIDTH, np.float32), "TINY": [1e-30] * WIDTH, "HUGE": [1e308] * WIDTH,
           "NAN": [float("nan")] * WIDTH, "WORDS": ["a"] * WIDTH, "SHORT": [0.1, 0.2, 0.3], "GOOD": [0.1] * WIDTH,
           "PICKLE": np.asarray([{"a": 1}], dtype=object)}


def _vector_file(folder: Path, name: str) -> Path:
    stem, ext = name.split(".")
    path, value = folder / name, VECTORS[stem]
    if ext == "npy":
        np.save(path, value, allow_pickle=True)  # PICKLE: an object array, which the reader must refuse to unpickle
    else:
        path.write_text(json.dumps(value if isinstance(value, list) else value.tolist()).replace("NaN", "NaN"))
    return path


@pytest.mark.slow
def test_a_vector_searches_the_first_stage_of_either_side(setup, tmp_path, capsys):
    searcher = Searcher.open(setup.adapter_index)
    for side in ("image", "text"):
        stored = searcher.collection(side).index.reconstruct_n(0, searcher.collection(side).n)
        np.save(tmp_path / f"{side}.npy", stored[5])
        rc, out, err = _run(capsys, [setup.adapter_index, "--vector", tmp_path / f"{side}.npy", "--side", side,
                                     "--json", "--k", "3"])
        assert rc == 0, err
        hits = json.loads(out)["hits"]
        order = np.argsort(-(stored @ stored[5]), kind="stable")[:3]
        assert [h["row"] for h in hits] == order.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("argv,message", BAD_QUERIES, ids=[m[:28] for _, m in BAD_QUERIES])
def test_a_bad_query_is_one_error_line_and_exit_2(setup, tmp_path, capsys, argv, message):
    files = {"CORRUPT": b"\xff\xd8 this is not really a JPEG " * 8, "NOT_AN_IMAGE": b"filepath,title\na,b\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    _bomb(tmp_path / "BOMB")
    argv = [str(tmp_path / a) if a in ("CORRUPT", "NOT_AN_IMAGE", "BOMB", "MISSING") else a for a in argv]
    argv = [str(setup.world / "images" / "000008.png") if a == "CAPTIONED" else a for a in argv]
    argv = [str(_vector_file(tmp_path, a)) if a.split(".")[0] in VECTORS else a for a in argv]
    if argv[0] == "--where":
        argv = [QUERY] + argv
    before = _digest(setup.adapter_index)
    rc, out, err = _run(capsys, [setup.adapter_index, *argv])
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert _digest(setup.adapter_index) == before  # nothing written, nothing lost


@pytest.mark.slow
def test_flags_the_parser_refuses(setup, capsys):
    for argv, message in (([QUERY, "--k", "0"], "--k: expected an integer >= 1, got 0"),
                          ([QUERY, "--rerank", "-3"], "--rerank: expected an integer >= 1"),
                          ([QUERY, "--offset", "-1"], "--offset: expected an integer >= 0"),
                          ([], "give one of a text query, --image PATH or --vector PATH"),
                          ([QUERY, "--image", "x.png"], "give one of a text query, --image PATH or --vector PATH"),
                          ([QUERY, "--vector", "v.npy"], "give one of a text query, --image PATH or --vector PATH"),
                          ([QUERY, "--recall"], "--recall measures the index on its own collection")):
        with pytest.raises(SystemExit) as e:
            main([str(setup.adapter_index), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "usage:" not in err


@pytest.mark.slow
def test_a_query_past_the_text_context_is_noted_and_a_k_of_the_whole_collection_is_served(setup, capsys):
    rc, out, err = _run(capsys, [setup.adapter_index, QUERY, "--k", "12"])
    assert rc == 0 and len([line for line in out.splitlines()[2:] if not line.startswith("note:")]) == 12
    long = ("a large red circle to the left of a small blue square " * 200)[:1_500]
    rc, out, err = _run(capsys, [setup.adapter_index, long, "--k", "2"])
    assert rc == 0 and "note: the query (1,49" in out and "is longer than the model's 77-token text context" in out


def _tamper_manifest(folder: Path, change) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _cut(path: Path, sizes_fixed: bool = False) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    if sizes_fixed:
        _fix_sizes(path.parent)


def _fix_sizes(folder: Path) -> None:
    """Record the files' sizes and digests as they are now: a replaced file the manifest's checks cannot see, so
    what is tested is the check behind them."""
    from extract.models.weights import file_sha256

    def fix(m):
        m["files"].update({k: (folder / k).stat().st_size for k in m["files"]})
        m["digests"].update({k: file_sha256(folder / k) for k in m["digests"]})

    _tamper_manifest(folder, fix)


def _same_size_edit(path: Path) -> None:
    """Change one digit of the first image path in a metadata file: same size, another image named."""
    data = bytearray(path.read_bytes())
    at = data.index(b".png") - 1
    data[at] = ord("0") + (data[at] - ord("0") + 1) % 10
    path.write_bytes(bytes(data))


def _rewrite_table(path: Path, change) -> None:
    from serve.layout import read_table, write_table

    table = change(read_table(path).combine_chunks())
    path.unlink()  # the old file is memory-mapped by the table just read: write a new one, not into it
    write_table(table, path)
    _fix_sizes(path.parent)


def _cache_entry(manifest: dict, **change) -> None:
    for entry in (manifest["cache"], manifest["parts"][0]["cache"]):
        entry.update(change)


def _swap_cache_rows(table):
    import pyarrow as pa

    rows = table.column("cache_row").to_numpy().copy()
    rows[[0, 1]] = rows[[1, 0]]
    return table.set_column(table.column_names.index("cache_row"), "cache_row", pa.array(rows))


def _reverse_rows(table):
    import pyarrow as pa

    return table.set_column(0, "row", pa.array(table.column("row").to_numpy()[::-1].copy()))


BAD_INDEXES = {  # name -> (how the copy is damaged, the message's fragment)
    "missing": (lambda d: shutil.rmtree(d), "does not exist"),
    "half-written": (lambda d: (d / "manifest.json").unlink(), "is not a finished index: manifest.json is missing"),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{\"format\": "), "manifest.json is unreadable"),
    "another format": (lambda d: _tamper_manifest(d, lambda m: m.update(format="clip-retrieval")),
                       "is not a plugvlm index manifest"),
    "newer version": (lambda d: _tamper_manifest(d, lambda m: m.update(version=99)), "index format version 99"),
    "a key removed": (lambda d: _tamper_manifest(d, lambda m: m.pop("cache")), "lacks ['cache']"),
    "ntotal edited": (lambda d: _tamper_manifest(d, lambda m: m["indexes"]["image"].update(ntotal=11)),
                      "holds 12 vectors"),
    "fingerprint edited": (lambda d: _tamper_manifest(d, lambda m: m["model"].update(fingerprint="0" * 64)),
                           "fingerprint 0000000000000000"),
    "index cut": (lambda d: _cut(d / "image.index"), "image.index is "),
    "index cut, sizes fixed": (lambda d: _cut(d / "image.index", True), "image.index is not a readable FAISS index"),
    "index missing": (lambda d: (d / "text.index").unlink(), "text.index is missing"),
    "metadata cut": (lambda d: _cut(d / "text.arrow"), "text.arrow is "),
    "metadata cut, sizes fixed": (lambda d: _cut(d / "text.arrow", True),
                                  "text.arrow is not a readable Arrow table"),
    "metadata edited, same size": (lambda d: _same_size_edit(d / "image.arrow"),
                                   "image.arrow does not match the SHA-256"),
    "metadata rows reordered": (lambda d: _rewrite_table(d / "image.arrow", _reverse_rows),
                                "column 'row' is not 0..11 in order"),
    "cache rows swapped": (lambda d: _rewrite_table(d / "text.arrow", _swap_cache_rows),
                           "text.arrow's caption_id disagrees with the cache's at cache_row"),
    "stage-2 store cut": (lambda d: _cut(next(d.glob("image.stage2.*.npy"))), "image.stage2."),
    "a bit flipped in the index": (lambda d: flip_bit(d / "image.index", (d / "image.index").stat().st_size // 2),
                                   "image.index does not match the SHA-256"),
    "a block overwritten in a stage-2 array": (
        lambda d: overwrite_block(p := next(d.glob("image.stage2.*.npy")), p.stat().st_size // 2),
        "image.stage2."),
    "a file instead of the folder": (lambda d: (shutil.rmtree(d), d.write_text("not an index")),
                                     "is a file, not an index folder"),
    "cache moved": (lambda d: _tamper_manifest(d, lambda m: _cache_entry(m, path=str(d / "nowhere"))),
                    "the index's feature cache cannot be opened"),
    "another cache": (lambda d: _tamper_manifest(d, lambda m: _cache_entry(m, fingerprint="f" * 64)),
                      "the index was built from ffffffffffffffff"),
    "two caches named": (lambda d: _tamper_manifest(d, lambda m: m["cache"].update(fingerprint="f" * 64)),
                         "names two caches for its first part"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD_INDEXES))
def test_a_missing_half_written_or_tampered_index_is_one_error_line(setup, tmp_path, capsys, name):
    damage, message = BAD_INDEXES[name]
    folder = tmp_path / "index"
    shutil.copytree(setup.adapter_index, folder)
    damage(folder)
    after_damage = _digest(folder) if folder.exists() else None
    rc, out, err = _run(capsys, [folder, QUERY])
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert (_digest(folder) if folder.exists() else None) == after_damage  # the search side writes nothing


@pytest.mark.slow
def test_json_into_a_closed_pipe_ends_quietly(setup):
    """``python -m serve.query IDX "..." --json | head -1``: the reader is gone before the JSON is written; the
    process ends with 141 (as a tool that SIGPIPE ends) and says nothing (extract.common.cli.run_job)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PLUGVLM_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "serve.query", str(setup.adapter_index), QUERY, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    proc.stdout.close()  # before the model has loaded: the JSON meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141
    assert "error" not in err.decode() and "Traceback" not in err.decode() and "Exception ignored" not in err.decode()


@pytest.mark.slow
def test_debug_shows_the_traceback(setup, tmp_path):
    """The real process: exit status 2 and one line; --debug / PLUGVLM_DEBUG=1 give the traceback instead."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PLUGVLM_DEBUG", None)
    command = [sys.executable, "-m", "serve.query", str(tmp_path / "no-index"), QUERY]
    plain = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.startswith("error: ") and len(plain.stderr.splitlines()) == 1
    debug = subprocess.run(command + ["--debug"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "IndexDirError" in debug.stderr
    with pytest.raises(ValueError, match="does not exist"):  # in-process: the exception itself
        main([str(tmp_path / "no-index"), QUERY, "--debug"])
