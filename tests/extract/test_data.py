"""Every data source on one corpus of good and bad images and captions.

The same images and captions are written as CSV, TSV, COCO JSON, webdataset shards and a toy world
folder. Each caption names its image ("good_a: ..."), and the expected samples are compared exactly
(image id -> (caption id, text) in order), so a caption attached to the wrong image, a lost caption
or a shifted pairing fails the test. Every refusal is checked with its kind, id, location and reason.
"""
from __future__ import annotations

import csv
import io
import json
import math
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from extract.data.sources import (
    COCOSource,
    CSVSource,
    ImageFolderSource,
    Item,
    SampleDataset,
    SkipReport,
    ToyWorldSource,
    WebDatasetSource,
    collate_skipping,
    expand_shards,
    open_source,
)

# --------------------------------------------------------------------------- the corpus

# image name -> (reason it is skipped, note when it is converted)
IMAGE_OUTCOME = {
    "good_a.jpg": (None, None),
    "good_b.png": (None, None),
    "cmyk.jpg": (None, "CMYK converted to RGB"),
    "gray16.png": (None, "16-bit grayscale scaled to 8-bit"),
    "palette.png": (None, "palette transparency composited on white"),
    "only_bad.png": ("no valid caption", None),
    "corrupt.jpg": ("corrupt or unrecognised image data", None),
    "cut_jpeg.jpg": ("truncated image data", None),
    "cut_png.png": ("truncated image data", None),
    "empty.jpg": ("empty file", None),
    "bomb.png": ("decompression bomb", None),
    "missing.jpg": ("file not found", None),
}

# (image name, raw caption, reason it is refused); images are listed in first-appearance order
CAPTIONS = [
    ("good_a.jpg", "good_a: a red square", None),
    ("good_b.png", "good_b: a blue circle", None),
    ("good_a.jpg", "good_a: a square,\nred all over", None),  # separator and newline: a quoted record
    ("good_b.png", "", "empty caption"),
    ("good_b.png", "   ", "empty caption"),
    ("good_b.png", "good_b \x00\x01\x02", "binary data in caption"),
    ("good_b.png", "12 34", "caption has no letters"),
    ("good_b.png", math.nan, "caption is not text"),  # JSON only, as are the next two
    ("good_b.png", 7, "caption is not text"),
    ("good_b.png", None, "caption is not text"),
    ("good_a.jpg", "  good_a: third, after the others ", None),
    ("cmyk.jpg", "cmyk: a red photo", None),
    ("gray16.png", "gray16: a grey ramp", None),
    ("palette.png", "palette: a blue dot on white", None),
    ("only_bad.png", "1, 2, 3", "caption has no letters"),
    ("only_bad.png", "\t", "empty caption"),
    ("corrupt.jpg", "corrupt: never seen", None),
    ("cut_jpeg.jpg", "cut_jpeg: never seen", None),
    ("cut_png.png", "cut_png: never seen", None),
    ("empty.jpg", "empty: never seen", None),
    ("bomb.png", "bomb: never seen", None),
    ("missing.jpg", "missing: never seen", None),
]
TEXT_CAPTIONS = [c for c in CAPTIONS if isinstance(c[1], str)]  # what a CSV cell can hold
NAMES = list(dict.fromkeys(name for name, _, _ in CAPTIONS))


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    """Encoded bytes of every image except ``missing.jpg``."""
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    jpeg, png = encode(noise, "JPEG"), encode(noise, "PNG")
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.putpixel((4, 4), 1)
    return {
        "good_a.jpg": encode(Image.new("RGB", (16, 12), (200, 0, 0)), "JPEG"),
        "good_b.png": encode(Image.new("RGB", (12, 16), (0, 0, 200)), "PNG"),
        "cmyk.jpg": encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"),
        "gray16.png": encode(Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)), "PNG"),
        "palette.png": encode(palette, "PNG", transparency=0),
        "only_bad.png": encode(Image.new("RGB", (8, 8)), "PNG"),
        "corrupt.jpg": b"\xff\xd8 this is not really a JPEG " * 8,
        "cut_jpeg.jpg": jpeg[: len(jpeg) // 2],
        "cut_png.png": png[: len(png) // 2],
        "empty.jpg": b"",
        "bomb.png": encode(Image.new("1", (12000, 12000)), "PNG"),
    }


def write_images(folder: Path, images: dict[str, bytes], rename=lambda name: name) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (folder / rename(name)).write_bytes(data)


# --------------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Entry:
    """One caption as a loader must identify it."""

    image: str
    caption_id: str
    location: str
    raw: object
    bad: str | None


@dataclass
class Expected:
    good: dict[str, tuple[tuple[str, str], ...]]  # image id -> ((caption id, text), ...)
    skips: set[tuple[str, str, str, str]]  # (kind, id, location, reason)
    notes: set[tuple[str, str]] = field(default_factory=set)  # (image id, note)


def expect(entries, image_id: dict[str, str], image_location: dict[str, str], outcome=IMAGE_OUTCOME):
    captions = {name: [e for e in entries if e.image == name] for name in NAMES}
    good, skips, notes = {}, set(), set()
    for e in entries:
        if e.bad:
            skips.add(("caption", e.caption_id, e.location, e.bad))
    for name in NAMES:
        kept = tuple((e.caption_id, e.raw.strip()) for e in captions[name] if not e.bad)
        reason, note = outcome[name]
        if reason:
            skips.add(("image", image_id[name], image_location[name], reason))
        else:
            good[image_id[name]] = kept
            if note:
                notes.add((image_id[name], note))
    return Expected(good, skips, notes)


def run(source) -> dict[str, tuple[tuple[str, str], ...]]:
    got = {}
    for sample in source:
        assert sample.image.mode == "RGB"
        assert sample.image_id not in got
        got[sample.image_id] = tuple((c.id, c.text) for c in sample.captions)
    return got


def skip_set(report: SkipReport) -> set[tuple[str, str, str, str]]:
    return {(s.kind, s.id, s.location, s.reason) for s in report.skips}


def check(source, expected: Expected) -> None:
    got = run(source)
    assert list(got) == list(expected.good)  # source order
    assert got == expected.good  # every caption with its own image, none lost, none extra
    report = source.report
    assert skip_set(report) == expected.skips
    assert len(report.skips) == len(expected.skips)
    assert {(n.image_id, n.note) for n in report.notes} == expected.notes
    for kind in ("image", "caption", "shard"):
        assert report.counts()[kind] == dict(Counter(s[3] for s in expected.skips if s[0] == kind))
    n_images = sum(1 for s in expected.skips if s[0] == "image")
    assert f"skipped {n_images} images (" in report.summary()
    run(source)  # a second pass reports nothing twice
    assert len(report.skips) == len(expected.skips)


# --------------------------------------------------------------------------- CSV / TSV


def write_table(path: Path, prefix: str, sep: str) -> tuple[list[Entry], set]:
    """The text captions as a caption table, plus a malformed row, a blank line and a row without
    an image path; returns the entries and the table-specific refusals."""
    entries = []
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=sep, lineterminator="\n")
        writer.writerow(["filepath", "title"])
        line = 2
        for name, raw, bad in TEXT_CAPTIONS:
            writer.writerow([prefix + name, raw])
            entries.append(Entry(name, f"{path.name}:{line}", f"{path}:{line}", raw, bad))
            line += 1 + raw.count("\n")
        f.write(f"{prefix}good_a.jpg{sep}good_a: unquoted{sep} extra field\n\n{sep}nobody: no image\n")
    extra = {
        ("caption", f"{path.name}:{line}", f"{path}:{line}", "malformed CSV row"),
        ("caption", f"{path.name}:{line + 2}", f"{path}:{line + 2}", "no image path"),
    }
    return entries, extra


