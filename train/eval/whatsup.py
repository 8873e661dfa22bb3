"""What'sUp (Kamath et al., EMNLP 2023) in its published layout: the Controlled-A / -B four-way sets and the COCO /
GQA two-way subsets, and the pair and set accuracies its authors compute over several items."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable

from train.eval.bench_items import (Benchmark, Item, Pending, abspath, finish, format_error, load_json, object_field,
                                    published_files, text_field)


# --------------------------------------------------------------------------------------------- What'sUp
#: What'sUp's six files (stem -> subset name), in the order of the paper's tables; Controlled-A / -B hold four
#: captions per image, the four QA files two (the authors' loader, ``dataset_zoo/aro_datasets.py``).
WHATSUP_FILES = {
    "controlled_images_dataset": "controlled-A",
    "controlled_clevr_dataset": "controlled-B",
    "coco_qa_one_obj": "coco-spatial one-object",
    "coco_qa_two_obj": "coco-spatial two-object",
    "vg_qa_one_obj": "gqa-spatial one-object",
    "vg_qa_two_obj": "gqa-spatial two-object",
}
# The image folder of each subset in the published download (the loader's image_dir).
_WHATSUP_IMAGE_DIRS = {
    "controlled-A": "controlled_images",
    "controlled-B": "controlled_clevr",
    "coco-spatial one-object": "val2017",
    "coco-spatial two-object": "val2017",
    "gqa-spatial one-object": "vg_images",
    "gqa-spatial two-object": "vg_images",
}
_WHATSUP_CONTROLLED_OPTIONS = 4
_WHATSUP_QA_ROW = "[image_id, true caption, false caption]"
# Controlled-A / -B: the two pairs of opposite prepositions (the second word of an image's file name) whose
# both images must be right for a pair to count (the loader's evaluate_scores).
_WHATSUP_PAIRS = {
    "controlled-A": (("left", "right"), ("on", "under")),
    "controlled-B": (("left", "right"), ("in-front", "behind")),
}


def _whatsup_files(path: Path) -> list[Path]:
    files = published_files(path, WHATSUP_FILES, "What'sUp")
    if not path.is_dir() and path.stem not in WHATSUP_FILES:
        # The name is what tells the layout (4 captions or 2) and the image folder, as in the authors' loader.
        raise format_error(path, "", f"not one of What'sUp's files ({', '.join(s + '.json' for s in WHATSUP_FILES)}); "
                              "its name says which subset and layout it holds")
    return files


def _whatsup_controlled_preposition(subset: str, name: str) -> str:
    """The loader's preposition of a Controlled image, from its file name (first match wins, as there)."""
    if "left_of" in name:
        return "left_of"
    if "right_of" in name:
        return "right_of"
    if subset == "controlled-A":
        return "on" if "_on_" in name else "under"
    return "in-front_of" if "_in-front_of_" in name else "behind"


def _whatsup_qa_preposition(subset: str, caption: str) -> str:
    """The loader's preposition of a COCO_QA / VG_QA row, from its true caption (substring tests, first match
    wins, as there): one-object, the caption's last word; two-object, left / right / above / else below (COCO),
    left / right / front / behind / else top (GQA)."""
    if subset.endswith("one-object"):
        return caption.split()[-1]
    if "left of" in caption:
        return "left"
    if "right of" in caption:
        return "right"
    if subset.startswith("coco"):
        return "above" if "above" in caption else "below"
    if "front of" in caption:
        return "front"
    return "behind" if "behind" in caption else "top"


def _whatsup_controlled_entry(file: Path, where: str, raw: Any) -> tuple[str, str, tuple[str, ...]]:
    entry = object_field(file, where, raw)
    image_path = text_field(file, where, entry, "image_path")
    if "caption_options" not in entry:
        raise format_error(file, where, "missing key 'caption_options'")
    options = entry["caption_options"]
    if not isinstance(options, list) or len(options) != _WHATSUP_CONTROLLED_OPTIONS:
        got = f"{len(options)} values" if isinstance(options, list) else type(options).__name__
        raise format_error(file, where, f"'caption_options' must be a list of {_WHATSUP_CONTROLLED_OPTIONS} strings "
                                 f"(the true caption first), got {got}")
    for k, option in enumerate(options):
        if not isinstance(option, str):
            raise format_error(file, where, f"'caption_options' option {k} must be a string, got {type(option).__name__}")
        if not option.strip():
            raise format_error(file, where, f"'caption_options' option {k} is empty")
    name = image_path.split("/")[-1]  # the loader's own split: the names carry the prepositions and the groups
    if not name.strip():
        raise format_error(file, where, f"'image_path' names no file: {image_path!r}")
    return image_path, name, tuple(options)


