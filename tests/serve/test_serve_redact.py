"""serve.redact: no answer of ``python -m serve`` names a path of the server (issue 68). Every route of the JSON API
and every event of the page's Gradio API, asked a spread of requests (text, uploads the model has boxes for and
none for, with and without re-ranking, heatmaps, the caption probe, metadata, a collection file gone since indexing,
refused requests), is scanned for the server's folders, gathered from the server's own objects; and the
Redactor's rules on their own.

The setup is the session's ComAlign index of the 12-image toy-world test split (tests/fixtures/serve.py), a model
that reads ground-truth boxes: an upload the toy world does not name gets a note about its boxes.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import requests

from fixtures.serve import QUERY
from serve.redact import Redactor, server_paths, source_name


# --------------------------------------------------------------------------------------------- what no answer holds
def forbidden(served) -> dict[str, str]:
    """label -> a string no answer may hold, from the server's own objects: the index folder and each folder above
    it, the data, cache and model folders of its manifest, the box file, a collection image, the working, temporary
    and home folders; and their relative forms (relative to the working directory, and each one's last two
    components: "adapter-toy/world", the shape of a "runs/demo/toyworld" a message could hold)."""
    searcher = served.searcher
    m = searcher.manifest
    index = Path(searcher.index_dir).resolve()
    folders = {"index": index, "data": m["data"]["spec"], "cache": m["cache"]["path"], "model": m["model"]["model"],
               "box file": searcher.scorer.extractor.boxes.source,
               "collection image": searcher.collection("image").column("path")[0]}
    out = {label: str(Path(p).resolve()) for label, p in folders.items()}
    out.update({f"index parent {k}": str(p) for k, p in enumerate(index.parents) if str(p) != index.anchor})
    out.update({"cwd": os.getcwd(), "temp": tempfile.gettempdir(), "home": os.path.expanduser("~")})
    for label, p in folders.items():
        path = Path(p).resolve()
        out[f"{label}, last two parts"] = f"{path.parent.name}/{path.name}"
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            out[f"{label}, relative"] = relative
    return {k: v for k, v in out.items() if len(v) > 1}  # a home of "/" says nothing


def without_gradio_files(value, folder: str):
    """``value`` with Gradio's own file handles (a FileData of an output picture, a path its upload route answered)
    replaced by "<gradio file>", each checked to name a file of Gradio's upload folder and nothing else of the
    server (serve.redact's module docstring: they are how a client fetches pictures)."""
    def inside(path) -> bool:
        return isinstance(path, str) and os.path.commonpath([folder, os.path.realpath(path)]) == folder

    if isinstance(value, dict):
        if (value.get("meta") or {}).get("_type") == "gradio.FileData":
            assert inside(value.get("path")) and f"/file={value['path']}" in value.get("url", ""), value
            return "<gradio file>"
        return {k: without_gradio_files(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [without_gradio_files(v, folder) for v in value]
    return value


class Answers:
    """Every answer a test collected: (what was asked, its status line, headers and body as text)."""

    def __init__(self, server, folder: str):
        self.server, self.folder, self.items = server, folder, []

    def keep(self, label: str, response: requests.Response, body: str | None = None) -> requests.Response:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("date", "content-length")}
        self.items.append((label, f"{response.status_code}\n{json.dumps(headers)}\n"
                                  f"{response.text if body is None else body}"))
        return response

    def get(self, route: str) -> requests.Response:
        return self.keep(f"GET /{route}", requests.get(self.server.url + route, timeout=60))

    def post(self, route: str, body) -> requests.Response:
        data = body if isinstance(body, str) else json.dumps(body)
        return self.keep(f"POST /{route} {str(body)[:60]}", requests.post(self.server.url + route, data=data,
                                                                           timeout=60))

    def upload(self, path: Path, name: str) -> dict:
        """Gradio's upload route; the FileData a client sends back for it."""
        with open(path, "rb") as f:
            response = requests.post(self.server.url + "gradio_api/upload", files={"files": (name, f)}, timeout=60)
        handles = response.json()
        self.keep(f"upload {name}", response, json.dumps(without_gradio_files(
            [{"path": h, "url": f"/file={h}", "meta": {"_type": "gradio.FileData"}} for h in handles], self.folder)))
        return {"path": handles[0], "meta": {"_type": "gradio.FileData"}}

    def call(self, api_name: str, *data) -> str:
        """One event of the page's Gradio API, through its REST routes (what gradio_client does); the event stream
        as text, Gradio's file handles taken out."""
        started = requests.post(self.server.url + f"gradio_api/call/{api_name}", json={"data": list(data)},
                                timeout=60)
        self.keep(f"call {api_name}", started)
        stream = requests.get(self.server.url + f"gradio_api/call/{api_name}/{started.json()['event_id']}",
                              timeout=120)
        lines = []
        for line in stream.text.splitlines():
            if line.startswith("data: ") and line[6:] not in ("null", ""):
                line = "data: " + json.dumps(without_gradio_files(json.loads(line[6:]), self.folder))
            lines.append(line)
        text = "\n".join(lines)
        self.keep(f"call {api_name} {str(data)[:80]}", stream, text)
        return text


@pytest.mark.slow
def test_no_answer_of_either_api_names_a_path_of_the_server(server, served, setup, tmp_path, monkeypatch):
    from serve.request_guard import upload_folder

    answers = Answers(server, upload_folder())
    images = served.searcher.collection("image")
    known = Path(str(images.column("path")[2]))  # a collection file: the toy world names it (its boxes are known)
    unknown = tmp_path / "holiday.png"  # the same pixels under a name the toy world does not know: no boxes
    unknown.write_bytes(known.read_bytes())
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("this is text, not an image")
    encoded = base64.b64encode(known.read_bytes()).decode()
    example = served.examples[0]
    first_id = served.image_ids(1)[0]

    # the JSON API: clip-retrieval's routes and ours, good requests and refused ones
    for body in ({"text": QUERY, "num_images": 4, "rerank": True, "k_candidates": 12},
                 {"text": QUERY, "modality": "text", "num_images": 3, "deduplicate": True},
                 {"image": encoded, "modality": "text", "num_images": 3, "rerank": True},  # no boxes: box_note
                 {"image": encoded, "modality": "image", "num_images": 3},  # images like it: box_note too
                 {"image": "data:image/png;base64," + encoded, "modality": "text", "num_images": 2},
                 {"text": QUERY, "num_images": 2, "where": {"image_id": first_id}, "offset": 0},
                 {"text": QUERY, "num_images": 12, "offset": 11, "use_safety_model": True},
                 {"embedding_input": [1.0] * served.searcher.collection("image").index.d, "num_images": 2},
                 # refused
                 {"image_url": "http://example.com/x.png"}, {"text": QUERY, "num_imgs": 3},
                 {"text": QUERY, "indice_name": "elsewhere"}, {"text": QUERY, "modality": "video"},
                 {"image": "***"}, {"image": base64.b64encode(b"not an image").decode()},
                 {"embedding_input": [1.0, 2.0]}, {"text": "   "}, {"text": QUERY, "where": {"colour": "red"}},
                 "not json"):
        answers.post("knn-service", body)
    shown = answers.post("knn-service", {"text": QUERY, "num_images": 1, "return_image": True})
    results = shown.json()
    picture = base64.b64decode(results[0].pop("image"))
    assert picture == open(served.searcher.search_text(QUERY, k=1)[0].path, "rb").read()
    answers.items[-1] = (answers.items[-1][0], json.dumps(results))  # the file's bytes are no text to scan
    for body in ({"ids": [0, 5]}, {"ids": [1, 2], "modality": "text"}, {"ids": [99]}, {"ids": "all"}):
        answers.post("metadata", body)
    for route in ("indices-list", "health", "images/99", "images/x", "config", "gradio_api/info"):
        answers.get(route)

    # the page's Gradio API: every named event, with a known upload, an unknown one and a collection image
    known_file, unknown_file = answers.upload(known, known.name), answers.upload(unknown, unknown.name)
    bad_file = answers.upload(not_an_image, not_an_image.name)
    answers.call("about")
    answers.call("text_to_image", QUERY, 3, True, 12)
    answers.call("heatmap", first_id, QUERY, "raw")
    for upload, image_id in ((known_file, None), (unknown_file, None), (None, first_id)):
        answers.call("image_to_text", upload, image_id, 3, True, 12)
        answers.call("caption_heatmap", upload, image_id, QUERY, "surgery")
    answers.call("caption_probe", unknown_file, None, example.positive, example.negative, "raw")
    answers.call("caption_probe", None, example.image_id, example.positive, example.negative, "raw")
    errors = [answers.call("text_to_image", "   ", 3, True, 12), answers.call("heatmap", "no-such-id", QUERY, "raw"),
              answers.call("image_to_text", bad_file, None, 3, False, 10),
              answers.call("caption_probe", None, first_id, "", example.negative, "raw")]
    assert all("event: error" in e for e in errors), errors

    # a collection whose files are gone since indexing (moved, a disk unmounted): the readers' errors name the
    # file, with the server's folders in it
    gone = str(Path(str(known)).parent / "moved-away.png")
    original = images.column("path")
    with monkeypatch.context() as m:
        m.setattr(images, "column", lambda name, _c=images.column: np.array([gone] * len(original), dtype=object)
                  if name == "path" else _c(name))
        missing = answers.call("heatmap", first_id, QUERY, "raw")
        assert "event: error" in missing and "file not found" in missing, missing
        failed = answers.post("knn-service", {"text": QUERY, "modality": "text", "num_images": 2,
                                              "return_image": True})
        assert failed.status_code == 400 and "moved-away.png" in failed.json()["error"], failed.text

    # not vacuous: the answers hold what a leak would be in (the box note, the readers' errors, tables, notes)
    texts = "\n".join(text for _, text in answers.items)
    assert "reads ground-truth boxes and has none for this image" in texts and "holiday.png" in texts
    assert "file not found" in texts and "stage-1 score" in texts and len(answers.items) >= 50
    secret = forbidden(served)
    assert len(secret) >= 15 and "data, last two parts" in secret
    leaks = [(label, name, text[max(0, text.find(s) - 120):text.find(s) + 120])
             for label, text in answers.items for name, s in secret.items() if s in text]
    assert not leaks, "\n\n".join(f"{label}: holds the {name}: ...{excerpt}..." for label, name, excerpt in leaks[:8])
    assert "'world' (toy world) holds no entry for 'query'" in texts  # the box file by its name alone


def test_show_paths_lets_answers_name_the_servers_files(served):
    """--show-paths (Limits.show_paths): the operator asked for the layout; answers are left as written."""
    path = str(served.searcher.collection("image").column("path")[0])
    message = f"collection image 1: file not found: {path}"
    assert served.public(message) == f"collection image 1: file not found: {Path(path).name}"
    original = served.limits
    served.limits = dataclasses.replace(original, show_paths=True)
    try:
        assert served.public({"error": message}) == {"error": message}
    finally:
        served.limits = original


# --------------------------------------------------------------------------------------------- the rules
def test_the_redactor_keeps_names_and_drops_folders():
    r = Redactor(["runs/demo/index", "/srv/My Data/world", None], cwd="/home/ann/proj")
    cases = {
        # absolute paths, known or not, become their last part
        "/home/ann/proj/runs/demo/toyworld (toy world) holds no entry for 'query'":
            "toyworld (toy world) holds no entry for 'query'",
        "[Errno 2] No such file or directory: '/data/coco/val2017/0001.jpg'":
            "[Errno 2] No such file or directory: '0001.jpg'",
        "the cache /tmp/x/cache/d3ac69/ lacks arrays": "the cache d3ac69 lacks arrays",
        "C:\\Users\\ann\\boxes.json (COCO instances)": "boxes.json (COCO instances)",
        # the server's own folders in relative form, as typed or relative to the working directory
        "runs/demo/index/manifest.json is missing": "manifest.json is missing",
        "index ./runs/demo/index has no text.index": "index index has no text.index",
        "'/srv/My Data/world/images/a.png'": "'a.png'",  # a known folder with a space in its name, whole
        # not paths: left as they are
        "url http://127.0.0.1:7860/images/3 and /knn-service": "url http://127.0.0.1:7860/images/3 and /knn-service",
        "text→image 11.3/47.2/83.0, left/right, and/or": "text→image 11.3/47.2/83.0, left/right, and/or",
        "runs/demo/indexes and index": "runs/demo/indexes and index",
    }
    for text, expected in cases.items():
        assert r.text(text) == expected, text
    # data: texts anywhere in it, and the base64 of a file (a JPEG's starts with "/9j/") left alone
    value = {"image": "/9j/4AAQSkZJRg/abc", "notes": ["/a/b/c.png", ("/d/e", 3)], "n": 1.5}
    assert r.value(value) == {"image": "/9j/4AAQSkZJRg/abc", "notes": ["c.png", ("e", 3)], "n": 1.5}
    assert source_name("/srv/data/toyworld/") == "toyworld" and source_name("query") == "query"


def test_the_server_paths_come_from_the_manifest_and_the_scorer(served):
    found = {str(p) for p in server_paths(served.searcher)}
    m = served.searcher.manifest
    assert {m["data"]["spec"], m["cache"]["path"], m["model"]["model"], str(served.searcher.index_dir),
            str(served.searcher.scorer.extractor.boxes.source)} <= found
    assert not any(p.startswith(("plugvlm-index", "Flat")) for p in found)  # names in it are not paths