def table_expectation(entries, extra, prefix: str) -> Expected:
    first_location = {}
    for e in entries:
        first_location.setdefault(e.image, e.location)
    expected = expect(entries, {n: prefix + n for n in NAMES}, first_location)
    expected.skips |= extra
    return expected


def test_csv_source(tmp_path, images):
    write_images(tmp_path / "images", images)
    entries, extra = write_table(tmp_path / "captions.csv", "images/", ",")
    source = CSVSource(tmp_path / "captions.csv")  # relative paths: from the CSV's folder
    check(source, table_expectation(entries, extra, "images/"))
    assert source.report.summary() == (
        "skipped 7 images (2 truncated image data, 1 corrupt or unrecognised image data, "
        "1 decompression bomb, 1 empty file, 1 file not found, 1 no valid caption), "
        "8 captions (3 empty caption, 2 caption has no letters, 1 binary data in caption, "
        "1 malformed CSV row, 1 no image path); converted 3 images (1 16-bit grayscale scaled to "
        "8-bit, 1 CMYK converted to RGB, 1 palette transparency composited on white)"
    )


def test_tsv_source_with_image_root_and_own_columns(tmp_path, images):
    write_images(tmp_path / "pictures", images)
    (tmp_path / "lists").mkdir()
    path = tmp_path / "lists" / "captions.tsv"
    entries, extra = write_table(path, "", "\t")
    text = path.read_text(encoding="utf-8").replace("filepath\ttitle", "image\tcaption", 1)
    path.write_text(text, encoding="utf-8")
    source = open_source(str(path), image_root=tmp_path / "pictures", img_key="image", caption_key="caption")
    assert isinstance(source, CSVSource) and source.sep == "\t"
    check(source, table_expectation(entries, extra, ""))


def test_csv_separator_can_be_overridden(tmp_path, images):
    write_images(tmp_path, {"good_a.jpg": images["good_a.jpg"]})
    (tmp_path / "c.csv").write_text("filepath;title\ngood_a.jpg;good_a: with, commas\n", encoding="utf-8")
    samples = list(CSVSource(tmp_path / "c.csv", sep=";"))
    assert [(s.image_id, s.captions[0].text) for s in samples] == [("good_a.jpg", "good_a: with, commas")]