def _whatsup_qa_row(file: Path, where: str, raw: Any, subset: str) -> tuple[str, tuple[str, str]]:
    if not isinstance(raw, list) or len(raw) != 3:
        got = f"{len(raw)} values" if isinstance(raw, list) else type(raw).__name__
        raise format_error(file, where, f"expected a {_WHATSUP_QA_ROW} list, got {got}")
    image_id, *captions = raw
    if isinstance(image_id, bool) or not isinstance(image_id, (int, str)) or (
            isinstance(image_id, str) and not image_id.strip()):
        raise format_error(file, where, f"image_id (value 0) must be an integer or a non-empty string, got {image_id!r}")
    for k, (role, caption) in enumerate(zip(("true", "false"), captions), start=1):
        if not isinstance(caption, str):
            raise format_error(file, where, f"the {role} caption (value {k}) must be a string, got {type(caption).__name__}")
        if not caption.strip():
            raise format_error(file, where, f"the {role} caption (value {k}) is empty")
    # The loader's file names: COCO ids zero-padded to 12 digits (COCO's own names), Visual Genome ids as they are.
    name = f"{str(image_id).zfill(12)}.jpg" if subset.startswith("coco") else f"{image_id}.jpg"
    return name, (captions[0], captions[1])


def _whatsup_image(file: Path, subset: str, name: str, written: str | None,
                   image_root: str | os.PathLike | None) -> str:
    """The first existing candidate; none existing, the one to report (``image_root / name``, else the
    published layout ``<JSON folder>/<image folder>/name``)."""
    folder = _WHATSUP_IMAGE_DIRS[subset]
    published = file.parent / folder / name
    candidates = []
    if image_root is not None:
        root = Path(image_root).expanduser()
        candidates += [root / name, root / folder / name]
    if written is not None:  # Controlled: the loader opens image_path as written, from its working directory
        path = Path(written).expanduser()
        candidates.append(path if path.is_absolute() else file.parent / path)
    candidates.append(published)
    for candidate in candidates:
        if candidate.is_file():
            return abspath(candidate)
    return abspath(candidates[0] if image_root is not None else published)


