"""The 3D world (issue 69, its first part): CLEVR's objects on a floor, path-traced by Mitsuba 3.

Every image the other worlds draw is flat: depth is drawing order, support is two boxes touching, the camera never
moves. Here a scene is a set of 3D objects (CLEVR's vocabulary, Johnson et al. 2017: eight colours, cube / sphere /
cylinder, two sizes, rubber and metal) resting on a floor or on another object's flat top, seen by a perspective
camera whose viewpoint is jittered, lit by a jittered sun (hard shadows) and a dim sky, and rendered by a real
path tracer (Mitsuba 3's CPU variant ``scalar_rgb``; ``pip install mitsuba``, the ``render3d`` extra).

What a scene gives, each from the 3D scene or the renderer, never from a caption:

- **the image**: ``render`` path-traces it (``spp`` samples a pixel, 4 bounces), tone-mapped to 8-bit sRGB;
- **which object each pixel shows**: the renderer's ``aov`` integrator writes every pixel's shape index (one sample
  at each pixel centre's jitter, seeded like the image), from which each object's visible mask and box follow; the
  same pass with the object alone gives the pixels it would cover unhidden, so its hidden share is counted, not
  guessed (:func:`visibility`);
- **relations in the camera's frame** (:func:`relations`): "on" / "under" from what rests on what; "left of" /
  "right of" from the two centres' offset along the camera's right axis; "in front of" / "behind" from
  their offset along its viewing direction (nearer is in front). A pair whose offset is neither clearly sideways nor
  clearly in depth gets no relation: a caption never says what the scene leaves ambiguous.

Each scene is drawn from its own generator (``numpy.random.default_rng([seed, index])``) and rendered with its own
seed, so its bytes depend on (seed, index) alone, not on the worker that made it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from extract.common.cli import option as _option
from extract.common.config import nonnegative_int as _nonnegative
from extract.common.config import positive_int as _positive

# CLEVR's colours (its properties.json, sRGB 0-255) and sizes (half the side of a cube, a sphere's radius)
COLOURS = {"gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
           "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}
# More colours, for pre-training a base only (``--palette wide``): each at least as far from every other colour of
# the palette (CIE L*a*b*, D65) as CLEVR's two closest, blue and purple (26.4), so none is a held-out colour
# renamed. CLEVR-CoGenT's lesson is that a model meets held-out colour-shape combinations with the shapes its colours
# came with; a base that has seen twenty-four colours on every shape, not eight, has more reason to keep shape apart
# from colour (extract/models/bases/README.md, the 3D bases). A wide world's controlled tests stay CLEVR's, and the
# bases are scored on CLEVR worlds.
EXTRA_COLOURS = {"orange": (255, 128, 0), "pink": (255, 130, 200), "white": (225, 225, 225), "black": (22, 22, 22),
                 "lime": (150, 235, 30), "navy": (20, 25, 105), "teal": (0, 120, 120), "magenta": (225, 30, 190),
                 "maroon": (105, 10, 40), "olive": (120, 125, 0), "beige": (215, 190, 140), "salmon": (250, 128, 114),
                 "lavender": (190, 170, 240), "mint": (160, 240, 180), "rose": (230, 70, 120), "plum": (120, 50, 100)}
WIDE = {**COLOURS, **EXTRA_COLOURS}
PALETTES = {"clevr": COLOURS, "wide": WIDE, "mixed": WIDE}
# How many times each colour's (colour, shape) pairs enter the draw (absent: once). ``mixed`` is ``wide`` with CLEVR's
# colours twice as likely, so they are about half a train split's objects (a third in ``wide``): a base fine-tuned
# on ``wide`` names held-out combinations better but seen ones worse (extract/models/bases/README.md).
DRAWS = {"mixed": {c: 2 for c in COLOURS}}
SHAPES = ("cube", "sphere", "cylinder")
SIZES = {"small": 0.35, "large": 0.7}
MATERIALS = ("rubber", "metal")
FLAT_TOPS = ("cube", "cylinder")  # what another object can rest on
PREDICATES = ("left of", "right of", "on", "under", "in front of", "behind")  # said with hardworld.WORDS
MAX_HIDDEN = 0.75  # a named object may be hidden up to three quarters of its pixels, as a rear object in a photograph
# objects' centres on the floor lie in [-ARENA, ARENA]^2. With the camera 7.5-9 units away a small object's box is
# about 15 px of a 96 px image and a large one's 28 (16-29% of the side, as the hard world's objects): at 3.0 and
# 10-12 units they were 11 and 21 px, and a base fine-tuned on those crops told cube from cylinder at 66%.
ARENA = 2.5


def require_mitsuba():
    """Mitsuba 3 on its CPU variant; ImportError naming the extra when it is not installed."""
    try:
        import mitsuba as mi
    except ImportError as err:  # the extra, named
        raise ImportError("the 3D world renders with Mitsuba 3: pip install 'plugvlm[render3d]' (or pip install "
                          "mitsuba)") from err
    if mi.variant() != "scalar_rgb":
        mi.set_variant("scalar_rgb")  # the CPU variant every wheel carries; no GPU, nothing compiled at run time
    return mi


@dataclass(frozen=True)
class Camera:
    """A pinhole camera looking from ``origin`` at ``target`` (z up), horizontal field of view ``fov`` degrees."""

    origin: tuple[float, float, float]
    target: tuple[float, float, float]
    fov: float = 40.0

    def axes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(right, up, forward) unit vectors in world coordinates."""
        forward = np.subtract(self.target, self.origin).astype(float)
        forward /= np.linalg.norm(forward)
        right = np.cross(forward, (0.0, 0.0, 1.0))
        right /= np.linalg.norm(right)
        return right, np.cross(right, forward), forward

    def to_camera(self, points: np.ndarray) -> np.ndarray:
        """World points [N, 3] -> camera coordinates [N, 3]: (right, up, forward)."""
        rel = np.asarray(points, dtype=float).reshape(-1, 3) - np.asarray(self.origin, dtype=float)
        return rel @ np.stack(self.axes(), axis=1)

    def project(self, points: np.ndarray, width: int, height: int) -> np.ndarray:
        """World points [N, 3] -> pixel coordinates [N, 2] (x right, y down; pixel i spans [i, i + 1))."""
        cam = self.to_camera(points)
        focal = (width / 2) / math.tan(math.radians(self.fov) / 2)
        x = width / 2 + focal * cam[:, 0] / cam[:, 2]
        y = height / 2 - focal * cam[:, 1] / cam[:, 2]
        return np.stack([x, y], axis=1)


