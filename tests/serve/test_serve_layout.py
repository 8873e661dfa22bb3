"""serve.layout: reading an index directory back with every check (manifest, files, metadata lining up with the
index), each failure one IndexDirError naming the file; the model fingerprint; memory mapping; the lock, the atomic
swap and the repair of a swap killed half-way."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")
pytest.importorskip("pyarrow")

from extract.worlds.toyworld import generate  # noqa: E402
from extract.models.weights import file_sha256  # noqa: E402
from serve import layout  # noqa: E402
from serve.index import IndexOptions, build_index  # noqa: E402
from serve.layout import IndexBusyError, IndexDirError, ModelMismatchError  # noqa: E402

from fixtures.bad_inputs import INDEX_DAMAGE, blow_up_a_flat_vector  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One finished index (tiny backbone, the test split of a 60-scene toy world: 6 images, 24 captions)."""
    root = tmp_path_factory.mktemp("layout")
    generate(root / "toy", 60, 0, workers=1)
    build_index(IndexOptions(model="tiny", data=str(root / "toy"), out=str(root / "index"),
                             cache_dir=str(root / "cache"), workers=0))
    return root / "index"


@pytest.fixture
def index(built, tmp_path) -> Path:
    """A private copy of the finished index, to damage."""
    return Path(shutil.copytree(built, tmp_path / "index"))


def edit_manifest(index: Path, change) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    change(manifest)
    (index / "manifest.json").write_text(json.dumps(manifest))


def test_a_finished_index_reads_back_whole(index):
    manifest = layout.read_manifest(index)
    assert layout.check_alignment(index) == manifest
    assert set(manifest["indexes"]) == {"image", "text"}
    assert manifest["collection"] == {"images": 6, "captions": 24}
    for side, rows in (("image", 6), ("text", 24)):
        assert layout.open_index(index, side).ntotal == rows
        table = layout.read_metadata(index, side)
        assert table.column_names == list(layout.IMAGE_COLUMNS if side == "image" else layout.TEXT_COLUMNS)
        assert table.column("row").to_pylist() == list(range(rows))
    assert set(manifest["files"]) == {"image.index", "image.arrow", "text.index", "text.arrow"}


def test_a_version_1_index_with_parquet_metadata_still_opens(index):
    """Indices built before format version 2 keep their metadata in parquet: read and searched as before."""
    import pyarrow.parquet as pq

    from serve.search import Searcher

    want = Searcher.open(index).search_text("a red circle", k=3)
    for side in ("image", "text"):
        table = layout.read_table(index / f"{side}.arrow").combine_chunks()
        pq.write_table(table, index / f"{side}.parquet")
        (index / f"{side}.arrow").unlink()

    def to_v1(m):
        m["version"] = 1
        m.pop("digests")  # recorded since; a manifest without them is still read (sizes checked only)
        for side in ("image", "text"):
            m["indexes"][side]["metadata"] = f"{side}.parquet"
            m["files"].pop(f"{side}.arrow")
            m["files"][f"{side}.parquet"] = (index / f"{side}.parquet").stat().st_size
    edit_manifest(index, to_v1)
    assert layout.check_alignment(index)["version"] == 1
    got = Searcher.open(index).search_text("a red circle", k=3)
    assert [(h.row, h.metadata) for h in got] == [(h.row, h.metadata) for h in want]


