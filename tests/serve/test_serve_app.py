"""serve.app (what the page does, without a browser) and python -m serve's start-up: the text -> image gallery with
both scores and rank changes, per-phrase heatmaps with ComAlign's boxes, image -> text from an upload or the
collection, the caption probe against the models' own scores, the about line's served R@k, bad input as one readable
message, the gate that bounds the work in flight, and the embedded default's index resolution.

The setup is the session's ComAlign index of the 12-image toy-world test split (tests/serve/test_serve_search.py).
"""
from __future__ import annotations

import dataclasses
import io
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serve.service import Busy, Gate, Limits, Served

from serve.app import gallery_items, hits_table, page_error, rank_change
from serve.search import QueryError, Searcher

QUERY = "a red circle to the left of a blue square"



def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------- text -> image
def test_the_gallery_shows_both_scores_and_how_re_ranking_moved_each_hit(served):
    hits = served.text_to_image(QUERY, k=5, rerank=12)
    reference = served.searcher.search_text(QUERY, k=5, rerank=12)
    assert [h.row for h in hits] == [h.row for h in reference] and hits.rerank == 12
    items = gallery_items(served, hits)
    assert len(items) == 5
    for (thumb, caption), h in zip(items, hits):
        assert caption.startswith(f"#{h.rank_after} {rank_change(h)} from #{h.rank_before}")
        assert f"re-ranked {h.rerank_score:.3f}" in caption and f"stage 1 {h.score:.3f}" in caption
        # a 64 px scene enlarged 4x, pixel for pixel
        original = np.asarray(Image.open(h.path).convert("RGB"))
        assert thumb.size == (256, 256) and np.array_equal(np.asarray(thumb)[::4, ::4], original)
    moved = {rank_change(h) for h in hits}
    assert moved - {"="}, "re-ranking 12 candidates moved none of the top 5: nothing to show"
    table = hits_table(hits)
    assert [row[0] for row in table["data"]] == [1, 2, 3, 4, 5]
    assert [row[1] for row in table["data"]] == [h.rank_before for h in hits]
    assert all(row[6] == h.metadata["captions"][0] for row, h in zip(table["data"], hits))
    assert rank_change(type("H", (), {"rank_before": 2, "rank_after": 5})) == "↓3"
    first = served.text_to_image(QUERY, k=3)
    assert first.rerank is None and "re-ranked" not in gallery_items(served, first)[0][1]


def test_a_hits_heatmap_has_one_map_per_phrase_and_comalign_explains_its_score(served):
    hits = served.text_to_image(QUERY, k=3, rerank=12)
    image = served.collection_image(hits[0].id)
    heat = served.heatmaps(image, QUERY, "raw")
    phrases = served.heatmapper.phrases(QUERY)
    assert [m.phrase for m in heat.maps] == [p for p, _ in phrases] and len(phrases) == 2
    labels = [label for _, label in heat.annotations]
    assert all(p in labels for p, _ in phrases)
    # one panel per phrase side by side (serve.heatmap_render): the 64 px scene enlarged 4x in each, outlines only
    from serve.heatmap_render import BAR, GAP, TITLE, TOP

    assert heat.image.size == (GAP + 2 * (256 + GAP), TOP + TITLE + 256 + BAR + GAP)
    assert all(m.shape == heat.image.size[::-1] and m.mean() < 0.05 for m, _ in heat.annotations)
    # ComAlign: each phrase's winning box is drawn, and the parts add up to the re-ranked score of this hit
    assert heat.explanation is not None and any(m.box is not None for m in heat.maps)
    assert heat.explanation.score == pytest.approx(hits[0].rerank_score, abs=2e-3)  # live vs cached fp16 arrays
    assert any("box" in label for label in labels)
    # the boxes drawn are the explanation's winners (one explained_maps pass), labelled with their component score
    winners = {(c.box, round(c.score, 6)) for c in heat.explanation.components if c.box is not None}
    for m in (m for m in heat.maps if m.box is not None):
        assert (m.box, round(m.box_score, 6)) in winners
        assert f"{m.phrase}: {m.box_kind} box, score {m.box_score:.3f}" in labels
    assert served.heatmaps(image, QUERY, explain=False).explanation is None  # the probe's maps: no explanation
    with pytest.raises(QueryError, match="unknown heatmap method"):
        served.heatmaps(image, QUERY, "gradcam")


def test_thumbnails_enlarge_small_images_by_a_whole_factor_and_keep_the_aspect():
    from serve.heatmap_render import fit

    image = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(6, 8).repeat(3).reshape(6, 8, 3))
    big = fit(image, 40)
    assert big.size == (40, 30) and np.array_equal(np.asarray(big)[::5, ::5], np.asarray(image))
    assert fit(Image.new("RGB", (1000, 500)), 256).size == (256, 128)