@dataclass
class Object3D:
    """One object: what it is, where its base sits (x, y, z of the bottom centre), its turn about z (degrees), and
    the index of the object it rests on (None: the floor)."""

    colour: str
    shape: str
    size: str
    material: str
    x: float
    y: float
    z: float = 0.0
    angle: float = 0.0
    support: int | None = None

    @property
    def half(self) -> float:
        return SIZES[self.size]

    @property
    def centre(self) -> np.ndarray:
        return np.array([self.x, self.y, self.z + self.half])

    @property
    def top(self) -> float:
        return self.z + 2 * self.half

    @property
    def reach(self) -> float:
        """The radius of its footprint: what two objects side by side must keep apart."""
        return self.half * (math.sqrt(2) if self.shape == "cube" else 1.0)

    def surface(self, n: int = 48) -> np.ndarray:
        """Points on its surface, dense enough that their projection's box is its silhouette's within a pixel at
        the sizes rendered here (a cube: its 8 corners, exactly)."""
        h, c = self.half, self.centre
        if self.shape == "cube":
            corners = np.array([[sx, sy, sz] for sx in (-h, h) for sy in (-h, h) for sz in (-h, h)])
            turn = math.radians(self.angle)
            rot = np.array([[math.cos(turn), -math.sin(turn), 0], [math.sin(turn), math.cos(turn), 0], [0, 0, 1]])
            return corners @ rot.T + c
        t = np.linspace(0, 2 * math.pi, n, endpoint=False)
        if self.shape == "cylinder":
            rim = np.stack([h * np.cos(t), h * np.sin(t), np.zeros_like(t)], axis=1)
            return np.concatenate([rim + c - (0, 0, h), rim + c + (0, 0, h)])
        u, v = np.meshgrid(t, np.linspace(0, math.pi, n // 2 + 1))  # a sphere: a latitude-longitude grid
        pts = np.stack([np.sin(v) * np.cos(u), np.sin(v) * np.sin(u), np.cos(v)], axis=-1).reshape(-1, 3)
        return h * pts + c

    def to_dict(self) -> dict:
        return {"colour": self.colour, "shape": self.shape, "size": self.size, "material": self.material,
                "position": [round(self.x, 4), round(self.y, 4), round(self.z, 4)], "angle": round(self.angle, 2),
                "support": self.support}


@dataclass
class Scene3D:
    objects: list[Object3D]
    camera: Camera
    sun: tuple[float, float, float]  # direction the light travels
    sun_power: float = 3.0
    sky: float = 0.3
    floor: float = 0.45
    seed: int = 0  # the renderer's


# ------------------------------------------------------------------------------------------------- sampling
def random_camera(rng: np.random.Generator) -> Camera:
    """CLEVR's kind of view, jittered: from the front, 25-40 degrees above the floor, 7.5-9 units away (ARENA)."""
    azimuth, elevation = math.radians(rng.uniform(-20, 20)), math.radians(rng.uniform(25, 40))
    dist = rng.uniform(7.5, 9)
    origin = (dist * math.cos(elevation) * math.sin(azimuth), -dist * math.cos(elevation) * math.cos(azimuth),
              dist * math.sin(elevation))
    return Camera(tuple(round(v, 4) for v in origin), (0.0, 0.0, 0.4), 40.0)


def clear_of(obj: Object3D, placed: Sequence[Object3D], skip: int | None = None, gap: float = 0.15) -> bool:
    """No overlap with any placed object but ``skip`` (the one it rests on): footprints apart by ``gap``, or one
    wholly above the other."""
    for k, other in enumerate(placed):
        if k == skip:
            continue
        apart = math.hypot(obj.x - other.x, obj.y - other.y) >= obj.reach + other.reach + gap
        above = obj.z >= other.top - 1e-6 or other.z >= obj.top - 1e-6
        if not (apart or above):
            return False
    return True


def place(rng: np.random.Generator, obj: Object3D, placed: list[Object3D], stack: float = 0.25,
          tries: int = 60) -> bool:
    """Put ``obj`` on the floor or, with probability ``stack``, on a flat top that can carry it (at least its size,
    itself on the floor, nothing on it yet); False when nowhere fits."""
    carriers = [k for k, o in enumerate(placed) if o.shape in FLAT_TOPS and o.support is None and o.half >= obj.half
                and not any(p.support == k for p in placed)]
    if carriers and rng.random() < stack:
        k = int(rng.choice(carriers))
        base = placed[k]
        slack = max(base.half - obj.reach, 0.0) * 0.5  # rests well inside the top
        obj.x, obj.y = base.x + rng.uniform(-slack, slack), base.y + rng.uniform(-slack, slack)
        obj.z, obj.support = base.top, k
        if clear_of(obj, placed, skip=k):
            return True
        obj.support = None
    obj.z = 0.0
    for _ in range(tries):
        obj.x, obj.y = rng.uniform(-ARENA, ARENA), rng.uniform(-ARENA, ARENA)
        if clear_of(obj, placed):
            return True
    return False


def lab(rgb: Sequence[int]) -> np.ndarray:
    """CIE L*a*b* (D65) of an 8-bit sRGB colour: distances there are how far apart colours look."""
    c = np.asarray(rgb, dtype=float) / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ c
    f = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(f > 216 / 24389, np.cbrt(f), (24389 / 27 * f + 16) / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def random_object(rng: np.random.Generator, allowed: Sequence[tuple[str, str]] | None = None) -> Object3D:
    colour, shape = (allowed[int(rng.integers(len(allowed)))] if allowed else
                     (str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))))
    return Object3D(colour, shape, str(rng.choice(list(SIZES))), str(rng.choice(MATERIALS)), 0.0, 0.0,
                    angle=float(rng.uniform(0, 90)) if shape == "cube" else 0.0)


def random_scene(rng: np.random.Generator, count: int, *, seed: int = 0,
                 allowed: Sequence[tuple[str, str]] | None = None) -> Scene3D:
    """``count`` objects (fewer where the floor is full), a jittered camera, sun and sky."""
    placed: list[Object3D] = []
    for _ in range(count):
        obj = random_object(rng, allowed)
        if place(rng, obj, placed):
            placed.append(obj)
    azimuth, elevation = rng.uniform(0, 2 * math.pi), math.radians(rng.uniform(35, 70))
    sun = (-math.cos(elevation) * math.cos(azimuth), -math.cos(elevation) * math.sin(azimuth), -math.sin(elevation))
    return Scene3D(placed, random_camera(rng), tuple(round(v, 4) for v in sun), float(rng.uniform(2.5, 3.5)),
                   float(rng.uniform(0.25, 0.4)), float(rng.uniform(0.35, 0.55)), seed)


# ------------------------------------------------------------------------------------------------- relations
def relations(scene: Scene3D, lenient: bool = False) -> list[tuple[int, str, int]]:
    """Every (subject, predicate, object) the 3D scene makes true, in the camera's frame (module docstring), with
    the predicates of :data:`PREDICATES`. Strict: a stacked pair is on / under and nothing else, a pair beside a
    stack gets no direction, and a direction needs an offset of at least the two footprints' radii, twice the other
    axis's. ``lenient``: any direction the offsets lean to (a quarter of that, at most twice the other axis's), for
    every pair: what a hard negative must not be even leniently (``hardworld.satisfies``)."""
    out = []
    objs = scene.objects
    cam = scene.camera.to_camera(np.stack([o.centre for o in objs])) if objs else np.zeros((0, 3))
    reach, ratio = (0.25, 2.0) if lenient else (1.0, 0.5)
    for i, a in enumerate(objs):
        for j, b in enumerate(objs):
            if i == j:
                continue
            if a.support == j or b.support == i:
                out.append((i, "on" if a.support == j else "under", j))
                if not lenient:
                    continue
            elif not lenient and (a.support is not None or b.support is not None):
                continue  # a stack beside something: its two levels say no more than the stack's base does
            side, depth = cam[i, 0] - cam[j, 0], cam[i, 2] - cam[j, 2]
            apart = reach * (a.reach + b.reach)
            if abs(side) >= apart and abs(depth) <= ratio * abs(side):
                out.append((i, "left of" if side < 0 else "right of", j))
            if abs(depth) >= apart and abs(side) <= ratio * abs(depth):
                out.append((i, "in front of" if depth < 0 else "behind", j))
    return out


# ------------------------------------------------------------------------------------------------- rendering
def _linear(rgb: Sequence[int]) -> list[float]:
    return [round((c / 255) ** 2.2, 5) for c in rgb]


def _bsdf(obj: Object3D) -> dict:
    colour = {"type": "rgb", "value": _linear(WIDE[obj.colour])}
    if obj.material == "metal":
        return {"type": "roughconductor", "material": "none", "alpha": 0.15, "specular_reflectance": colour}
    return {"type": "diffuse", "reflectance": colour}


def _shapes(mi, index: int, obj: Object3D, with_bsdf: bool = True) -> dict:
    """The Mitsuba shapes of one object, keyed ``o<index>...`` (a cylinder is its side and a top cap)."""
    T, h, c = mi.ScalarTransform4f, obj.half, obj.centre
    bsdf = {"bsdf": _bsdf(obj)} if with_bsdf else {}
    if obj.shape == "sphere":
        return {f"o{index}": {"type": "sphere", "center": c.tolist(), "radius": h, **bsdf}}
    if obj.shape == "cube":
        world = T().translate(c.tolist()).rotate([0, 0, 1], obj.angle).scale(h)
        return {f"o{index}": {"type": "cube", "to_world": world, **bsdf}}
    return {f"o{index}": {"type": "cylinder", "p0": (c - (0, 0, h)).tolist(), "p1": (c + (0, 0, h)).tolist(),
                          "radius": h, **bsdf},
            f"o{index}cap": {"type": "disk", "to_world": T().translate((c + (0, 0, h)).tolist()).scale(h), **bsdf}}


def _sensor(mi, camera: Camera, width: int, height: int, spp: int) -> dict:
    return {"type": "perspective", "fov": camera.fov, "fov_axis": "x",
            "to_world": mi.ScalarTransform4f().look_at(origin=list(camera.origin), target=list(camera.target),
                                                       up=[0, 0, 1]),
            "film": {"type": "hdrfilm", "width": width, "height": height, "rfilter": {"type": "box"},
                     "pixel_format": "rgb"},
            "sampler": {"type": "independent", "sample_count": spp}}


def render(scene: Scene3D, size: int = 96, spp: int = 32) -> np.ndarray:
    """The path-traced image, [size, size, 3] uint8 sRGB."""
    mi = require_mitsuba()
    spec = {"type": "scene", "integrator": {"type": "path", "max_depth": 4},
            "sensor": _sensor(mi, scene.camera, size, size, spp),
            "sun": {"type": "directional", "direction": list(scene.sun),
                    "irradiance": {"type": "rgb", "value": scene.sun_power}},
            "sky": {"type": "constant", "radiance": {"type": "rgb", "value": scene.sky}},
            "floor": {"type": "rectangle", "to_world": mi.ScalarTransform4f().scale(30),
                      "bsdf": {"type": "diffuse", "reflectance": {"type": "rgb", "value": scene.floor}}}}
    for k, obj in enumerate(scene.objects):
        spec.update(_shapes(mi, k, obj))
    image = mi.render(mi.load_dict(spec), seed=scene.seed)
    return np.asarray(mi.util.convert_to_bitmap(image), dtype=np.uint8)[..., :3]


def id_pass(scene: Scene3D, size: int = 96, only: int | None = None) -> np.ndarray:
    """Which object each pixel shows: [size, size] int, -1 for the floor or the sky (``only``: that object alone)."""
    mi = require_mitsuba()
    spec = {"type": "scene", "integrator": {"type": "aov", "aovs": "id:shape_index"},
            "sensor": _sensor(mi, scene.camera, size, size, 1)}
    for k, obj in enumerate(scene.objects):
        if only is None or k == only:
            spec.update(_shapes(mi, k, obj, with_bsdf=False))
    loaded = mi.load_dict(spec)
    owner = np.array([-1] + [int(s.id()[1:].removesuffix("cap")) for s in loaded.shapes()])
    index = np.asarray(mi.render(loaded, seed=scene.seed))[..., 0].astype(int)
    return owner[index]


def visibility(scene: Scene3D, size: int = 96) -> list[dict]:
    """Per object: its visible box [x0, y0, x1, y1) in pixels (None when unseen), visible and unhidden pixel
    counts, and the hidden share (1 - visible / unhidden)."""
    ids = id_pass(scene, size)
    out = []
    for k in range(len(scene.objects)):
        mask = ids == k
        whole = int((id_pass(scene, size, only=k) == k).sum())
        seen = int(mask.sum())
        ys, xs = np.nonzero(mask)
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if seen else None
        out.append({"box": box, "visible": seen, "whole": whole,
                    "hidden": round(1 - seen / whole, 4) if whole else 1.0})
    return out


def projected_box(scene: Scene3D, index: int, size: int = 96) -> list[float]:
    """The box of an object's 3D surface projected by the camera: [x0, y0, x1, y1] in pixels."""
    pts = scene.camera.project(scene.objects[index].surface(), size, size)
    return [float(pts[:, 0].min()), float(pts[:, 1].min()), float(pts[:, 0].max()), float(pts[:, 1].max())]


def scene_from_record(record: dict) -> Scene3D:
    """The 3D scene of a saved record (its ``objects`` as :meth:`Object3D.to_dict` writes them and its ``camera``):
    what a reader needs to judge a caption by the 3D rules again (the light is not kept: no rule reads it)."""
    objects = [Object3D(o["colour"], o["shape"], o["size"], o["material"], *o["position"], angle=o["angle"],
                        support=o["support"]) for o in record["objects"]]
    cam = record["camera"]
    return Scene3D(objects, Camera(tuple(cam["origin"]), tuple(cam["target"]), cam["fov"]), (0.0, 0.0, -1.0))


# ------------------------------------------------------------------------------------------------- a world
def build_scene(seed: int, index: int, size: int = 96, tries: int = 40,
                allowed: Sequence[tuple[str, str]] | None = None,
                need_relation: bool = False) -> tuple[Scene3D, list[dict]]:
    """Scene ``index`` of the world of ``seed``: 2-8 objects (``allowed``: of these (colour, shape) only), redrawn
    (from the scene's own generator) until every object lies inside the frame, shows, and is hidden by no more than
    :data:`MAX_HIDDEN` (``need_relation``: and some pair is strictly related); (scene, its :func:`visibility`)."""
    rng = np.random.default_rng([seed, index])
    for _ in range(tries):
        scene = random_scene(rng, int(rng.integers(2, 9)), seed=(seed * 1_000_003 + index) % 2**31, allowed=allowed)
        framed = [projected_box(scene, k, size) for k in range(len(scene.objects))]
        if any(min(box) < 0 or max(box) > size for box in framed):
            continue  # cut by the frame: a photograph's subject is in it
        if need_relation and not relations(scene):
            continue
        vis = visibility(scene, size)
        if all(v["visible"] and v["hidden"] <= MAX_HIDDEN for v in vis):
            return scene, vis
    raise RuntimeError(f"scene {index} of seed {seed}: no layout in {tries} draws leaves every object visible")


def scene_record(index: int, scene: Scene3D, vis: list[dict], image: str) -> dict:
    return {"image_id": index, "image": image, "objects": [{**o.to_dict(), **v} for o, v in zip(scene.objects, vis)],
            "camera": {"origin": list(scene.camera.origin), "target": list(scene.camera.target),
                       "fov": scene.camera.fov},
            "light": {"sun": list(scene.sun), "sun_power": round(scene.sun_power, 4), "sky": round(scene.sky, 4),
                      "floor": round(scene.floor, 4)},
            "relations": [[i, p, j] for i, p, j in relations(scene)]}


def _make(job: tuple[int, int, int, int, str]) -> dict:
    from PIL import Image

    seed, index, size, spp, out = job
    scene, vis = build_scene(seed, index, size)
    name = f"images/{index:05d}.png"
    Image.fromarray(render(scene, size, spp)).save(f"{out}/{name}")
    return scene_record(index, scene, vis, name)


def _die_with_parent(parent: int) -> None:
    """In a render worker: end when the process that started it ends. A parent killed by a signal (``kill``, a
    scheduler's time limit) runs no clean-up, and its workers would render their chunk of scenes on, for nobody (an
    8,000-scene world's ran 1.5 h). Linux's PR_SET_PDEATHSIG sends SIGTERM then; elsewhere nothing changes."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: the old behaviour
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


def map_jobs(fn, jobs: list, workers: int, desc: str = "rendering", unit: str = "scene") -> list:
    """``[fn(job) for job in jobs]``, in ``workers`` processes when more than one (spawned: a renderer's threads do
    not survive fork); the results in the jobs' order, with a progress line (``extract.common.cli.progress``: a bar
    on a terminal, a line every 30 s in a log)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from extract.common.cli import progress

    if workers <= 1 or len(jobs) <= 1:
        return [fn(job) for job in progress(jobs, total=len(jobs), desc=desc, unit=unit)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        # small chunks: results come back in order, so a chunk of a quarter of a worker's share held the first
        # progress line back for minutes (2,000 scenes: "1/2000 in 150 s, about 299612 s left"); a scene takes
        # well under a second to render, so sending 16 at a time costs nothing
        results = pool.map(fn, jobs, chunksize=max(1, min(16, len(jobs) // (4 * workers))))
        return list(progress(results, total=len(jobs), desc=desc, unit=unit))


def generate(out_dir, n: int, seed: int, size: int = 96, spp: int = 32, workers: int = 1) -> list[dict]:
    """Render ``n`` scenes into ``out_dir/images`` and write ``out_dir/scenes.json``; the same bytes for a seed
    whatever ``workers`` (each scene depends on (seed, index) alone)."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = map_jobs(_make, [(seed, i, size, spp, str(out)) for i in range(n)], workers)
    (out / "scenes.json").write_text(json.dumps({"seed": seed, "size": size, "spp": spp, "scenes": records},
                                                indent=1) + "\n")
    return records


# ------------------------------------------------------------------------------------------------- command line
@dataclass
class World3DOptions:
    """``python -m extract.worlds.world3d`` as data; :func:`generate` is the job."""

    out: str | None = _option(None, metavar="DIR", help="output folder (images/ and scenes.json; overwritten)")
    n: int = _option(100, type=_positive, help="number of scenes")
    seed: int = _option(0, type=_nonnegative, help="random seed: the same seed gives byte-identical files")
    size: int = _option(96, type=_positive, help="image side in px")
    spp: int = _option(32, type=_positive, help="path-tracing samples a pixel")
    workers: int = _option(1, type=_positive, help="processes (the output never depends on it)")


def main(argv: Sequence[str] | None = None) -> int:
    """Render a 3D world and say what it cost: 0, or 2 with one ``error:`` line."""
    import sys
    import time

    from extract.common.cli import build_parser, from_namespace, run_job
    from extract.common.config import parse_with_config

    parser = build_parser(World3DOptions, "python -m extract.worlds.world3d",
                          "Render the 3D world: CLEVR's objects on a floor, path-traced by Mitsuba 3, with each "
                          "object's visible box, hidden share and relations in scenes.json.")
    ns = parse_with_config(parser, argv)
    if not ns.out:
        parser.error("--out is required, e.g. --out runs/world3d")

    def job(opts: World3DOptions) -> None:
        started = time.perf_counter()
        records = generate(opts.out, opts.n, opts.seed, opts.size, opts.spp, opts.workers)
        took = time.perf_counter() - started
        objects = sum(len(r["objects"]) for r in records)
        hidden = sum(o["hidden"] > 0.25 for r in records for o in r["objects"])
        print(f"{len(records)} scenes, {objects} objects ({hidden} hidden past a quarter), "
              f"{sum(len(r['relations']) for r in records)} relations -> {opts.out}/scenes.json; rendered at "
              f"{opts.size} px, {opts.spp} samples a pixel, {opts.workers} process(es) in {took:.1f} s: "
              f"{len(records) / took:.1f} images/s", file=sys.stdout)

    return run_job(job, from_namespace(World3DOptions, ns))


if __name__ == "__main__":
    raise SystemExit(main())
