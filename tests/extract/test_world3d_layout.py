"""The 3D world on disk (extract/worlds/world3d_layout.py): every controlled image holds its caption by the 3D rules
and none of the other three; captions are true and negatives false of their scenes; the train split never shows a
held-out combination; the What'sUp-layout copy reads back through the one reader; the same seed gives the same bytes
with 1 and 2 workers. One tiny world (40 scenes, 32 px, 2 samples a pixel) shared by the tests."""
import hashlib
import json

import pytest

pytest.importorskip("mitsuba", reason="the 3D world renders with Mitsuba 3 (the render3d extra)")

from extract.worlds import world3d, world3d_layout  # noqa: E402
from extract.worlds.hardworld import satisfies  # noqa: E402
from extract.worlds.shared import CONTROLLED_A, CONTROLLED_B  # noqa: E402
from extract.worlds.shared import heldout_of, is_toyworld  # noqa: E402

HOLDOUT = "red cube,blue sphere"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("w3d") / "world"
    world3d_layout.generate(out, 40, seed=2, size=32, spp=2, holdout=HOLDOUT)
    return out


@pytest.mark.slow
def test_it_is_a_toy_world_with_its_own_vocabulary(world):
    meta = json.loads((world / "meta.json").read_text())
    assert is_toyworld(world) and meta["world"] == "3d" and meta["hard"] is True
    assert heldout_of(world) == {("red", "cube"), ("blue", "sphere")}
    assert "palette" not in meta and set(json.loads((world / "annotations.json").read_text())["meta"]["colours"]) == \
        set(world3d.COLOURS)
    assert meta["counts"]["controlled_sets"] == {"controlled-A": 2, "controlled-B": 2}
    assert sum(meta["counts"]["named_predicates"].values()) == 40
    with pytest.raises(ValueError, match="cube, sphere, cylinder"):
        world3d_layout.parse_holdout3d("red circle")


@pytest.mark.slow
def test_every_controlled_image_holds_its_caption_and_none_of_the_other_three(world):
    for file, predicates in (("controlled_a.json", CONTROLLED_A), ("controlled_b.json", CONTROLLED_B)):
        data = json.loads((world / file).read_text())
        for entry in data["sets"]:
            assert [s["predicate"] for s in entry["scenes"]] == list(predicates)
            cameras = {json.dumps(s["camera"]) for s in entry["scenes"]}
            assert len(cameras) == 1  # one camera for the four arrangements
            for record in entry["scenes"]:
                scene = world3d.scene_from_record(record)  # the 3D rules again, from the saved scene
                strict, lenient = set(world3d.relations(scene)), set(world3d.relations(scene, lenient=True))
                assert (0, record["predicate"], 1) in strict
                assert not [q for q in predicates if q != record["predicate"] and (0, q, 1) in lenient]
                for other in entry["scenes"]:  # and by the tables every reader judges with
                    assert satisfies(record, other["struct"]) == (other is record)
                assert all(o["visible"] >= 1 - world3d.MAX_HIDDEN for o in record["objects"])
                assert (world / record["file_name"]).is_file()


@pytest.mark.slow
def test_captions_are_true_negatives_false_and_train_never_shows_a_held_out_combination(world):
    scenes = {s["image_id"]: s for s in json.loads((world / "annotations.json").read_text())["scenes"]}
    held = {("red", "cube"), ("blue", "sphere")}
    for scene in scenes.values():
        assert all(satisfies(scene, c["struct"]) for c in scene["captions"])
        if scene["split"] == "train":
            assert not held.intersection((o["colour"], o["shape"]) for o in scene["objects"])
        assert scene["named"]["predicate"] in world3d.PREDICATES
    items = json.loads((world / "negatives.json").read_text())["items"]
    assert items and all(not satisfies(scenes[i["image_id"]], n["struct"], lenient=True)
                         for i in items for n in i["negatives"])
    assert {n["type"] for i in items for n in i["negatives"]} >= {"swap-obj", "replace-rel", "replace-obj"}


@pytest.mark.slow
def test_the_whatsup_copy_reads_back_through_the_one_reader(world):
    from train.eval.whatsup import read_whatsup

    for stem, test in (("controlled_images_dataset", "controlled_a.json"), ("controlled_clevr_dataset",
                                                                           "controlled_b.json")):
        bench = read_whatsup(world / "whatsup" / f"{stem}.json")
        written = [s["caption"] for e in json.loads((world / test).read_text())["sets"] for s in e["scenes"]]
        assert [item.texts[0] for item in bench.items] == written
    boxes = json.loads((world / "whatsup" / "objects.json").read_text())
    assert len(boxes) == 16 and all(len(b["objects"]) == 4 for b in boxes)


