"""The bad-input corpus: every kind of broken input a user can hand plugvlm, in one folder.

:func:`build` writes the data part once per test module (the module-scoped ``corpus`` fixture of
``tests/test_bad_inputs.py``; its ``full_corpus`` adds the checkpoints and caches through :func:`add_checkpoints`
and :func:`add_truncated_cache`), and that file runs every entry point that reads data, configs, checkpoints or
caches against it. Each entry says what must happen: a report line (the run goes on and the good rows are kept,
unchanged) or a one-line error naming the file and what to do (exit status 2), never a traceback and never a
silently wrong result.

Layout under the corpus root (the tables lie next to their images: relative paths resolve against a table's folder)::

    images/             good, converted (CMYK, 16-bit, palette + transparency) and broken image files
    images/mixed.csv    good rows among bad images, bad captions and an unterminated quote
    images/*.csv        tables no command can read: wrong columns, tab-separated .csv, empty, UTF-16
    images/coco.json    COCO captions with an annotation of an unknown image and a bad caption
    shards/             a webdataset shard cut in the middle
    configs/*.yaml      values that must fail the command line's checks
    checkpoints/        an adapter and a training state with flipped bytes, an adapter with NaN weights, a damaged
                        pre-training checkpoint, a foreign pickle; --pretrained files torch cannot
                        use: a .pt cut in half, a 404 page saved as .pt, another architecture's state dict
    caches/truncated    a feature cache with a cut .npy
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# --------------------------------------------------------------------------------------------- images
GOOD_IMAGES = {  # name -> colour; decoded as they are
    "good_a.png": (200, 0, 0),
    "good_b.png": (0, 0, 200),
    "good_c.png": (0, 160, 0),
}


def _encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def _images() -> dict[str, bytes]:
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    png = _encode(noise, "PNG")
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.putpixel((8, 8), 1)
    return {
        **{name: _encode(Image.new("RGB", (32, 24), colour), "PNG") for name, colour in GOOD_IMAGES.items()},
        "cmyk.jpg": _encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG"),
        "gray16.png": _encode(Image.fromarray(np.full((16, 16), 40000, dtype=np.uint16)), "PNG"),
        "palette.png": _encode(palette, "PNG", transparency=0),
        "corrupt.jpg": b"\xff\xd8 this is not really a JPEG " * 8,
        "cut.png": png[: len(png) // 2],
        "empty.jpg": b"",
        "not_an_image.png": b"filepath,title\nthis is a CSV file with an image's name\n",
        "bomb.png": _encode(Image.new("1", (12000, 12000)), "PNG"),  # 144 Mpx from a few kB
    }


# images that are skipped (with the reason's start) and images converted with a note
BAD_IMAGES = {"corrupt.jpg": "corrupt or unrecognised image data", "cut.png": "truncated image data",
              "empty.jpg": "empty file", "not_an_image.png": "corrupt or unrecognised image data",
              "bomb.png": "decompression bomb", "missing.jpg": "file not found"}
CONVERTED = ("cmyk.jpg", "gray16.png", "palette.png")

# --------------------------------------------------------------------------------------------- mixed.csv
# (line, image, caption as written in the CSV, expected outcome: None = kept, else the reported reason)
MIXED_ROWS = [
    (2, "good_a.png", "a red square", None),
    (3, "good_b.png", "a blue square", None),
    (4, "good_b.png", "", "empty caption"),
    (5, "good_b.png", '"   "', "empty caption"),
    (6, "good_b.png", "12 34", "caption has no letters"),
    (7, "corrupt.jpg", "corrupt: never seen", "image"),
    (8, "cut.png", "cut: never seen", "image"),
    (9, "empty.jpg", "empty: never seen", "image"),
    (10, "not_an_image.png", "a CSV file: never seen", "image"),
    (11, "bomb.png", "a bomb: never seen", "image"),
    (12, "missing.jpg", "missing: never seen", "image"),
    (13, "cmyk.jpg", "a cyan photo", None),
    (14, "gray16.png", "a grey ramp", None),
    (15, "palette.png", "a blue dot on white", None),
    (16, "good_a.png", '"an unterminated quote', "unterminated quote"),
    (17, "good_c.png", "a green square", None),
    (18, "good_c.png", "a square of green", None),
]
MIXED_GOOD = {(image, caption.strip('"')) for _, image, caption, outcome in MIXED_ROWS if outcome is None}

# tables that stop every command reading them, with what the one-line error must say
UNREADABLE_TABLES = {
    "wrong_columns.csv": ("image,caption\ngood_a.png,a red square\n", "--csv-img-key"),
    "tab_separated.csv": ("filepath\ttitle\ngood_a.png\ta red square\n", "--csv-separator"),
    "empty.csv": ("", "empty"),
    "utf16.csv": ("filepath,title\ngood_a.png,a red square\n".encode("utf-16"), "--csv-encoding"),
}

# --------------------------------------------------------------------------------------------- configs
# file -> (YAML text, what the error says after "key 'K': "); each holds a valid method so the value is the problem
BAD_CONFIGS = {
    "lr_true.yaml": ("lr: true\n", "key 'lr': --lr expects a value as on the command line"),
    "schedule_linear.yaml": ("schedule: linear\n", "key 'schedule': invalid choice: 'linear'"),
    "epochs_negative.yaml": ("epochs: -3\n", "key 'epochs': expected an integer >= 1, got -3"),
    "precision_fp64.yaml": ("precision: fp64\n", "key 'precision': invalid choice: 'fp64'"),
    "syntax_error.yaml": ("epochs: [3\n", "not valid YAML"),
    "workers_true.yaml": ("workers: true\n", "key 'workers': --workers expects a value as on the command line"),
    "batch_size_zero.yaml": ("batch_size: 0\n", "key 'batch_size': expected an integer >= 1, got 0"),
}


@dataclass
class Corpus:
    root: Path
    images: Path
    mixed_csv: Path
    tables: dict[str, tuple[Path, str]]          # name -> (path, message)
    coco: Path
    cut_shard: Path
    configs: dict[str, tuple[Path, str]]         # name -> (path, message)
    checkpoints: dict[str, Path] = field(default_factory=dict)
    caches: dict[str, Path] = field(default_factory=dict)


def _write_mixed(path: Path) -> None:
    lines = ["filepath,title"] + [f"{image},{caption}" for _, image, caption, _ in MIXED_ROWS]
    assert [line for line, *_ in MIXED_ROWS] == list(range(2, 2 + len(MIXED_ROWS)))
    path.write_text("\n".join(lines) + "\n")


def _write_coco(path: Path) -> None:
    doc = {"images": [{"id": 1, "file_name": "good_a.png"}, {"id": 2, "file_name": "good_b.png"}],
           "annotations": [{"id": 10, "image_id": 1, "caption": "a red square"},
                           {"id": 11, "image_id": 2, "caption": "a blue square"},
                           {"id": 12, "image_id": 99, "caption": "an image that is not listed"},
                           {"id": 13, "image_id": 2, "caption": None}]}
    path.write_text(json.dumps(doc))


def _write_cut_shard(path: Path, images: dict[str, bytes]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tf:
        for k, name in enumerate(["good_a.png", "good_b.png", "good_c.png"]):
            for suffix, data in ((".png", images[name]), (".txt", f"square number {k}".encode())):
                info = tarfile.TarInfo(f"sample{k:03d}{suffix}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        last_png = [m for m in tf.getmembers() if m.name.endswith(".png")][-1]
    path.write_bytes(data[: last_png.offset_data + last_png.size // 2])  # the last sample is cut off mid-image


def build(root: Path) -> Corpus:
    """Write the data part of the corpus (images, tables, COCO, shards, configs) under ``root``."""
    images = root / "images"
    images.mkdir(parents=True)
    encoded = _images()
    for name, data in encoded.items():
        (images / name).write_bytes(data)
    mixed = images / "mixed.csv"  # next to its images: relative paths resolve against the table's folder
    _write_mixed(mixed)
    tables = {}
    for name, (content, message) in UNREADABLE_TABLES.items():
        path = images / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        tables[name] = (path, message)
    coco = images / "coco.json"
    _write_coco(coco)
    (root / "shards").mkdir()
    cut = root / "shards" / "cut-00000.tar"
    _write_cut_shard(cut, encoded)
    (root / "configs").mkdir()
    configs = {}
    for name, (text, message) in BAD_CONFIGS.items():
        path = root / "configs" / name
        path.write_text(text)
        configs[name] = (path, message)
    return Corpus(root, images, mixed, tables, coco, cut, configs)


# --------------------------------------------------------------------------------------------- checkpoints, caches
def flip_tensor_bytes(path: Path, at: int | None = None, count: int = 64) -> None:
    """Invert ``count`` bytes of a safetensors file's tensor data (past the 8-byte length and the JSON header),
    starting ``at`` bytes into it (default: the middle)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    begin = start + (at if at is not None else (len(data) - start) // 2)
    assert begin + count <= len(data), "not that many bytes of tensor data"
    data[begin:begin + count] = bytes(b ^ 0xFF for b in data[begin:begin + count])
    path.write_bytes(bytes(data))


# --pretrained files torch cannot use, with what the one error line must say
UNUSABLE_WEIGHTS = {
    "cut.pt": "is not a readable PyTorch file (cut short or not a checkpoint",
    "junk.pt": "is not a readable PyTorch file (cut short or not a checkpoint",
    "wrong_arch.pt": "does not fit architecture plugvlm-tiny: ",
}


def add_checkpoints(corpus: Corpus, adapter: Path, state: Path | None = None) -> None:
    """Tampered copies of a trained adapter checkpoint (and of its run's training ``state``, when given), a damaged
    pre-training checkpoint, a foreign pickle and the :data:`UNUSABLE_WEIGHTS` files."""
    from adapters.checkpoint import read, write
    from extract.backbone import load_backbone
    from train import pretrain_checkpoint as ck

    folder = corpus.root / "checkpoints"
    folder.mkdir()
    flipped = folder / "adapter_flipped.safetensors"
    shutil.copy(adapter, flipped)
    flip_tensor_bytes(flipped)
    tensors, meta = read(adapter)
    nan = {k: (torch.full_like(v, float("nan")) if v.is_floating_point() else v) for k, v in tensors.items()}
    nan_path = write(folder / "adapter_nan.safetensors", nan, meta)  # a valid digest over NaN weights
    model = load_backbone("tiny").model
    (folder / "pretrain_flipped").mkdir()
    pretrain = ck.save_final(folder / "pretrain_flipped", model, {"model": "plugvlm-tiny", "quick_gelu": False})
    flip_tensor_bytes(pretrain)
    foreign = folder / "foreign.pt"
    torch.save({"state_dict": model.state_dict(), "args": argparse.Namespace(lr=1e-3)}, foreign)
    corpus.checkpoints.update(adapter_flipped=flipped, adapter_nan=nan_path, pretrain_flipped=pretrain,
                              foreign_pickle=foreign)
    if state is not None:
        state_flipped = folder / "state_flipped.safetensors"
        shutil.copy(state, state_flipped)
        flip_tensor_bytes(state_flipped)
        corpus.checkpoints["state_flipped"] = state_flipped
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    whole = buffer.getvalue()
    (folder / "cut.pt").write_bytes(whole[: len(whole) // 2])  # an interrupted download or copy
    (folder / "junk.pt").write_bytes(b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>"
                                     b"<body>Not Found</body></html>\n")  # what a failed download may save
    torch.save(load_backbone("tiny-coca").model.state_dict(), folder / "wrong_arch.pt")  # readable, another model
    corpus.checkpoints.update({name.removesuffix(".pt"): folder / name for name in UNUSABLE_WEIGHTS})


def add_truncated_cache(corpus: Corpus, cache_path: Path) -> None:
    """A copy of a finished cache with one .npy cut short."""
    dst = corpus.root / "caches" / "truncated" / cache_path.name
    shutil.copytree(cache_path, dst)
    victim = sorted(dst.glob("shard-*/text_embed.npy"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    corpus.caches.update(truncated=dst.parent, truncated_file=victim)


# --------------------------------------------------------------------------------------------- hostile requests
#: What a hostile client sends python -m serve's JSON API: (method, route, raw body, status, what the one-line
#: error says). Python's JSON reader takes Infinity, NaN and 1e400 (-> inf); a route must refuse them by name.
DEEP = 100_000
HOSTILE_REQUESTS = [
    *[("POST", "knn-service", f'{{"text": "a red circle", "rerank": true, "{field}": {value}}}', 400,
       f"{field} must be a whole number, got {shown}")
      for field in ("num_images", "num_result_ids", "k_candidates", "offset")
      for value, shown in (("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("NaN", "NaN"), ("1e400", "Infinity"),
                           ('"7"', '"7"'))],
    ("POST", "knn-service", '{"text": "a red circle", "where": {"row": 1e400}}', 400, "column row holds int64"),
    ("POST", "knn-service", '{"text": "a red circle", "where": {"row": NaN}}', 400, "column row holds int64"),
    ("POST", "knn-service", "[" * DEEP + "]" * DEEP, 400, "nests deeper than"),
    ("POST", "knn-service", '{"text": ' + "[" * DEEP + "]" * DEEP + "}", 400, "nests deeper than"),
    ("POST", "metadata", '{"ids": ' + "[" * DEEP + "]" * DEEP + "}", 400, "nests deeper than"),
    ("POST", "metadata", '{"ids": [Infinity, NaN]}', 400, "ids must be rows"),
    ("POST", "knn-service", '{"text": "a red circle", "\\ud800": 1}', 400, 'unknown field(s) "\\ud800"'),
    ("POST", "knn-service", '{"text": "a red circle", "indice_name": "\\udfff"}', 400, '"\\udfff" is not served'),
    ("GET", "images/%C2%B2", None, 404, "no image row"),
    ("GET", "images/%D9%A3", None, 404, "no image row"),  # Arabic-Indic three: a digit to isdigit, not to int
    ("GET", "images/99999999999999999999999", None, 404, "no image row"),
]


# --------------------------------------------------------------------------------------------- damaged index files
def flip_bit(path: Path, at: int, bit: int = 0x01) -> None:
    """Flip one bit of byte ``at`` of ``path`` (a failing disk, a bad copy): the size stays."""
    data = bytearray(path.read_bytes())
    data[at] ^= bit
    path.write_bytes(bytes(data))


def overwrite_block(path: Path, at: int, size: int = 4096, seed: int = 0) -> None:
    """Overwrite ``size`` bytes of ``path`` from ``at`` (cut to the file) with random bytes: the size stays."""
    data = bytearray(path.read_bytes())
    at = max(0, min(at, len(data) - size))
    block = np.random.default_rng(seed).integers(0, 256, min(size, len(data) - at), dtype=np.uint8).tobytes()
    data[at:at + len(block)] = block
    path.write_bytes(bytes(data))


#: every way an index file is damaged here: (name, function of the file's path)
INDEX_DAMAGE = {
    "one bit flipped mid-file": lambda p: flip_bit(p, p.stat().st_size // 2),
    "4 KiB overwritten mid-file": lambda p: overwrite_block(p, p.stat().st_size // 2 - 2048),
    "the last byte flipped": lambda p: flip_bit(p, p.stat().st_size - 1, 0x80),
}


def blow_up_a_flat_vector(path: Path, d: int, from_end: int = 1) -> None:
    """Flip the highest exponent bit of the first number of the ``from_end``-th last vector of a FAISS Flat index
    file (its vectors are the file's last n x d little-endian float32 numbers): that number grows by ~2^64 or more,
    the vector's scores become absurd."""
    flip_bit(path, path.stat().st_size - from_end * 4 * d + 3, 0x40)