UTF16_TABLE = "filepath,title\ngood_a.jpg,good_a: \u00e9t\u00e9\n"


@pytest.mark.parametrize("name, content, message", [
    ("c.csv", "path,text\na.jpg,a cat\n",
     r"no column 'filepath' .*header: \['path', 'text'\].*--csv-img-key / --csv-caption-key.*--csv-separator"),
    ("c.csv", "filepath,Title\na.jpg,a cat\n", r"no column 'title' \(did you mean 'Title'\?\).*--csv-caption-key"),
    ("c.csv", "filepath\ttitle\na.jpg\ta cat\n", r"looks tab-separated: pass --csv-separator '\\t'"),
    ("c.tsv", "filepath,title\na.jpg,a cat\n", r"looks comma-separated: pass --csv-separator ','"),
    ("c.csv", "", r"is empty: .*--csv-img-key / --csv-caption-key"),
    ("c.csv", UTF16_TABLE.encode("utf-16"), r"is UTF-16 text .*byte-order mark.*--csv-encoding utf-16"),
    ("c.csv", UTF16_TABLE.encode("utf-16-le"), r"NUL bytes .*--csv-encoding utf-16-le"),
    ("c.csv", "filepath,t\u00eetle\na.jpg,a cat\n".encode("latin-1"), r"header is not valid utf-8.*--csv-encoding"),
])
def test_a_table_that_cannot_be_read_says_which_flag_fixes_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ValueError, match=message) as error:
        CSVSource(path).records()
    assert "\n" not in str(error.value)  # a CLI prints it as one line


def test_csv_missing_file_and_bad_reading_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        CSVSource(tmp_path / "nope.csv")
    (tmp_path / "c.csv").write_text("filepath,title\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--csv-separator"):
        CSVSource(tmp_path / "c.csv", sep="ab")
    with pytest.raises(ValueError, match="--csv-encoding"):
        CSVSource(tmp_path / "c.csv", encoding="no-such-codec")


def test_csv_in_another_encoding_reads_with_its_encoding(tmp_path, images):
    write_images(tmp_path, {"good_a.jpg": images["good_a.jpg"]})
    (tmp_path / "c.csv").write_bytes(UTF16_TABLE.encode("utf-16"))
    assert [s.captions[0].text for s in CSVSource(tmp_path / "c.csv", encoding="utf-16")] == ["good_a: \u00e9t\u00e9"]
    (tmp_path / "l.csv").write_bytes(UTF16_TABLE.encode("latin-1"))
    source = CSVSource(tmp_path / "l.csv")  # read as UTF-8: the caption is refused, with the flag to pass
    assert list(source) == []
    (skip,) = [s for s in source.report.skips if s.kind == "caption"]
    assert (skip.location, skip.reason) == (f"{tmp_path / 'l.csv'}:2", "binary data in caption")
    assert "--csv-encoding" in skip.detail
    assert [s.captions[0].text for s in CSVSource(tmp_path / "l.csv", encoding="latin-1")] == ["good_a: \u00e9t\u00e9"]


def write_pngs(folder: Path, names) -> None:
    for name in names:
        Image.new("RGB", (8, 8), (0, 90, 0)).save(folder / name)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_unterminated_quote_is_reported_and_the_rows_after_it_are_kept(tmp_path, newline):
    write_pngs(tmp_path, ["a.png", "b.png", "c.png", "d.png", "e.png"])
    lines = ['filepath,title', 'a.png,a: fine', 'b.png,"b: the quote is never closed', 'c.png,c: fine',
             'e.png,"e: one line,', 'two, three', 'and ""four"""',  # a multi-line caption none of whose lines is a row
             'd.png,"d: quoted, fine"']
    (tmp_path / "c.csv").write_bytes(newline.join(lines).encode() + newline.encode())
    source = CSVSource(tmp_path / "c.csv")
    assert run(source) == {"a.png": (("c.csv:2", "a: fine"),), "c.png": (("c.csv:4", "c: fine"),),
                           "e.png": (("c.csv:5", newline.join(["e: one line,", "two, three", 'and "four"'])),),
                           "d.png": (("c.csv:8", "d: quoted, fine"),)}
    assert skip_set(source.report) == {("caption", "c.csv:3", f"{tmp_path / 'c.csv'}:3", "unterminated quote")}
    assert "line 4" in source.report.skips[0].detail


def test_unterminated_quote_closed_by_a_later_quote(tmp_path):
    # the case that cached 3 of 4 images and reported nothing: the stray quote closes at d's opening one
    write_pngs(tmp_path, ["a.png", "b.png", "c.png", "d.png"])
    (tmp_path / "c.csv").write_text('filepath,title\na.png,"a: open\nb.png,b: fine\nc.png,c: fine\n'
                                    'd.png,"d: the ""big"" one"\n', encoding="utf-8")
    source = CSVSource(tmp_path / "c.csv")
    assert [(s.image_id, s.captions[0].text) for s in source] == [
        ("b.png", "b: fine"), ("c.png", "c: fine"), ("d.png", 'd: the "big" one')]
    assert skip_set(source.report) == {("caption", "c.csv:2", f"{tmp_path / 'c.csv'}:2", "unterminated quote")}