# --------------------------------------------------------------------------------------------- image -> text
def test_image_to_text_from_the_collection_or_an_upload_of_the_same_file(served, tmp_path, monkeypatch):
    monkeypatch.setattr(served, "upload_dir", str(tmp_path))  # tmp_path stands in for Gradio's upload folder
    image_id = served.image_ids()[3]
    picked = served.query_image(None, image_id)
    copy = tmp_path / Path(picked.name).name  # an upload keeps its file name: the adapter finds its boxes by it
    shutil.copyfile(picked.name, copy)
    from_collection = served.image_to_text(picked, k=5, rerank=20)
    from_upload = served.image_to_text(served.query_image(str(copy), image_id="ignored when an upload is given"), k=5,
                                       rerank=20)
    assert [h.row for h in from_collection] == [h.row for h in from_upload]
    np.testing.assert_allclose([h.rerank_score for h in from_collection], [h.rerank_score for h in from_upload],
                               atol=1e-5)
    reference = served.searcher.search_image(picked.name, k=5, rerank=20)
    assert [h.row for h in from_collection] == [h.row for h in reference]
    assert all(h.text for h in from_collection) and hits_table(from_collection)["data"][0][6] == from_collection[0].text


# --------------------------------------------------------------------------------------------- the probe
def test_the_probe_compares_base_and_adapter_with_their_own_scores(served, setup):
    from adapters.scoring import BackboneScorer

    example = served.examples[0]
    image = served.collection_image(example.image_id)
    probe = served.probe(image, example.positive, example.negative, "raw")
    assert [r["model"] for r in probe.rows] == [f"base: {served.base.name}", served.searcher.scorer.name]
    scorer = served.searcher.scorer
    base = BackboneScorer(scorer.backbone)
    with torch.no_grad():
        base_s = base.score(base.encode_images(base.preprocess(image.image)[None]),
                            base.encode_texts([example.positive, example.negative]))[0]
        own = scorer.score_directed(scorer.encode_pil([image.image], [image.name]),
                                    scorer.encode_texts([example.positive, example.negative]), "i2t")[0]
    for row, s in zip(probe.rows, (base_s, own)):
        assert (row["score_a"], row["score_b"]) == pytest.approx((float(s[0]), float(s[1])), abs=1e-5)
        assert row["prefers"] == ("A" if s[0] > s[1] else "B")
    assert probe.heat_a.maps and probe.heat_b.maps and not probe.notes
    with pytest.raises(QueryError, match="caption B"):
        served.probe(image, example.positive, "   ")
    bare = Served(Searcher.open(setup.backbone_index))
    alone = bare.probe(bare.collection_image(example.image_id), example.positive, example.negative,
                       with_heatmaps=False)
    assert len(alone.rows) == 1 and "bare backbone" in alone.notes[0] and bare.base is None


def test_probe_examples_are_the_worlds_hard_negatives_of_served_images(served, setup):
    items = json.loads((setup.world / "negatives.json").read_text())["items"]
    pairs = {(str(i["image_id"]), i["positive"], n["text"], n["type"]) for i in items for n in i["negatives"]}
    assert served.examples and all((e.image_id, e.positive, e.negative, e.type) in pairs for e in served.examples)
    assert {e.image_id for e in served.examples} <= set(served.image_ids())
    order = ["swap-att", "swap-obj", "replace-att", "replace-rel", "replace-obj", "add-obj"]
    types = [order.index(e.type) for e in served.examples]
    assert types == sorted(types) and max(types.count(t) for t in types) <= 2
    # a swap the served model gets right and one it gets wrong, each checked against the probe itself
    graded = [e for e in served.examples if e.type in ("swap-att", "swap-obj")]
    assert graded and all(e.verdict and e.verdict in e.label for e in graded)
    for e in graded:
        row = served.probe(served.collection_image(e.image_id), e.positive, e.negative, with_heatmaps=False).rows[-1]
        assert e.verdict == f"{served.searcher.scorer.name} {'right' if row['prefers'] == 'A' else 'wrong'}"
    assert {e.verdict.split()[-1] for e in graded} == {"right", "wrong"}


