"""Synthetic embeddings clustered like real ones, ComAlign components at the model's shapes, captions."""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def cluster_world(d: int, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(centres [C, d] on the unit sphere, cluster probabilities [C], lognormal: a few big clusters, many small)."""
    rng = np.random.default_rng([seed, 0xCE17])
    centres = rng.standard_normal((clusters, d), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = rng.lognormal(0.0, 1.0, clusters)
    return centres, weights / weights.sum()


def clustered(world, n: int, noise: float, seed: int, stream: int, chunk: int = 65_536) -> np.ndarray:
    """[n, d] float32 unit vectors, each a centre plus Gaussian noise of norm ~``noise``, normalised and rounded to
    fp16 (how a cache stores embeddings), drawn in chunks (bounded temporaries)."""
    centres, weights = world
    d = centres.shape[1]
    rng = np.random.default_rng([seed, stream])
    out = np.empty((n, d), dtype=np.float32)
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        x = centres[rng.choice(len(centres), m, p=weights)]
        x += rng.standard_normal((m, d), dtype=np.float32) * np.float32(noise / math.sqrt(d))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[a:a + m] = x.astype(np.float16)
    return out


def component_arrays(glob: np.ndarray, entities: int, relations: int, rng, prefix: str) -> dict[str, np.ndarray]:
    """ComAlign's component arrays for items whose global embeddings are ``glob`` [B, d], as a cache holds them
    (fp16 embeddings zero-padded to E / R, bool validity): 1-4 entities (the toy world's objects per scene), each
    its item's embedding plus noise, and every pair of them as a relation (at most R), padded like extraction."""
    b, d = glob.shape
    ent = np.zeros((b, entities, d), np.float16)
    rel = np.zeros((b, relations, d), np.float16)
    ent_valid = np.zeros((b, entities), bool)
    rel_valid = np.zeros((b, relations), bool)
    count = rng.integers(1, min(4, entities) + 1, size=b)
    pairs = np.minimum(count * (count - 1) // 2, relations)
    for rows, m, arr, valid in ((count, entities, ent, ent_valid), (pairs, relations, rel, rel_valid)):
        noise = rng.standard_normal((b, m, d), dtype=np.float32) * np.float32(1.0 / math.sqrt(d))
        x = glob[:, None, :] + noise
        x /= np.linalg.norm(x, axis=2, keepdims=True)
        keep = np.arange(m)[None, :] < rows[:, None]
        arr[keep] = x[keep].astype(np.float16)
        valid[keep] = True
    if prefix == "image":
        from extract.components.regions import pair_rows

        corner = rng.uniform(0, 160, (b, entities, 2)).astype(np.float32)
        boxes = np.concatenate([corner, corner + rng.uniform(8, 64, (b, entities, 2)).astype(np.float32)], -1)
        return {"image_embed": glob.astype(np.float16), "ventity_embed": ent, "ventity_valid": ent_valid,
                "vrelation_embed": rel, "vrelation_valid": rel_valid, "ventity_boxes": boxes,
                "vrelation_pairs": np.broadcast_to(pair_rows(entities, relations), (b, relations, 2)).copy()}
    return {"text_embed": glob.astype(np.float16), "entity_embed": ent, "entity_valid": ent_valid,
            "relation_embed": rel, "relation_valid": rel_valid}


def captions(n: int, seed: int) -> list[str]:
    """Toy-world-like captions ("a small red circle left of a large blue star"): what spaCy parses into the
    entities and relations ComAlign's text side encodes."""
    from extract.worlds.toyworld import COLOURS, PREDICATES, SHAPES, SIZES

    rng = np.random.default_rng([seed, 0x7E77])
    colours, sizes = list(COLOURS), list(SIZES)

    def obj() -> str:
        return f"a {sizes[rng.integers(len(sizes))]} {colours[rng.integers(len(colours))]} " \
               f"{SHAPES[rng.integers(len(SHAPES))]}"

    return [f"{obj()} {PREDICATES[rng.integers(len(PREDICATES))]} {obj()}" for _ in range(n)]


def component_counts() -> tuple[int, int]:
    """(E, R): entity and relation components per item, python -m extract's defaults (ComAlign's 10 and 10)."""
    from extract.options import ExtractOptions

    defaults = {f.name: f.default for f in dataclasses.fields(ExtractOptions)}
    return int(defaults["max_entities"]), int(defaults["max_relations"])


def shard_rows() -> int:
    from extract.options import ExtractOptions

    return int({f.name: f.default for f in dataclasses.fields(ExtractOptions)}["shard_size"])