def test_quote_still_open_at_the_end_of_the_file(tmp_path):
    write_pngs(tmp_path, ["a.png", "b.png"])
    (tmp_path / "c.csv").write_text('filepath,title\na.png,a: fine\nb.png,"b: open\nno record here\n',
                                    encoding="utf-8")
    source = CSVSource(tmp_path / "c.csv")
    assert [s.image_id for s in source] == ["a.png"]
    assert skip_set(source.report) == {("caption", "c.csv:3", f"{tmp_path / 'c.csv'}:3", "unterminated quote")}
    # no final newline
    (tmp_path / "d.csv").write_text('filepath,title\na.png,a: fine\nb.png,"b: open', encoding="utf-8")
    source = CSVSource(tmp_path / "d.csv")
    assert [r.image_id for r in source.records()] == ["a.png"]
    assert {(s.id, s.reason) for s in source.report.skips} == {("d.csv:3", "unterminated quote")}


def test_csv_bytes_that_are_not_utf8_are_a_bad_caption(tmp_path, images):
    write_images(tmp_path, {"good_a.jpg": images["good_a.jpg"]})
    (tmp_path / "c.csv").write_bytes(b"filepath,title\ngood_a.jpg,good_a \xff\xfe\ngood_a.jpg,good_a: fine\n")
    source = CSVSource(tmp_path / "c.csv")
    assert [[c.text for c in s.captions] for s in source] == [["good_a: fine"]]
    assert skip_set(source.report) == {("caption", "c.csv:2", f"{tmp_path / 'c.csv'}:2", "binary data in caption")}


# --------------------------------------------------------------------------- COCO and the toy world


def coco_document(file_name) -> tuple[dict, dict[str, int]]:
    ids = {name: 10 + i for i, name in enumerate(NAMES)}
    coco = {
        "images": [{"id": ids[n], "file_name": file_name(n), "width": 8, "height": 8} for n in NAMES],
        "annotations": [
            {"id": 100 + k, "image_id": ids[name], "caption": raw} for k, (name, raw, _) in enumerate(CAPTIONS)
        ],
    }
    coco["annotations"].append({"id": 999, "image_id": 12345, "caption": "orphan: unknown image"})
    return coco, ids


def coco_expectation(path: Path, ids: dict[str, int]) -> Expected:
    entries = [
        Entry(name, str(100 + k), f"{path}:annotation {100 + k}", raw, bad)
        for k, (name, raw, bad) in enumerate(CAPTIONS)
    ]
    expected = expect(
        entries, {n: str(ids[n]) for n in NAMES}, {n: f"{path}:image {ids[n]}" for n in NAMES}
    )
    expected.skips.add(("caption", "999", f"{path}:annotation 999", "unknown image id"))
    return expected


def test_coco_source(tmp_path, images):
    write_images(tmp_path / "train2017", images)
    coco, ids = coco_document(lambda name: name)
    path = tmp_path / "annotations" / "captions_train2017.json"
    path.parent.mkdir()
    path.write_text(json.dumps(coco), encoding="utf-8")  # NaN is written as JSON's NaN literal
    source = open_source(path, image_root=tmp_path / "train2017")
    assert isinstance(source, COCOSource)
    check(source, coco_expectation(path, ids))


def test_coco_malformed_entries_are_reported(tmp_path, images):
    write_images(tmp_path, {"good_a.jpg": images["good_a.jpg"]})
    path = tmp_path / "c.json"
    coco = {
        "images": [{"id": 1, "file_name": "good_a.jpg"}, {"id": 1, "file_name": "again.jpg"}, {"file_name": 3}],
        "annotations": [{"id": 5, "image_id": 1, "caption": "good_a: kept"}, "not an annotation"],
    }
    path.write_text(json.dumps(coco), encoding="utf-8")
    source = COCOSource(path)
    assert [(s.image_id, [c.id for c in s.captions]) for s in source] == [("1", ["5"])]
    assert skip_set(source.report) == {
        ("image", "1", f"{path}:image 1", "duplicate image id"),
        ("image", "images[2]", f"{path}:image images[2]", "malformed image entry"),
        ("caption", "annotations[1]", f"{path}:annotation annotations[1]", "unknown image id"),
    }