# --------------------------------------------------------------------------------------------- about
def test_the_about_line_names_the_model_the_index_and_its_served_recall(served):
    from serve.service import recall_text
    from serve.recall import served_recall

    recall = served.recall  # measured once when the shared app opened: measure_recall(searcher), K=50
    assert list(recall["rows"]) == ["first stage", "re-ranked K=50"] and recall["ks"] == [1, 5, 10]
    assert recall["rows"]["re-ranked K=50"] == served_recall(served.searcher, 50)
    line = served.about()
    assert served.searcher.scorer.name in line and "`Flat`" in line and "12 images, 53 captions" in line
    t2i = recall["rows"]["first stage"]["text_to_image"]
    assert f"text→image {t2i['R@1']:.1f}/{t2i['R@5']:.1f}/{t2i['R@10']:.1f}" in line
    i2t = recall["rows"]["re-ranked K=50"]["image_to_text"]
    assert f"image→text {i2t['R@1']:.1f}/{i2t['R@5']:.1f}/{i2t['R@10']:.1f}" in line
    unmeasured = Served(served.searcher).about()
    assert "not measured" in recall_text(None) and "not measured" in unmeasured and "R@1/5/10" not in unmeasured


# --------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_one_readable_message(served, tmp_path, monkeypatch):
    from fixtures.bad_inputs import BAD_IMAGES, encoded_images

    monkeypatch.setattr(served, "upload_dir", str(tmp_path))  # tmp_path stands in for Gradio's upload folder
    for query in ("", "   ", "1234", "\x00binary"):
        with pytest.raises(QueryError, match="bad query"):
            served.text_to_image(query)
    for k, rerank in ((0, None), (5, 0), (2000, None), (True, None), (float("inf"), None), (float("nan"), None),
                      (2.5, None), ("7", None), (None, None), (5, float("inf"))):
        with pytest.raises(QueryError, match="k|candidates"):
            served.text_to_image(QUERY, k, rerank)
    files = encoded_images()
    for name, reason in BAD_IMAGES.items():
        if name in files:
            (tmp_path / name).write_bytes(files[name])
        with pytest.raises(QueryError) as e:
            served.query_image(str(tmp_path / name))
        message = str(e.value)
        assert reason.split(":")[0] in message or "is gone" in message, (name, message)
        assert "\n" not in message
    big = tmp_path / "big.png"
    big.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(QueryError, match="more than the 65,536 an upload may have"):
        served.query_image(str(big))
    wide = tmp_path / "wide.png"
    wide.write_bytes(_png(Image.new("1", (2000, 600))))  # 1.2 Mpx, a few hundred bytes: above this app's limit
    with pytest.raises(QueryError, match="decompression bomb"):
        served.query_image(str(wide))
    for upload, image_id, match in ((None, None, "no image"), (None, "<img src=x>", "no image '<img")):
        with pytest.raises(QueryError, match=match):
            served.query_image(upload, image_id)


def test_only_files_of_the_upload_folder_are_read(served, setup, tmp_path, monkeypatch):
    """The page's upload reader takes a regular file inside the upload folder, named by its path: a file elsewhere,
    a link or ``..`` leading out, a folder and a URL are refused by name, before anything is opened."""
    folder = tmp_path / "uploads"
    folder.mkdir()
    monkeypatch.setattr(served, "upload_dir", str(folder))
    image = setup.world / "images" / "000000.png"
    inside = folder / "mine.png"
    shutil.copyfile(image, inside)
    assert served.query_image(str(inside)).image.size == Image.open(image).size
    (folder / "link.png").symlink_to(image)
    (folder / "sub").mkdir()
    for path in (str(image), "/etc/passwd", str(folder / "link.png"), str(folder / ".." / "uploads" / ".." /
                 "x.png"), str(folder / "sub" / ".." / ".." / "x.png"), "http://127.0.0.1:9/x.png",
                 "file:///etc/passwd"):
        with pytest.raises(QueryError, match="not uploaded to this server"):
            served.query_image(path)
    with pytest.raises(QueryError, match="not a file"):
        served.query_image(str(folder / "sub"))
    with pytest.raises(QueryError, match="is gone"):
        served.query_image(str(folder / "deleted.png"))
    # in the page the message is HTML-escaped: gradio renders it as HTML
    assert page_error(QueryError("no image '<img src=x onerror=alert(1)>'\nsecond line")) == \
        "no image &#x27;&lt;img src=x onerror=alert(1)&gt;&#x27;"
    assert len(served.text_to_image(QUERY, k=2)) == 2  # and it keeps serving


@pytest.mark.slow
def test_the_page_turns_refusals_into_gradio_errors():
    import gradio as gr

    from serve.app import _guard

    def refuse():
        raise QueryError("bad query: <b>empty</b>")

    def busy():
        raise Busy("the server is busy")

    def bug():
        raise KeyError("oops")

    for fn, text in ((refuse, "bad query: &lt;b&gt;empty&lt;/b&gt;"), (busy, "the server is busy"),
                     (bug, "internal error (KeyError)")):
        with pytest.raises(gr.Error) as e:
            _guard(fn)()
        assert text in e.value.message