def read_whatsup(path_or_dir: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """What'sUp from one of its JSON files, or from a folder holding any of :data:`WHATSUP_FILES`.

    One "text" item per entry, ``texts[0]`` the true caption (Controlled-A / -B: the four ``caption_options``
    as written; COCO-/GQA-spatial: ``(true caption, false caption)``), so the accuracy is the paper's per-image
    ("individual") accuracy; :func:`whatsup_pair_and_set` gives Controlled's pair and set accuracies.
    ``subtype`` = the subset (a value of :data:`WHATSUP_FILES`), ``tags = ("<subset> <preposition>",)`` with the
    authors' loader's preposition labels (Controlled-A ``left_of / right_of / on / under``, from the image's
    file name; Controlled-B ``left_of / right_of / in-front_of / behind``; one-object QA: the true caption's last
    word; two-object COCO ``left / right / above / below``, two-object GQA ``left / right / front / behind /
    top``), ``item_id`` = ``"<file stem>/<entry index>"``.

    Image: the first that exists of ``image_root / name`` and ``image_root / <image folder> / name`` (when
    ``image_root`` is given), then, for Controlled, ``image_path`` as written (absolute, or relative to the JSON's
    folder), then the published layout ``<JSON folder>/<image folder>/name``; where none exists the item is
    skipped as a missing image naming ``image_root / name`` (or the published path). ``name`` is
    ``basename(image_path)`` (Controlled), ``<image_id zero-padded to 12>.jpg`` (COCO-spatial) or
    ``<image_id>.jpg`` (GQA-spatial); the image folders are ``controlled_images``, ``controlled_clevr``,
    ``val2017`` and ``vg_images``. So the published download works without ``image_root``, and with the one
    ``--image-root`` that ``train.eval`` shares among all benchmarks of a run. All files are validated before
    any image is checked (module docstring).
    """
    root = Path(path_or_dir).expanduser()
    parsed = []  # (file, subset, index, name, image_path as written or None, texts, preposition)
    for file in _whatsup_files(root):
        subset = WHATSUP_FILES[file.stem]
        data = load_json(file)
        if not isinstance(data, list):
            raise format_error(file, "", f"expected a JSON list of test cases, got {type(data).__name__}")
        for index, raw in enumerate(data):
            where = f"entry {index}"
            if subset.startswith("controlled"):
                written, name, texts = _whatsup_controlled_entry(file, where, raw)
                preposition = _whatsup_controlled_preposition(subset, name)
            else:
                written = None
                name, texts = _whatsup_qa_row(file, where, raw, subset)
                preposition = _whatsup_qa_preposition(subset, texts[0])
            parsed.append((file, subset, index, name, written, texts, preposition))
    pending = []
    for file, subset, index, name, written, texts, preposition in parsed:
        image = _whatsup_image(file, subset, name, written, image_root)
        item = Item(f"{file.stem}/{index}", (image,), texts, subset, tags=(f"{subset} {preposition}",))
        pending.append(Pending(item, f"{file}: entry {index}"))
    return dataclasses.replace(finish("whatsup", "text", pending), summarize=whatsup_pair_and_set)


def whatsup_pair_and_set(items: Iterable[Item], correct: Iterable[bool]) -> dict[str, dict[str, float]]:
    """Controlled-A / -B's pair and set accuracies, computed as the authors' ``Controlled_Images.evaluate_scores``
    does, from :func:`read_whatsup`'s items and whether each was right (a parallel sequence of bools).

    Each subset's images are grouped by (the first ``_``-separated word of the image's file name, the last word
    without its extension): ``mug_left_of_table.jpeg`` -> ``("mug", "table")``, its slot the second word
    (``left``; Controlled-A's slots ``left, right, on, under``, Controlled-B's ``left, right, in-front, behind``),
    later items overwriting earlier ones of the same slot, as their dict does. A group scores one pair for
    ``left`` and ``right`` both right and one for ``on`` and ``under`` (A) / ``in-front`` and ``behind`` (B) both
    right, and one set when all four are right. Their denominators: ``pair = 100 * pairs / (n / 2)``, ``set = 100 *
    sets / (n / 4)``, n the subset's items given (on the full subsets, 412 and 408 images, every group holds four;
    items skipped as missing images lower n and can leave groups short). ``individual`` is the plain per-image
    accuracy (what :func:`read_whatsup`'s rows show). Items of other subsets are ignored.

    Returns ``{subset: {"individual", "pair", "set", "n"}}`` for each Controlled subset among the items. Raises
    ValueError when the two lengths differ or a file name has fewer than three ``_``-separated words.
    """
    items, correct = list(items), list(correct)
    if len(items) != len(correct):
        raise ValueError(f"{len(items)} items but {len(correct)} correctness values")
    groups: dict[str, dict[tuple[str, str], dict[str, bool]]] = {}
    right: dict[str, list[bool]] = {}
    for item, ok in zip(items, correct):
        pairs = _WHATSUP_PAIRS.get(item.subtype)
        if pairs is None:
            continue
        name = os.path.basename(item.images[0])
        words = name.split("_")
        if len(words) < 3:
            raise ValueError(f"{item.item_id}: image file name {name!r} is not <object>_<preposition>_<object>.<ext>")
        key = (words[0], os.path.splitext(words[-1])[0])  # their [:-5] drops the published names' ".jpeg"
        slots = groups.setdefault(item.subtype, {}).setdefault(key, {s: False for pair in pairs for s in pair})
        slots[words[1]] = bool(ok)
        right.setdefault(item.subtype, []).append(bool(ok))
    out = {}
    for subset, by_key in groups.items():
        n = len(right[subset])
        pairs = sum(all(slots[s] for s in pair) for slots in by_key.values() for pair in _WHATSUP_PAIRS[subset])
        sets = sum(sum(slots.values()) == 4 for slots in by_key.values())
        out[subset] = {"individual": 100 * sum(right[subset]) / n, "pair": 100 * pairs / (n / 2),
                       "set": 100 * sets / (n / 4), "n": n}
    return out