def test_not_a_coco_file(tmp_path):
    (tmp_path / "a.json").write_text('{"images": []}', encoding="utf-8")
    with pytest.raises(ValueError, match="'annotations'"):
        COCOSource(tmp_path / "a.json").records()
    (tmp_path / "b.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        COCOSource(tmp_path / "b.json").records()


def write_toy_world(root: Path, images: dict[str, bytes]) -> dict[str, int]:
    """A tiny toy world in the generator's layout, built from the corpus."""
    index = {name: i for i, name in enumerate(NAMES)}
    file_name = lambda name: f"images/{index[name]:06d}.png"  # noqa: E731
    write_images(root / "images", images, rename=lambda name: file_name(name)[len("images/"):])
    coco, _ = coco_document(file_name)
    for image in coco["images"]:
        image["id"] = index[NAMES[image["id"] - 10]]
    for annotation in coco["annotations"][:-1]:
        annotation["image_id"] = index[NAMES[annotation["image_id"] - 10]]
    (root / "train_coco.json").write_text(json.dumps(coco), encoding="utf-8")
    with open(root / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["filepath", "title"])
        writer.writerows([file_name(name), raw] for name, raw, _ in TEXT_CAPTIONS)
    scenes = [{"image_id": index[n], "file_name": file_name(n), "split": "train", "objects": [{"shape": n}],
               "relations": [], "captions": []} for n in NAMES]
    scenes.append({"image_id": 500, "file_name": "images/000500.png", "split": "val", "objects": [],
                   "relations": [], "captions": []})
    (root / "annotations.json").write_text(json.dumps({"meta": {}, "scenes": scenes}), encoding="utf-8")
    (root / "negatives.json").write_text("{}", encoding="utf-8")
    (root / "meta.json").write_text('{"name": "toy"}', encoding="utf-8")
    return index


def test_toy_world_source(tmp_path, images):
    root = tmp_path / "toy"
    index = write_toy_world(root, images)
    source = open_source(root, split="train")
    assert isinstance(source, ToyWorldSource)
    path = root / "train_coco.json"
    expected = coco_expectation(path, index)
    expected.skips = {s if s[1] != "999" else ("caption", "999", s[2], "unknown image id") for s in expected.skips}
    check(source, expected)
    assert set(source.annotations) == {str(i) for i in index.values()}  # this split's scenes only
    assert source.annotations[str(index["cmyk.jpg"])]["objects"] == [{"shape": "cmyk.jpg"}]
    with pytest.raises(FileNotFoundError, match=r"splits found: \['train'\]"):
        ToyWorldSource(root, split="test")


def test_toy_world_csv_pairs_like_its_coco(tmp_path, images):
    root = tmp_path / "toy"
    index = write_toy_world(root, images)
    by_path = {f"images/{i:06d}.png": name for name, i in index.items()}
    from_csv = {by_path[k]: [t for _, t in v] for k, v in run(open_source(root / "train.csv")).items()}
    from_coco = {NAMES[int(k)]: [t for _, t in v] for k, v in run(ToyWorldSource(root)).items()}
    assert from_csv == from_coco and set(from_csv) == {"good_a.jpg", "good_b.png", "cmyk.jpg", "gray16.png", "palette.png"}


# --------------------------------------------------------------------------- webdataset shards


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def shard_samples(images: dict[str, bytes]) -> list[tuple[str, dict[str, bytes]]]:
    """The corpus as webdataset samples: several captions in ``.json`` "captions", one in ``.txt``,
    ``.json`` "caption"/"text", or ``.txt`` plus ``.json`` with the same caption (img2dataset)."""
    samples = []
    for name in NAMES:
        key, ext = name.split(".")
        raws = [raw for n, raw, _ in CAPTIONS if n == name]
        files = {ext: images[name]} if name in images else {}
        if len(raws) > 1:
            files["json"] = json.dumps({"captions": raws}).encode()
        elif name == "palette.png":
            files["json"] = json.dumps({"caption": raws[0], "url": "http://example.invalid"}).encode()
        elif name == "cmyk.jpg":
            files["json"] = json.dumps({"text": raws[0]}).encode()
        else:
            files["txt"] = raws[0].encode()
            if name == "gray16.png":
                files["json"] = json.dumps({"caption": raws[0]}).encode()
        samples.append((key, files))
    samples.append(("no_caption", {"png": images["good_b.png"]}))
    samples.append(("bad_json", {"png": images["good_b.png"], "json": b"{not json"}))
    return samples


def write_shard(path: Path, samples) -> None:
    with tarfile.open(path, "w") as tf:
        for key, files in samples:
            for ext, data in files.items():
                add_member(tf, f"{key}.{ext}", data)


def test_webdataset_source(tmp_path, images):
    samples = shard_samples(images)
    shards = [tmp_path / "shard-000.tar", tmp_path / "shard-001.tar"]
    write_shard(shards[0], samples[:5])
    write_shard(shards[1], samples[5:])
    shard_of = {key: str(shards[0] if i < 5 else shards[1]) for i, (key, _) in enumerate(samples)}
    key = {name: name.split(".")[0] for name in NAMES}
    location = {name: f"{shard_of[key[name]]}::{key[name]}" for name in NAMES}
    entries = []
    for name in NAMES:
        raws = [(raw, bad) for n, raw, bad in CAPTIONS if n == name]
        entries += [Entry(name, f"{key[name]}#{k}", location[name], raw, bad) for k, (raw, bad) in enumerate(raws)]
    outcome = {**IMAGE_OUTCOME, "missing.jpg": ("no image in sample", None)}
    expected = expect(entries, key, location, outcome)
    expected.skips |= {
        ("image", "no_caption", f"{shards[1]}::no_caption", "no valid caption"),
        ("caption", "bad_json.json", f"{shards[1]}::bad_json", "unreadable caption JSON"),
        ("image", "bad_json", f"{shards[1]}::bad_json", "no valid caption"),
    }
    source = open_source(str(tmp_path / "shard-{000..001}.tar"))
    assert isinstance(source, WebDatasetSource) and source.shards == [str(s) for s in shards]
    check(source, expected)


def test_damaged_shards_are_reported_and_reading_goes_on(tmp_path, images):
    folder = tmp_path / "shards"
    folder.mkdir()
    good = lambda key: (key, {"png": images["good_b.png"], "txt": f"{key}: fine".encode()})  # noqa: E731
    write_shard(folder / "a.tar", [good("a1"), good("a2"), good("a3")])
    data = (folder / "a.tar").read_bytes()
    member = 512 + len(images["good_b.png"]) + (-len(images["good_b.png"]) % 512) + 1024
    (folder / "b_cut_in_data.tar").write_bytes(data[: member + 700])  # inside a2.png
    (folder / "c_cut_at_header.tar").write_bytes(data[: member + 100])  # inside a2.png's header
    (folder / "d_no_end_marker.tar").write_bytes(data[:member])  # after a1, without the end blocks
    corrupt_header = bytearray(data)
    corrupt_header[member : member + 512] = b"\x07" * 512
    (folder / "e_corrupt_header.tar").write_bytes(bytes(corrupt_header))
    (folder / "f_garbage.tar").write_bytes(b"\x01" * 3000)
    write_shard(folder / "g.tar", [good("g1")])
    source = WebDatasetSource([folder, tmp_path / "absent.tar"])
    shard_skip = lambda path, reason: ("shard", str(path), str(path), reason)  # noqa: E731

    assert [s.image_id for s in source] == ["a1", "a2", "a3", "a1", "g1"]
    damaged = "corrupt or truncated shard"
    assert skip_set(source.report) == {
        shard_skip(folder / "b_cut_in_data.tar", damaged),
        ("image", "a2", f"{folder / 'b_cut_in_data.tar'}::a2", "incomplete sample in damaged shard"),
        shard_skip(folder / "c_cut_at_header.tar", damaged),
        ("image", "a1", f"{folder / 'c_cut_at_header.tar'}::a1", "incomplete sample in damaged shard"),
        shard_skip(folder / "d_no_end_marker.tar", damaged),
        ("image", "a1", f"{folder / 'd_no_end_marker.tar'}::a1", "incomplete sample in damaged shard"),
        shard_skip(folder / "e_corrupt_header.tar", damaged),
        ("image", "a1", f"{folder / 'e_corrupt_header.tar'}::a1", "incomplete sample in damaged shard"),
        shard_skip(folder / "f_garbage.tar", damaged),
        shard_skip(tmp_path / "absent.tar", "file not found"),
    }
    assert {s.kind for s in source.report.skips} == {"shard", "image"}
    assert source.report.summary().startswith("skipped 6 shards (5 corrupt or truncated shard, 1 file not found), 4 images")


def test_raw_samples_and_their_count_agree_even_on_damaged_shards(tmp_path, images):
    good = lambda key: (key, {"png": images["good_b.png"], "txt": f"{key}: fine".encode()})  # noqa: E731
    write_shard(tmp_path / "a.tar", [good("a1"), good("a2"), good("a3")])
    data = (tmp_path / "a.tar").read_bytes()
    member = 512 + len(images["good_b.png"]) + (-len(images["good_b.png"]) % 512) + 1024
    cuts = {"whole": data, "in_data": data[: member + 700], "at_header": data[: member + 100], "no_end": data[:member],
            "second": data[: 2 * member], "garbage": b"\x01" * 3000}
    for name, content in cuts.items():
        (tmp_path / f"{name}.tar").write_bytes(content)
    for name in [*cuts, "absent"]:
        shard = str(tmp_path / f"{name}.tar")
        source = WebDatasetSource(shard)
        keys = [key for key, _ in source.raw_samples(shard)]
        assert WebDatasetSource.count_samples(shard) == len(keys), name
        for skip in range(len(keys) + 1):
            assert [key for key, _ in WebDatasetSource(shard).raw_samples(shard, skip=skip)] == keys[skip:], name
    assert [k for k, _ in WebDatasetSource(str(tmp_path / "whole.tar")).raw_samples(str(tmp_path / "whole.tar"))] == [
        "a1", "a2", "a3"]


def test_samples_carry_their_location_so_a_note_is_recorded_once(tmp_path, images):
    # A caller that records a batch's notes (SkipReport.add_batch, as python -m extract does) must record the
    # note the source already has, not a second one under another location.
    write_shard(tmp_path / "s.tar", [("cmyk", {"jpg": images["cmyk.jpg"], "txt": b"cmyk: a photo"}),
                                     ("good", {"png": images["good_b.png"], "txt": b"good: fine"})])
    write_images(tmp_path, images)
    (tmp_path / "c.csv").write_text("filepath,title\ngood_a.jpg,good_a: x\ncmyk.jpg,cmyk: a photo\n", encoding="utf-8")
    for source, location in ((open_source(tmp_path / "s.tar"), f"{tmp_path / 's.tar'}::cmyk"),
                             (open_source(tmp_path / "c.csv"), f"{tmp_path / 'c.csv'}:3")):
        for sample in source:
            item = Item(sample.image_id, sample.image, sample.captions, sample.location, sample.note)
            source.report.add_batch(*collate_skipping([item]))
        assert [(n.image_id, n.location) for n in source.report.notes] == [("cmyk" if "::" in location else "cmyk.jpg",
                                                                            location)]
        assert source.report.summary().endswith("converted 1 image (1 CMYK converted to RGB)")


def test_expand_shards(tmp_path):
    for name in ("b.tar", "a.tar", "c.tar.gz", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert expand_shards(tmp_path) == [str(tmp_path / n) for n in ("a.tar", "b.tar", "c.tar.gz")]
    assert expand_shards("s/{0..2}.tar") == ["s/0.tar", "s/1.tar", "s/2.tar"]
    assert expand_shards(["x.tar", "s/{a,b}.tar"]) == ["x.tar", "s/a.tar", "s/b.tar"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no shards"):
        WebDatasetSource(tmp_path / "empty")


# --------------------------------------------------------------------------- choosing a source


def test_open_source_rejects_what_it_cannot_read(tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"")
    for spec in (tmp_path / "data.parquet", tmp_path):
        with pytest.raises(ValueError, match=r"\.csv/\.tsv.*COCO.*toy world.*\.tar"):
            open_source(spec)


# --------------------------------------------------------------------------- a folder of images


def write_photo_folder(root: Path, images: dict[str, bytes]) -> None:
    """Images at two depths (one with an upper-case extension), a bad one, and what is no image: a hidden file,
    a hidden folder, a text file."""
    write_images(root, {k: v for k, v in images.items() if k in ("good_a.jpg", "cmyk.jpg", "corrupt.jpg")})
    write_images(root / "b" / "c", {"deep.PNG": images["good_b.png"]})
    write_images(root / ".thumbnails", {"t.jpg": images["good_a.jpg"]})
    (root / ".hidden.jpg").write_bytes(images["good_a.jpg"])
    (root / "notes.txt").write_text("not an image")


def test_image_folder_source(tmp_path, images):
    root = tmp_path / "photos"
    write_photo_folder(root, images)
    source = open_source(root, split="test", image_root="x", img_key="k")  # other sources' options are ignored
    assert isinstance(source, ImageFolderSource) and not source.has_captions and source.name == "photos"
    records = source.records()
    assert [r.image_id for r in records] == ["b/c/deep.PNG", "cmyk.jpg", "corrupt.jpg", "good_a.jpg"]
    assert all(r.captions == () and Path(r.source) == root / r.image_id for r in records)
    assert run(source) == {"b/c/deep.PNG": (), "cmyk.jpg": (), "good_a.jpg": ()}
    assert skip_set(source.report) == {("image", "corrupt.jpg", str(root / "corrupt.jpg"),
                                        "corrupt or unrecognised image data")}
    assert {(n.image_id, n.note) for n in source.report.notes} == {("cmyk.jpg", "CMYK converted to RGB")}
    got, report = through_loader(ImageFolderSource(root))  # DataLoader workers: the same samples and refusals
    assert got == run(ImageFolderSource(root)) and skip_set(report) == skip_set(source.report)


def test_image_folder_is_chosen_only_for_plain_folders(tmp_path, images):
    write_toy_world(tmp_path / "toy", images)  # a toy world holds images too
    assert isinstance(open_source(tmp_path / "toy"), ToyWorldSource)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "000.tar", shard_samples(images)[:2])
    write_images(shards, {"stray.jpg": images["good_a.jpg"]})  # shards win over a stray image
    assert isinstance(open_source(shards), WebDatasetSource)
    (tmp_path / "none" / "sub").mkdir(parents=True)
    (tmp_path / "none" / "sub" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match="folder of images"):
        open_source(tmp_path / "none")
    with pytest.raises(ValueError, match="holds no image"):
        ImageFolderSource(tmp_path / "none").records()
    with pytest.raises(FileNotFoundError, match="not found"):
        ImageFolderSource(tmp_path / "absent")


def test_a_caption_less_folder_is_cached_as_image_arrays_only(tmp_path, images):
    """The extraction pipeline on images without captions: image arrays, no caption arrays, the bad image
    skipped and reported."""
    from extract.pipeline import build_cache

    root = tmp_path / "photos"
    write_photo_folder(root, images)
    cache = build_cache(root, tmp_path / "cache", base="tiny", components=["patches", "regions"], workers=0)
    assert cache.num_images == 3 and cache.num_captions == 0
    assert cache.image_ids() == ["b/c/deep.PNG", "cmyk.jpg", "good_a.jpg"]
    assert set(cache.keys) == {"image_embed", "patch_tokens", "region_masks", "region_valid", "caption_image"}
    assert cache.gather("image_embed", [0, 2]).shape == (2, 64) and len(cache.caption_image_index()) == 0
    report = json.loads((cache.path / "report.json").read_text())
    assert report["counts"]["image"] == {"corrupt or unrecognised image data": 1}


# --------------------------------------------------------------------------- DataLoader


def to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.resize((8, 8)))).permute(2, 0, 1).contiguous()


