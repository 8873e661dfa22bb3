"""train/pretrain/data.py: rank-aware deterministic batches, bad input replaced / skipped and counted,
webdataset streaming."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.objectives.clip import CLIPObjective
from extract.worlds import toyworld
from train.pretrain.data import GlobalBatchSampler, SeededTransform, build_train_data


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    toyworld.generate(out, 40, seed=1, workers=1)
    return out


@pytest.fixture(scope="module")
def parts():
    from train.pretrain.trainer import create_model

    _, train_tf, eval_tf, tok = create_model("plugvlm-tiny", False, 0)
    return train_tf, eval_tf, tok


def _data(toy, parts, **kw):
    train_tf, eval_tf, tok = parts
    opts = dict(batch_size=4, rank=0, world_size=1, accum_freq=1, seed=0, tokenizer=tok, objective=CLIPObjective(),
                transform=SeededTransform(train_tf, True), workers=0)
    opts.update(kw)
    return build_train_data(str(toy), **opts)


def test_ranks_split_the_global_batch_of_one_process():
    one = GlobalBatchSampler(50, 8, 0, 1, 1, seed=3)
    ranks = [GlobalBatchSampler(50, 4, r, 2, 1, seed=3) for r in range(2)]
    assert one.steps_per_epoch == ranks[0].steps_per_epoch == 6
    for epoch in (0, 1):
        for s in [one, *ranks]:
            s.set_epoch(epoch)
        for big, a, b in zip(one, *ranks):
            assert big == a + b
    one.set_epoch(0)
    full = list(one)
    one.set_epoch(0, start_step=4)
    assert list(one) == full[4:]  # a resumed epoch continues with exactly the remaining batches
    one.set_epoch(1)
    assert list(one) != full
    seen = [p for batch in full for _, p in batch]
    assert len(set(seen)) == len(seen) == 48  # each image at most once per epoch, the last partial batch dropped
    with pytest.raises(ValueError, match="no full step"):
        GlobalBatchSampler(10, 4, 0, 2, 2, seed=0)


def test_samples_are_deterministic_and_captions_alternate(toy, parts):
    a, b = _data(toy, parts), _data(toy, parts)
    first_a, first_b = next(a.epoch_batches(0, 0))[0], next(b.epoch_batches(0, 0))[0]
    assert torch.equal(first_a["image"], first_b["image"]) and first_a["captions"] == first_b["captions"]
    assert torch.equal(first_a["text"], parts[2](first_a["captions"]))
    # the same image over epochs: random resized crops differ, and several of its captions come up
    dataset = a.loader.dataset
    multi = next(k for k, r in enumerate(dataset.records) if len(r.captions) >= 3)
    items = [dataset[(e, multi)] for e in range(8)]
    assert len({it["caption"] for it in items}) >= 2
    assert not all(torch.equal(items[0]["image"], it["image"]) for it in items[1:])
    assert torch.equal(dataset[(5, multi)]["image"], items[5]["image"])


def test_unreadable_images_are_replaced_and_counted(tmp_path, parts):
    world = tmp_path / "world"
    toyworld.generate(world, 40, seed=1, workers=1)
    data = _data(world, parts)
    bad = data.loader.dataset.records[3]
    Path(bad.source).write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    data = _data(world, parts)
    batches = [m for step in data.epoch_batches(0, 0) for m in step]
    assert all(len(b["image"]) == 4 for b in batches)  # batch shapes never change (ranks gather equal shapes)
    ids = [i for b in batches for i in b["image_ids"]]
    assert bad.image_id not in ids
    counts = data.report.counts()["image"]
    assert sum(counts.values()) == 1, counts
    again = _data(world, parts)
    assert [i for step in again.epoch_batches(0, 0) for m in step for i in m["image_ids"]] == ids


def _shard(path: Path, samples: list[tuple[str, bytes, str | None]]) -> None:
    with tarfile.open(path, "w") as tf:
        for key, image, caption in samples:
            for name, data in ((f"{key}.png", image), (f"{key}.txt", caption.encode() if caption is not None else None)):
                if data is None:
                    continue
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def test_webdataset_stream_skips_bad_samples_and_keeps_batches_full(toy, tmp_path, parts):
    pngs = sorted((toy / "images").glob("*.png"))
    good = [(f"s{k:03d}", p.read_bytes(), f"caption {k}") for k, p in enumerate(pngs[:24])]
    _shard(tmp_path / "00000.tar", good[:12] + [("bad1", b"not an image", "x")])
    _shard(tmp_path / "00001.tar", good[12:] + [("nocap", pngs[0].read_bytes(), None)])
    spec = str(tmp_path / "{00000..00001}.tar")
    with pytest.raises(ValueError, match="--train-num-samples"):
        _data(spec, parts)
    data = _data(spec, parts, train_num_samples=40, shuffle_buffer=8, workers=1)
    assert data.kind == "stream" and data.steps_per_epoch == 10
    batches = [m for epoch in range(2) for step in data.epoch_batches(epoch, 0) for m in step]
    assert len(batches) == 20 and all(len(b["image"]) == 4 for b in batches)
    assert {i for b in batches for i in b["image_ids"]} <= {k for k, _, _ in good}
    skipped = data.report.counts()["image"]
    assert sum(skipped.values()) == 2, skipped  # the undecodable image and the sample without a caption
    first = next(_data(spec, parts, train_num_samples=40, shuffle_buffer=8).epoch_batches(0, 0))[0]
    again = next(_data(spec, parts, train_num_samples=40, shuffle_buffer=8).epoch_batches(0, 0))[0]
    assert first["image_ids"] == again["image_ids"]


def test_converted_images_are_noted_once_however_often_they_are_drawn(toy, tmp_path, parts):
    """Images are decoded (and converted) in the data-loader workers, whose own reports never reach the main process:
    the notes travel with the batches (train.pretrain.engine's data_report.json said "converted 0 images"), and an image
    drawn in several batches and epochs is noted once."""
    from fixtures import bad_inputs as bi

    encoded = bi.encoded_images()
    pngs = sorted((toy / "images").glob("*.png"))
    samples = [(f"s{k:03d}", p.read_bytes(), f"caption {k}") for k, p in enumerate(pngs[:9])]
    samples += [(name.split(".")[0], encoded[name], f"a {name}") for name in bi.CONVERTED]
    _shard(tmp_path / "00000.tar", samples)
    data = _data(str(tmp_path / "00000.tar"), parts, train_num_samples=24, workers=1)
    converted = {name.split(".")[0] for name in bi.CONVERTED}
    drawn = [i for epoch in range(2) for step in data.epoch_batches(epoch, 0) for m in step for i in m["image_ids"]]
    assert sum(i in converted for i in drawn) > len(converted)  # drawn more than once each, on average
    assert sorted(n.image_id for n in data.report.notes) == sorted(converted)
    assert sum(data.report.counts()["converted"].values()) == len(converted)


def _stream_shards(toy: Path, folder: Path) -> str:
    """Two small shards (a bad image in one, a sample without caption in the other); returns their pattern."""
    pngs = sorted((toy / "images").glob("*.png"))
    good = [(f"s{k:03d}", p.read_bytes(), f"caption {k}") for k, p in enumerate(pngs[:24])]
    _shard(folder / "00000.tar", good[:7] + [("bad1", b"not an image", "x")] + good[7:12])
    _shard(folder / "00001.tar", good[12:20] + [("nocap", pngs[0].read_bytes(), None)] + good[20:])
    return str(folder / "{00000..00001}.tar")


def _steps(data, start: int, stop: int) -> list[list[dict]]:
    """Optimizer steps ``start .. stop - 1`` counted over epochs, each its list of micro-batches."""
    out = []
    epoch, in_epoch = divmod(start, data.steps_per_epoch)
    while start + len(out) < stop:
        for micro in data.epoch_batches(epoch, in_epoch):
            out.append(micro)
            if start + len(out) == stop:
                break
        epoch, in_epoch = epoch + 1, 0
    return out


def _same(a: list[list[dict]], b: list[list[dict]]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b, strict=True):
            assert x["image_ids"] == y["image_ids"] and x["captions"] == y["captions"]
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["text"], y["text"])


@pytest.mark.parametrize("workers, accum, resampled, stops", [(0, 1, True, (3, 9)), (2, 1, False, (5, 8)),
                                                               (2, 2, True, (7, 11))])
@pytest.mark.slow
def test_a_resumed_stream_sees_the_samples_of_the_uninterrupted_run(toy, tmp_path, parts, workers, accum, resampled,
                                                                    stops):
    spec = _stream_shards(toy, tmp_path)
    kw = dict(train_num_samples=48, shuffle_buffer=5, workers=workers, accum_freq=accum, resampled=resampled)
    total = 14
    reference = _steps(_data(spec, parts, **kw), 0, total)  # crosses epochs (12 or 6 steps each)
    assert len({i for step in reference for m in step for i in m["image_ids"]}) > 8
    # stopped after stops[0] steps, resumed, stopped again after stops[1], resumed again
    data, seen, state = _data(spec, parts, **kw), [], None
    for stop in (*stops, total):
        start = state["step"] if state else 0
        seen += _steps(data, start, stop)
        state = {"step": stop, "data_state": data.resume_state(stop)}  # what the checkpoint stores
        data = _data(spec, parts, resume_state=state, **kw)
        assert data.description["resume"].startswith("exact")
    _same(seen, reference)
    assert state["data_state"]["micro_batches"] == total * accum
    # another layout cannot continue exactly: said, and the stream still moves on
    other = _data(spec, parts, resume_state=state, **{**kw, "shuffle_buffer": 6})
    assert other.description["resume"].startswith("approximate: shuffle_buffer changed")


def test_seeded_transform_repeats_its_crop(parts):
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 96, 3), dtype=np.uint8))
    t = SeededTransform(parts[0], True)
    assert torch.equal(t(image, 7), t(image, 7)) and not torch.equal(t(image, 7), t(image, 8))
    assert torch.equal(SeededTransform(parts[1], False)(image, 1), parts[1](image))