@pytest.mark.slow
def test_the_pretrain_split_is_the_train_scenes_and_their_objects_crops(world):
    from PIL import Image

    from extract.worlds.hardworld import zero_shot_crop
    from extract.data.sources import ToyWorldSource

    scenes = [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if s["split"] == "train"]
    train, pretrain = ToyWorldSource(world, "train"), ToyWorldSource(world, "pretrain")
    crops = [(s, o) for s in scenes for o in s["objects"]]
    assert all("crop" in o for _, o in crops) and len(pretrain) == len(train) + len(crops)
    assert not ToyWorldSource(world, "pretrain").annotations  # no scene of its own: the adapters read "train"
    captions = {r.source.split("/")[-1]: r.captions for r in pretrain.records() if "objects/" in r.source}
    held = {"red cube", "blue sphere"}
    for scene, obj in crops:
        name = f"{obj['colour']} {obj['shape']}"
        assert name not in held and [c.text for c in captions[obj["crop"].split("/")[-1]]] == [f"a {name}"]
        image = Image.open(world / scene["file_name"]).convert("RGB")
        assert Image.open(world / obj["crop"]).tobytes() == zero_shot_crop(image, obj["box"]).tobytes()
    ids = [c.id for r in pretrain.records() for c in r.captions]
    assert len(ids) == len(set(ids))


@pytest.mark.slow
def test_the_same_seed_gives_the_same_bytes_with_one_and_two_workers(world, tmp_path):
    def digest(folder):
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "meta.json"}

    world3d_layout.generate(tmp_path / "two", 40, seed=2, size=32, spp=2, holdout=HOLDOUT, workers=2)
    assert digest(world) == digest(tmp_path / "two")


@pytest.mark.slow
def test_the_toy_world_command_writes_it_with_world_3d_and_refuses_what_it_cannot_do(tmp_path, capsys):
    from extract.worlds.toyworld import main

    assert main(["--out", str(tmp_path / "w"), "--n", "20", "--world", "3d", "--size", "32", "--spp", "2",
                 "--holdout", "red cube", "--palette", "wide"]) == 0
    printed = capsys.readouterr().out
    assert "toyworld (3d): 20 scenes" in printed and "controlled-A 1 sets" in printed
    meta = json.loads((tmp_path / "w" / "meta.json").read_text())
    assert meta["holdout"] == ["red cube"] and meta["palette"] == "wide"
    # the wide palette: its scenes draw on 24 colours (the train split still never shows a held-out
    # combination), its controlled tests on CLEVR's eight; a CLEVR world's files do not name a palette
    annotations = json.loads((tmp_path / "w" / "annotations.json").read_text())
    objects = [(s["split"], o["colour"], o["shape"]) for s in annotations["scenes"] for o in s["objects"]]
    assert {c for _, c, _ in objects} & set(world3d.EXTRA_COLOURS)
    assert ("train", "red", "cube") not in objects
    assert set(annotations["meta"]["colours"]) == set(world3d.PALETTES["wide"])
    controlled = json.loads((tmp_path / "w" / "controlled_a.json").read_text())
    assert {o["colour"] for st in controlled["sets"] for im in st["scenes"] for o in im["objects"]} <= \
        set(world3d.COLOURS)
    for argv, said in ((["--world", "3d", "--hard"], "--hard is --world hard"),
                       (["--world", "3d", "--long-captions"], "--world 3d has its own scenes"),
                       (["--world", "3d", "--holdout", "red circle"], "shape in cube, sphere, cylinder"),
                       (["--hard", "--spp", "8"], "--spp sets the 3D world's path tracing"),
                       (["--hard", "--palette", "wide"], "--palette sets the 3D world's colours"),
                       (["--language", "wide"], "--language sets the 3D world's captions")):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "x"), *argv])
        assert said in capsys.readouterr().err


def test_the_mixed_palette_draws_clevrs_colours_twice_as_often_and_never_a_held_out_pair_in_train():
    """``--palette mixed``: the wide palette's 24 colours, CLEVR's eight listed twice in the uniform draw, so they
    are about half a train split's objects (a third in ``wide``)."""
    def share(palette, split):
        settings = world3d_layout.Settings3D(10, 0, holdout=world3d_layout.parse_holdout3d(HOLDOUT), palette=palette)
        pairs = world3d_layout.allowed_pairs(settings, split)
        return sum(c in world3d.COLOURS for c, _ in pairs) / len(pairs), pairs

    assert share("clevr", "train")[0] == 1
    assert share("wide", "train")[0] == pytest.approx(22 / 70) and share("wide", "test")[0] == pytest.approx(1 / 3)
    assert share("mixed", "train")[0] == pytest.approx(44 / 92) and share("mixed", "test")[0] == pytest.approx(1 / 2)
    for palette in world3d.PALETTES:
        assert not {("red", "cube"), ("blue", "sphere")} & set(share(palette, "train")[1])
        assert {("red", "cube"), ("blue", "sphere")} <= set(share(palette, "val")[1])