def through_loader(source) -> tuple[dict, SkipReport]:
    dataset = SampleDataset(source, transform=to_tensor)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=collate_skipping)
    got, report = {}, SkipReport().merge(source.report)  # index-time refusals
    for good, skips in loader:
        report.add_batch(good, skips)
        if good["images"] is not None:
            assert good["images"].shape == (len(good["image_ids"]), 3, 8, 8)
        for image_id, captions in zip(good["image_ids"], good["captions"]):
            got[image_id] = tuple((c.id, c.text) for c in captions)
    return got, report


@pytest.mark.parametrize("kind", ["csv", "coco", "toy"])
def test_dataloader_with_workers_matches_plain_iteration(tmp_path, images, kind):
    if kind == "toy":
        write_toy_world(tmp_path, images)
        make = lambda: ToyWorldSource(tmp_path)  # noqa: E731
    elif kind == "csv":
        write_images(tmp_path / "images", images)
        write_table(tmp_path / "c.csv", "images/", ",")
        make = lambda: CSVSource(tmp_path / "c.csv")  # noqa: E731
    else:
        write_images(tmp_path, images)
        (tmp_path / "c.json").write_text(json.dumps(coco_document(lambda n: n)[0]), encoding="utf-8")
        make = lambda: COCOSource(tmp_path / "c.json")  # noqa: E731
    plain = make()
    expected = run(plain)
    got, report = through_loader(make())
    assert got == expected
    assert set(report.skips) == set(plain.report.skips) and len(report.skips) == len(plain.report.skips)
    assert set(report.notes) == set(plain.report.notes)
    assert report.summary() == plain.report.summary()


