"""serve.stage2: stored re-ranking representations equal the per-query encoding they replace (the reference), the
writer keeps rows in order and gives up cleanly (shapes padded per batch, over budget), and a damaged store is
refused on open."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from serve.stage2 import Stage2Store, Stage2Writer, file_name
from fixtures.serve import QUERY, serve_setup


def _reps(a: int, b: int, width: int = 3) -> dict:
    rows = torch.arange(a, b, dtype=torch.float32)[:, None]
    return {"global": rows * torch.ones(1, width), "entity": rows[:, :, None] * torch.ones(1, 2, width),
            "entity_valid": (torch.arange(a, b)[:, None] % 2 == 0) & torch.ones(1, 2, dtype=torch.bool)}


def test_rows_come_back_in_any_order_at_their_dtype(tmp_path):
    w = Stage2Writer(tmp_path, "image", 10, max_bytes=None)
    for a in range(0, 10, 4):
        w.add(_reps(a, min(a + 4, 10)))
    entry, names = w.finish()
    assert entry["stored"] and sorted(names) == sorted(file_name("image", k) for k in ("global", "entity",
                                                                                      "entity_valid"))
    store = Stage2Store.open(tmp_path, "image", entry, 10)
    rows = np.array([7, 0, 7, 3])
    got, want = store.take(rows, "cpu"), _reps(0, 10)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k][torch.as_tensor(rows)])


def test_a_shape_padded_per_batch_or_over_budget_is_not_stored(tmp_path):
    w = Stage2Writer(tmp_path, "text", 6, max_bytes=None)
    w.add({"tokens": torch.zeros(3, 5, 2)})
    w.add({"tokens": torch.zeros(3, 7, 2)})  # padded to this batch's longest caption
    entry, names = w.finish()
    assert not entry["stored"] and "changes shape" in entry["reason"] and names == []
    assert not list(tmp_path.glob("*.npy"))  # nothing half-written left behind
    w = Stage2Writer(tmp_path, "image", 1000, max_bytes=1000)
    w.add(_reps(0, 10))
    entry, _ = w.finish()
    assert not entry["stored"] and "--stage2-max-bytes" in entry["reason"]
    w = Stage2Writer(tmp_path, "image", 10, max_bytes=None)
    w.add(_reps(0, 4))
    assert "only 4 of 10" in w.finish()[0]["reason"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return serve_setup(tmp_path_factory)


def test_stored_reranking_equals_encoding_the_candidates(setup):
    """The adapter index (built with --stage2 auto) stores both sides; searching with the store gives the same hits
    and re-ranked scores as encoding the candidates from the cache (the store switched off)."""
    from serve.search import Searcher

    manifest = json.loads((setup.adapter_index / "manifest.json").read_text())
    assert all(manifest["indexes"][side]["stage2"]["stored"] for side in ("image", "text"))
    fast = Searcher.open(setup.adapter_index)
    slow = Searcher.open(setup.adapter_index, scorer=fast.scorer)
    for side in slow._sides.values():
        side.stage2 = None
    image = sorted(setup.world.glob("images/*.png"))[3]
    for a, b in ((fast.search_text(QUERY, k=8, rerank=40), slow.search_text(QUERY, k=8, rerank=40)),
                 (fast.search_image(image, k=8, rerank=40), slow.search_image(image, k=8, rerank=40))):
        assert [h.row for h in a] == [h.row for h in b]
        np.testing.assert_allclose([h.rerank_score for h in a], [h.rerank_score for h in b], rtol=1e-5, atol=1e-6)


def test_an_encoded_index_and_a_damaged_store(setup, tmp_path):
    from serve.index import IndexOptions, build_index
    from serve.layout import IndexDirError
    from serve.search import Searcher

    out = tmp_path / "encoded"
    build_index(IndexOptions(model=str(setup.run), data=str(setup.world), out=str(out), kind="flat", stage2="encoded",
                             cache_dir=str(setup.root / "serve-cache"), workers=0))
    manifest = json.loads((out / "manifest.json").read_text())
    assert "stage2" not in manifest["indexes"]["image"] and not list(out.glob("*.stage2.*"))
    assert [h.row for h in Searcher.open(out).search_text(QUERY, k=5, rerank=30)] == \
        [h.row for h in Searcher.open(setup.adapter_index).search_text(QUERY, k=5, rerank=30)]
    damaged = tmp_path / "damaged"
    shutil.copytree(setup.adapter_index, damaged)
    victim = next(damaged.glob("image.stage2.*.npy"))
    victim.write_bytes(victim.read_bytes()[:-64])
    with pytest.raises(IndexDirError, match=victim.name):
        Searcher.open(damaged)
