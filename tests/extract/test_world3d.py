"""The 3D world (extract/worlds/world3d.py): boxes from the renderer's id pass match the camera's projection,
relations follow the 3D rules, stacked objects rest on a top, and a seed gives the same bytes with 1 and 2 workers.
Tiny scenes only (32-48 px, a few samples a pixel)."""
import hashlib

import numpy as np
import pytest

pytest.importorskip("mitsuba", reason="the 3D world renders with Mitsuba 3 (the render3d extra)")

from extract.worlds import world3d  # noqa: E402
from extract.worlds.world3d import Camera, Object3D, Scene3D  # noqa: E402

SIZE = 48


def _scene(*objects: Object3D) -> Scene3D:
    return Scene3D(list(objects), Camera((0.0, -10.0, 6.0), (0.0, 0.0, 0.4)), (-0.3, 0.4, -0.9))


def test_an_unoccluded_objects_box_is_its_projected_3d_box_within_a_pixel():
    checked = 0
    for index in range(6):
        scene, vis = world3d.build_scene(7, index, SIZE)
        for k, v in enumerate(vis):
            px = world3d.projected_box(scene, k, SIZE)
            if v["hidden"] > 0 or min(px) < 0 or max(px) > SIZE:
                continue  # hidden in part, or cut by the frame: its visible box is smaller by construction
            assert np.allclose(v["box"], px, atol=1.0), (index, k, v["box"], px)
            checked += 1
    assert checked >= 10


def test_relations_follow_the_3d_rules():
    left = Object3D("red", "cube", "large", "rubber", -2.0, 0.0)
    right = Object3D("blue", "sphere", "small", "metal", 2.0, 0.0)
    on_top = Object3D("green", "cylinder", "small", "rubber", -2.0, 0.0, z=left.top, support=0)
    near = Object3D("cyan", "sphere", "small", "rubber", 2.0, -2.5)  # nearer the camera than `right`, same side
    rel = set(world3d.relations(_scene(left, right, on_top, near)))
    assert {(0, "left of", 1), (1, "right of", 0), (2, "on", 0), (0, "under", 2),
            (3, "in front of", 1), (1, "behind", 3)} <= rel
    assert rel <= set(world3d.relations(_scene(left, right, on_top, near), lenient=True))
    assert not {r for r in rel if r[0] == 2 and r[1] not in ("on",)}  # the stacked object: on its base, nothing else
    # the image agrees with the camera frame: the left object's pixels lie left of the right one's
    vis = world3d.visibility(_scene(left, right, on_top, near), SIZE)
    assert vis[0]["box"][2] <= vis[1]["box"][0] and vis[2]["box"][3] <= vis[0]["box"][3]


def test_stacked_objects_rest_on_a_flat_top_and_nothing_interpenetrates():
    stacked = 0
    for index in range(30):
        scene = world3d.random_scene(np.random.default_rng([3, index]), 8)
        for k, obj in enumerate(scene.objects):
            if obj.support is not None:
                base = scene.objects[obj.support]
                assert base.shape in world3d.FLAT_TOPS and base.support is None and obj.z == pytest.approx(base.top)
                assert np.hypot(obj.x - base.x, obj.y - base.y) <= base.half
                stacked += 1
            for j, other in enumerate(scene.objects):  # any other pair: footprints apart, or one wholly above
                if j == k or obj.support == j or other.support == k:
                    continue
                apart = np.hypot(obj.x - other.x, obj.y - other.y) >= obj.reach + other.reach
                assert apart or obj.z >= other.top - 1e-6 or other.z >= obj.top - 1e-6, (index, k, j)
    assert stacked >= 5


def test_a_seed_gives_the_same_bytes_with_one_and_two_workers(tmp_path):
    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}

    one = world3d.generate(tmp_path / "one", 4, seed=5, size=32, spp=4, workers=1)
    two = world3d.generate(tmp_path / "two", 4, seed=5, size=32, spp=4, workers=2)
    assert one == two and digest(tmp_path / "one") == digest(tmp_path / "two")
    assert all(0 < len(r["objects"]) <= 8 and all(o["hidden"] <= world3d.MAX_HIDDEN for o in r["objects"])
               for r in one)


def test_the_wide_palettes_colours_are_as_far_apart_as_clevrs_closest_two():
    """``--palette wide`` adds colours for pre-training a base; none may be a held-out colour renamed, so every pair
    of the 24 lies at least as far apart (CIE L*a*b*) as CLEVR's closest pair, blue and purple."""
    assert np.allclose(world3d.lab((255, 255, 255)), (100, 0, 0), atol=0.1)
    assert np.allclose(world3d.lab((0, 0, 0)), (0, 0, 0), atol=1e-6)

    def closest(colours):
        names = list(colours)
        return min(float(np.linalg.norm(world3d.lab(colours[a]) - world3d.lab(colours[b])))
                   for i, a in enumerate(names) for b in names[i + 1:])

    clevr = closest(world3d.COLOURS)
    assert 26 < clevr < 27  # blue / purple
    wide = world3d.PALETTES["wide"]
    assert len(wide) == 24 and list(wide)[:8] == list(world3d.COLOURS)
    assert closest(wide) >= clevr


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_render_workers_end_when_their_parent_is_killed(tmp_path):
    """A render's parent killed by SIGKILL runs no clean-up: its spawned workers must not render on for nobody."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "napper.py").write_text(
        "import os, time\n"
        "def nap(folder):\n"
        "    open(os.path.join(folder, str(os.getpid())), 'w').close()\n"
        "    time.sleep(120)\n")
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
              "from napper import nap\nfrom extract.worlds.world3d import map_jobs\n"
              f"map_jobs(nap, [{str(tmp_path)!r}] * 4, 2)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=str(world3d.__file__).rsplit("/extract/", 1)[0],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the workers' start, not waiting for an effect
    workers = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(workers) == 2, "the workers did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"render workers {left} outlived their killed parent"
