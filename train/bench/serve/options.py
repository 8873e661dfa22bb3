"""The benchmark's options and targets (``python -m train.bench.serve``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


from extract.common.cli import Parser, build_parser as build_cli, option, parse_options
from extract.common.config import fraction, nonnegative_int, positive_float, positive_int
from serve.faiss_index import KINDS, memory_size


ROOT = Path(__file__).resolve().parents[3]  # the repository (train/bench/serve/options.py)
AUTO = "auto"
MIB = 1 << 20
# the targets (2 cores, 1M vectors)
TARGET_RECALL = 0.95
TARGET_P50_MS = 5.0
TARGET_REFINED_P50_MS = 10.0  # PQ with exact re-scoring: the scale path (memory over speed)
TARGET_PATH_RATIO = 1.2
TARGET_RERANK_MS = 30.0
TARGET_STARTUP_S = 2.0
LOAD_WARNING = 0.5
POINTS_PER_CLUSTER = 32  # fewest points per cluster on average (module docstring)


def _int_list(text: str) -> str:
    import argparse

    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers >= 1, e.g. 10000,100000; "
                                         f"got {text!r}")
    return ",".join(str(v) for v in values)


def _kind_list(text: str) -> str:
    import argparse

    kinds = [k.strip() for k in str(text).split(",") if k.strip()]
    unknown = [k for k in kinds if k not in (*KINDS, AUTO)]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma list from {', '.join((*KINDS, AUTO))}; got {text!r}")
    return ",".join(dict.fromkeys(kinds))


@dataclass
class BenchmarkOptions:
    """What ``python -m train.bench.serve`` measures, as data: ``run(BenchmarkOptions(sizes="10000"))``."""

    sizes: str = option("10000,100000,1000000", type=_int_list, help="collection sizes N (comma list); sections 3-5 "
                                                                     "use the largest")
    kinds: str = option(",".join((*KINDS, AUTO)), type=_kind_list,
                        help="index kinds to build at every N (comma list; auto is always measured at the largest N, "
                             "which sections 3-5 search)")
    largest_kinds: str | None = option(None, type=_kind_list,
                                       help="index kinds built at the largest N instead of --kinds (e.g. leave out "
                                            "hnsw: 1M vectors take it minutes to build on 2 cores)")
    pq_m: int | None = option(None, type=positive_int,
                              help="sub-quantizers of the ivf-pq kind (default: serve.index's choice, the most that "
                                   "fit --max-memory: 256 for 512-d, whose OPQ training takes many minutes on 2 cores)")
    refine: bool = option(True, action=argparse.BooleanOptionalAction,
                          help="also measure ivf-pq with exact re-scoring of its shortlist from fp16 vectors on disk "
                               "(serve.index's --refine, on for ivf-pq by default), as the row 'ivf-pq + refine'")
    queries: int = option(200, type=positive_int, help="held-out queries (recall, latency percentiles)")
    max_latency_ms: float = option(5.0, type=positive_float, help="latency budget nprobe / efSearch are tuned to "
                                                                  "(ms per query, one thread), as serve.index")
    max_memory: str = option("4G", type=memory_size, help="auto's memory budget per index, as serve.index")
    min_recall: float = option(0.95, type=fraction, help="auto: try the next candidate below this recall@10, as "
                                                         "serve.index")
    k: int = option(10, type=positive_int, group="search", help="hits per query")
    rerank: int = option(100, type=positive_int, group="search", help="candidates re-ranked by the ComAlign head")
    rerank_rows: int = option(20_000, type=positive_int, group="search",
                              help="items in the re-ranking collection's feature cache (at most the largest N)")
    callers: str = option("1,4,16", type=_int_list, group="search", help="concurrent callers for throughput")
    concurrency_seconds: float = option(3.0, type=positive_float, group="search",
                                        help="seconds each throughput measurement runs")
    torch_threads: int = option(1, type=positive_int, group="search",
                                help="torch threads throughout (query encoding, re-ranking, the re-ranking "
                                     "collection's first-stage vectors)")
    build_threads: int | None = option(None, type=positive_int, group="run",
                                       help="FAISS OpenMP threads for building and tuning (default: FAISS's own, all "
                                            "cores, as serve.index; 1 suffers least on a machine others load)")
    model: str = option("ViT-B-32", group="data", help="open_clip architecture of the text tower and of the "
                                                        "vectors' width")
    pretrained: str = option("none", group="data", help="its weights ('none': random, which cost the same to run)")
    clusters: int = option(3000, type=positive_int, group="data",
                           help=f"Gaussian cluster centres of the vectors (at most N / {POINTS_PER_CLUSTER})")
    noise: float = option(0.6, type=positive_float, group="data", help="norm of each point's offset from its centre")
    seed: int = option(0, type=nonnegative_int, group="data", help="seeds the vectors, queries and builds")
    work: str | None = option(None, group="run", help="folder for the index directories and caches (default: a "
                                                      "temporary one, deleted after)")
    out: str | None = option(None, group="run", help="also write the results as JSON to this file")


def build_parser() -> Parser:
    import train.bench.serve as command  # the package's docstring is the command's

    return build_cli(BenchmarkOptions, "python -m train.bench.serve", command.__doc__)


def parse_args(argv: Sequence[str] | None = None) -> BenchmarkOptions:
    return parse_options(BenchmarkOptions, build_parser(), argv)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]