def test_the_gate_bounds_work_in_flight_and_turns_the_rest_away():
    gate = Gate(concurrency=1, queue=1, wait_s=5)
    inside, release, waited = threading.Event(), threading.Event(), []

    def hold():
        with gate.hold():
            inside.set()
            release.wait(5)

    def wait():
        with gate.hold():
            waited.append(True)

    first = threading.Thread(target=hold)
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=wait)
    second.start()
    for _ in range(500):  # until the second caller is queued
        if gate._inside == 2:
            break
        threading.Event().wait(0.01)
    with pytest.raises(Busy, match="busy"):
        with gate.hold():
            pass
    assert gate.refused == 1 and not waited
    release.set()
    first.join(5)
    second.join(5)
    assert waited == [True] and gate._inside == 0
    slow = Gate(concurrency=1, queue=1, wait_s=0.05)  # a queued caller gives up after wait_s
    with slow.hold():
        with pytest.raises(Busy, match="waited"):
            with slow.hold():
                pass
    assert slow._inside == 0 and slow.refused == 1


def test_limits_are_checked():
    with pytest.raises(ValueError, match="concurrency"):
        Limits(concurrency=0)
    with pytest.raises(ValueError, match="queue"):
        Limits(queue=-1)


# --------------------------------------------------------------------------------------------- python -m serve
def test_the_default_index_is_the_demos_adapter_else_the_tiny_base(setup, tmp_path, monkeypatch):
    import serve.__main__ as main
    import serve.index as index

    built = []

    def fake_build(opts):
        built.append(opts)
        return json.loads((setup.adapter_index / "manifest.json").read_text())

    monkeypatch.setattr(index, "build_index", fake_build)
    monkeypatch.setattr(index, "default_out", lambda model: str(tmp_path / f"index-{model}"))
    monkeypatch.setattr(index, "with_defaults",  # without generating the 2000-scene default world
                        lambda opts: dataclasses.replace(opts, out=index.default_out(opts.model)))
    demo = tmp_path / "demo"
    demo.mkdir()
    # no report: the tiny base, built once, then reused
    assert main.default_index(demo=demo) == tmp_path / "index-tiny" and built[-1].model == "tiny"
    (tmp_path / "index-tiny").mkdir()
    (tmp_path / "index-tiny" / "manifest.json").write_text("{}")
    assert main.default_index(demo=demo) == tmp_path / "index-tiny" and len(built) == 1
    # the demo's report names its best adapter (validation T2I R@1): its index, built where the demo puts it
    report = {"adapters": {"methods": {
        "comalign": {"checkpoint": str(setup.run / "adapter.safetensors"), "val": {"retrieval T2I R@1": 30.0}},
        "smartclip": {"checkpoint": str(setup.run / "adapter.safetensors"), "val": {"retrieval T2I R@1": 10.0}}}}}
    (demo / "demo_report.json").write_text(json.dumps(report))
    assert main.demo_adapter(demo) == str(setup.run / "adapter.safetensors")
    # a report over several bases names the adapter it served; one whose checkpoint is gone names none
    served = {"served": {"checkpoint": str(setup.run / "adapter.safetensors")}, "adapters": {"toy-clip": {}}}
    (demo / "demo_report.json").write_text(json.dumps(served))
    assert main.demo_adapter(demo) == str(setup.run / "adapter.safetensors")
    (demo / "demo_report.json").write_text(json.dumps({"served": {"checkpoint": str(tmp_path / "gone")}}))
    assert main.demo_adapter(demo) is None
    (demo / "demo_report.json").write_text(json.dumps(report))
    assert main.default_index(demo=demo) == demo / "index"
    assert built[-1].model == str(setup.run / "adapter.safetensors") and built[-1].out == str(demo / "index")
    assert built[-1].data == str(demo / "toyworld") and built[-1].kind == "flat"
    (demo / "index").mkdir()
    (demo / "index" / "manifest.json").write_text("{}")
    assert main.default_index(demo=demo) == demo / "index" and len(built) == 2


def test_python_m_serve_refuses_bad_options_in_one_line(tmp_path, capsys):
    import serve.__main__ as main

    with pytest.raises(SystemExit) as e:
        main.parse_args(["--port", "70000"])
    assert e.value.code == 2 and "expected a port 0..65535, got 70000" in capsys.readouterr().err
    assert main.main(["--index", str(tmp_path / "no-such-index"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no-such-index" in err[0]
    assert main.is_loopback("127.0.0.1") and main.is_loopback("::1") and not main.is_loopback("0.0.0.0")