@pytest.mark.parametrize("damage,message", [
    (lambda p: shutil.rmtree(p), "does not exist"),
    (lambda p: (p / "manifest.json").unlink(), "not a finished index: manifest.json is missing"),
    (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
    (lambda p: edit_manifest(p, lambda m: m.update(format="something-else")), "not a plugvlm index manifest"),
    (lambda p: edit_manifest(p, lambda m: m.update(version=99)), "version 99"),
    (lambda p: edit_manifest(p, lambda m: m.pop("collection")), "lacks ['collection']"),
    (lambda p: edit_manifest(p, lambda m: m["indexes"]["text"].pop("ntotal")), "indexes.text lacks ['ntotal']"),
    (lambda p: (p / "text.index").unlink(), "text.index is missing"),
    (lambda p: os.truncate(p / "image.arrow", 100), "image.arrow is 100 bytes"),
])
def test_a_damaged_index_is_refused_naming_the_file(index, damage, message):
    damage(index)
    with pytest.raises(IndexDirError) as e:
        layout.read_manifest(index)
    assert message in str(e.value) and "\n" not in str(e.value)


def _replace_table(index: Path, side: str, table) -> None:
    """Swap a side's metadata for ``table`` and record its size and digest, as a hand-made "fix" of a metadata file
    would: only the row checks can catch it then."""
    path = index / f"{side}.arrow"
    table = table.combine_chunks()
    path.unlink()  # ``table`` may be memory-mapped from it
    layout.write_table(table, path)

    def record(m):
        m["files"][f"{side}.arrow"] = path.stat().st_size
        m["digests"][f"{side}.arrow"] = file_sha256(path)

    edit_manifest(index, record)


def test_a_metadata_file_edited_to_the_same_size_is_refused(index):
    """An edit that keeps the size (one image path changed to another) passes the size check; the digest sees it."""
    path = index / "image.arrow"
    data = bytearray(path.read_bytes())
    at = data.index(b".png") - 1
    data[at] = ord("0") + (data[at] - ord("0") + 1) % 10
    path.write_bytes(bytes(data))
    with pytest.raises(IndexDirError, match=r"image\.arrow does not match the SHA-256 .*manifest\.json recorded"):
        layout.read_manifest(index)


@pytest.mark.parametrize("how", sorted(INDEX_DAMAGE))
@pytest.mark.parametrize("name", ["image.index", "text.index", "image.arrow", "text.arrow"])
def test_any_damaged_file_is_refused_at_open_and_named_by_verify(index, name, how, capsys):
    """A flipped bit or an overwritten block in any file of an index (each under VERIFY_AT_OPEN_BYTES here): the
    open refuses it, naming the file, before a search could rank anything; --verify names it too."""
    from serve.index import main as index_main
    from serve.search import Searcher

    INDEX_DAMAGE[how](index / name)
    with pytest.raises(IndexDirError, match=rf"{name.replace('.', '[.]')} does not match the SHA-256"):
        Searcher.open(index)
    assert index_main(["--verify", str(index)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{name} does not match the SHA-256" in err and err.count("\n") == 1


def test_a_large_damaged_file_gives_an_error_at_query_time_never_a_ranked_hit(index, monkeypatch, capsys):
    """Files above VERIFY_AT_OPEN_BYTES are not hashed at open (at 1M vectors that would take seconds): a damaged
    one is caught by the bound on every score it gives, and by --verify."""
    from serve.index import main as index_main
    from serve.search import Searcher

    monkeypatch.setattr(layout, "VERIFY_AT_OPEN_BYTES", 0)  # as if every index file were large
    d = layout.read_manifest(index)["model"]["first_stage_dim"]
    for side, query in (("image", "a red circle"), ("text", None)):
        blow_up_a_flat_vector(index / f"{side}.index", d, from_end=1 + (side == "text"))
    searcher = Searcher.open(index)  # the metadata is whole; the index files are not hashed
    with pytest.raises(IndexDirError, match=r"image[.]index scored row 5 .*outside the .*damaged; python -m "
                                            r"serve[.]index --verify"):
        searcher.search_text("a red circle", k=6)
    with pytest.raises(IndexDirError, match=r"text[.]index scored row 22 .*damaged"):
        searcher.search_image(searcher.collection("image").column("path")[0], k=24)
    assert index_main(["--verify", str(index)]) == 2
    assert "image.index does not match the SHA-256" in capsys.readouterr().err


def test_a_refined_index_searches_exactly_and_its_vectors_are_checked(built, tmp_path, monkeypatch):
    """--refine on: the fp16 vectors beside the index (image.refine.npy, memory-mapped) re-score the shortlist, so
    hits carry their exact scores; the file is listed, digested and checked like every other."""
    from serve.search import Searcher

    out = tmp_path / "refined"
    build_index(IndexOptions(model="tiny", data=str(built.parent / "toy"), out=str(out), kind="hnsw", refine="on",
                             cache_dir=str(built.parent / "cache"), workers=0))
    manifest = layout.read_manifest(out)
    entry = manifest["indexes"]["image"]
    assert entry["refine"]["file"] == "image.refine.npy" and "image.refine.npy" in manifest["digests"]
    assert "k_factor" in entry["params"]
    searcher = Searcher.open(out)
    vectors = np.load(out / "image.refine.npy").astype(np.float32)
    scorer = searcher.scorer
    query = scorer.first_stage_text(scorer.encode_texts(["a red circle"]), "t2i").numpy()[0]
    hits = searcher.search_text("a red circle", k=6)
    exact = vectors @ query
    assert [h.row for h in hits] == np.lexsort((np.arange(6), -exact.astype(np.float64))).tolist()
    np.testing.assert_allclose([h.score for h in hits], np.sort(exact)[::-1], rtol=1e-5)
    monkeypatch.setattr(layout, "VERIFY_AT_OPEN_BYTES", 0)  # as if it were large: checked by the score bound
    blown = np.load(out / "image.refine.npy")
    blown[2, 0] = np.float16(60000.0)
    np.save(out / "image.refine.npy", blown)
    with pytest.raises(IndexDirError, match=r"image[.]index [(]re-scored from .*image[.]refine[.]npy[)] scored "
                                            r"row 2 .*damaged"):
        Searcher.open(out).search_text("a red circle", k=6)


def test_verify_reads_every_file_and_says_so(index, capsys):
    from serve.index import main as index_main

    assert index_main(["--verify", str(index)]) == 0
    out = capsys.readouterr()
    names = sorted(layout.read_manifest(index)["files"])
    assert all(f"  {n}: " in out.err + out.out for n in names)
    assert f"{index}: {len(names)} files match the SHA-256 their build recorded" in out.out
    with pytest.raises(SystemExit) as e:
        index_main(["--verify", str(index), "--model", "tiny"])
    assert e.value.code == 2 and "--verify checks an index that exists; it takes no --model" in capsys.readouterr().err
    assert index_main(["--verify", str(index / "manifest.json")]) == 2
    assert "is a file, not an index folder" in capsys.readouterr().err


def test_metadata_that_does_not_line_up_with_the_index_is_refused(index):
    table = layout.read_metadata(index, "text")
    _replace_table(index, "text", table.slice(0, 20))
    layout.read_manifest(index)  # the files are whole: only the counts disagree
    for check in (lambda: layout.check_alignment(index), lambda: layout.open_index(index, "text"),
                  lambda: layout.read_metadata(index, "text")):
        with pytest.raises(IndexDirError, match=r"text\.arrow has 20 rows"):
            check()
    layout.open_index(index, "image")  # the other side is fine


def test_rows_out_of_order_and_a_tampered_count_are_refused(index):
    import pyarrow as pa

    table = layout.read_metadata(index, "image")
    rows = table.column("row").to_pylist()[::-1]
    _replace_table(index, "image", table.set_column(0, "row", pa.array(rows, pa.int64())))
    with pytest.raises(IndexDirError, match=r"column 'row' is not 0\.\.5 in order"):
        layout.read_metadata(index, "image")
    edit_manifest(index, lambda m: m["indexes"]["text"].update(ntotal=25))
    with pytest.raises(IndexDirError, match=r"text\.index holds 24 vectors, .*manifest\.json says 25"):
        layout.open_index(index, "text")
    with pytest.raises(IndexDirError, match="do not line up"):
        layout.check_alignment(index)


def test_memory_mapped_and_loaded_indices_search_alike(index):
    loaded, mapped = layout.open_index(index, "text", mmap=False), layout.open_index(index, "text", mmap=True)
    q = loaded.reconstruct_n(0, 5)
    np.testing.assert_array_equal(loaded.search(q, 7)[1], mapped.search(q, 7)[1])


def test_model_fingerprint_names_the_weights_not_their_place(tmp_path, index):
    import torch
    from safetensors.torch import save_file

    from adapters.load import load_scorer

    tiny = load_scorer("tiny")
    manifest = layout.read_manifest(index)
    assert layout.model_fingerprint(tiny) == manifest["model"]["fingerprint"]
    layout.check_model(manifest, layout.model_fingerprint(tiny), tiny.name)
    state = {k: v.contiguous() for k, v in tiny.backbone.model.state_dict().items()}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(state, str(tmp_path / "a" / "w.safetensors"))
    shutil.copy(tmp_path / "a" / "w.safetensors", tmp_path / "b" / "w.safetensors")
    here = layout.model_fingerprint(load_scorer("tiny", str(tmp_path / "a" / "w.safetensors")))
    moved = layout.model_fingerprint(load_scorer("tiny", str(tmp_path / "b" / "w.safetensors")))
    assert here == moved
    state["logit_scale"] = state["logit_scale"] + torch.tensor(1.0)
    save_file(state, str(tmp_path / "b" / "w.safetensors"))
    other = load_scorer("tiny", str(tmp_path / "b" / "w.safetensors"))
    assert layout.model_fingerprint(other) != here
    with pytest.raises(ModelMismatchError, match=r"built with tiny \(tiny, fingerprint .*\), not tiny:"):
        layout.check_model(manifest, layout.model_fingerprint(other), "tiny:" + str(tmp_path / "b"))


def test_a_side_without_an_index_says_so(index):
    manifest = layout.read_manifest(index)
    del manifest["indexes"]["text"]
    with pytest.raises(IndexDirError, match="has no text index"):
        layout.open_index(index, "text", manifest)


def test_the_build_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    target = tmp_path / "idx"
    with layout.build_lock(target):
        with pytest.raises(IndexBusyError, match=rf"{target} is being built by another run \(.*pid {os.getpid()} "):
            with layout.build_lock(target):
                pass
    with layout.build_lock(target):  # released on exit, and its file removed
        assert layout.lock_path(target).is_file()
    assert not layout.lock_path(target).exists()
    # a holder killed with -9: the kernel dropped its lock, the next build takes it
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from serve import layout\n"
                              "with layout.build_lock(sys.argv[1]):\n print('held', flush=True); time.sleep(60)",
                              str(target)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(IndexBusyError, match=f"pid {child.pid} "):
            with layout.build_lock(target):
                pass
    finally:
        child.kill()
        child.wait()
    with layout.build_lock(target):
        pass


@pytest.mark.parametrize("exchange", [True, False])
def test_commit_swaps_a_new_folder_in_and_the_old_one_out(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    final = tmp_path / "idx"
    for content in ("first", "second"):
        work = layout.BuildDir(final)
        (work.path / "payload").write_text(content)
        work.commit()
        assert (final / "payload").read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no temporary or old folder left


def test_a_swap_killed_half_way_is_repaired_by_the_next_reader(index):
    aside = index.with_name(index.name + ".old-12345")
    index.rename(aside)  # what a two-rename swap killed between its renames leaves
    manifest = layout.read_manifest(index)
    assert manifest["collection"]["images"] == 6 and index.is_dir() and not aside.exists()


def test_only_an_index_folder_is_ever_replaced(tmp_path, index):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    with pytest.raises(IndexDirError, match="is not a plugvlm index"):
        layout.check_replaceable(tmp_path / "mine")
    (tmp_path / "empty").mkdir()
    layout.check_replaceable(tmp_path / "empty")
    layout.check_replaceable(index)
    layout.check_replaceable(tmp_path / "absent")


def test_leftovers_of_killed_builds_are_removed_only_when_safe(tmp_path):
    final = tmp_path / "idx"
    (tmp_path / "idx.tmp-1").mkdir()
    (tmp_path / "idx.old-2").mkdir()
    assert layout.remove_leftovers(final) == ["idx.tmp-1"]  # no index: the old folder may be needed back
    final.mkdir()
    assert layout.remove_leftovers(final) == ["idx.old-2"]