def test_collate_without_good_items():
    good, skips = collate_skipping([])
    assert good["images"] is None and good["image_ids"] == [] and skips == []


# --------------------------------------------------------------------------- the report


def test_report_json_merge_and_empty_summary(tmp_path, images):
    assert SkipReport().summary() == "skipped 0 images, 0 captions; converted 0 images"
    write_images(tmp_path, images)
    (tmp_path / "c.csv").write_text(
        "filepath,title\ncmyk.jpg,cmyk: a photo\nempty.jpg,empty: x\ncmyk.jpg,\n", encoding="utf-8"
    )
    source = CSVSource(tmp_path / "c.csv")
    run(source)
    merged = SkipReport().merge(source.report).merge(source.report)
    assert merged.skips == source.report.skips and merged.notes == source.report.notes
    source.report.to_json(tmp_path / "out" / "report.json")
    saved = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert saved["summary"] == (
        "skipped 1 image (1 empty file), 1 caption (1 empty caption); converted 1 image (1 CMYK converted to RGB)"
    )
    assert saved["counts"]["image"] == {"empty file": 1}
    assert saved["skipped"][0] == {
        "kind": "caption", "id": "c.csv:4", "location": f"{tmp_path / 'c.csv'}:4", "reason": "empty caption", "detail": "",
    }
    assert saved["converted"] == [{"image_id": "cmyk.jpg", "location": f"{tmp_path / 'c.csv'}:2", "note": "CMYK converted to RGB"}]


def test_decoding_options_reach_every_image(tmp_path, images):
    write_images(tmp_path, images)
    write_images(tmp_path, {"big.png": encode(Image.new("RGB", (20, 20)), "PNG")})
    (tmp_path / "c.csv").write_text(
        "filepath,title\ncmyk.jpg,cmyk: a photo\ngood_a.jpg,good_a: a square\nbig.png,big: a square\n",
        encoding="utf-8",
    )
    source = open_source(tmp_path / "c.csv", unusual="skip", max_pixels=16 * 12)
    assert [s.image_id for s in source] == ["good_a.jpg"]  # 16 x 12 px: at the limit, kept
    assert {(s.id, s.reason) for s in source.report.skips} == {
        ("cmyk.jpg", "unusual image mode"),
        ("big.png", "decompression bomb"),
    }
