"""``python -m serve``: the retrieval and heatmap app (a Gradio page and a clip-retrieval compatible JSON API) over
an index built by python -m serve.index.

    python -m serve                                   # the embedded default, built on first use
    python -m serve --index runs/index --port 8080    # any index folder
    python -m serve --host 0.0.0.0                    # other machines too (a warning says what that means)

Without ``--index`` it serves the embedded default: the toy world's test split indexed with the best adapter of
``python -m train.demo`` when ``runs/demo`` has one (``runs/demo/index``, built from the demo's report when it is
missing), else with the tiny base (``runs/index-tiny`` over ``runs/toy``); what is missing is built with
``serve.index``'s functions, with progress, and reused afterwards. The console says what is served (model, index
type, size, served R@k) and where: the page at ``http://HOST:PORT/``, the JSON API at ``/knn-service``,
``/indices-list``, ``/metadata`` (serve.http), the Gradio API for ``gradio_client`` (serve.app).

Safe defaults: loopback only unless ``--host`` says otherwise; uploads and request bodies limited in bytes
(``--max-upload``) and images in pixels (``--max-pixels``, read from the header: decompression bombs are refused
before decoding); at most ``--concurrency`` model computations at once and ``--queue`` more waiting, beyond which
requests are told the server is busy; only the collection's own images are readable through the app. Bad input
on the page or the API is a readable message and the server keeps serving. Nothing is fetched from the network.
"""
from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from extract.common.cli import Parser, build_parser as build_cli, check_options, option, parse_options, run_job, say
from extract.common.config import nonnegative_int, positive_int
from serve.faiss_index import memory_size, parse_memory

#: where python -m train.demo writes (its --out default)
DEMO = Path("runs") / "demo"


def port_number(text: str) -> int:
    """argparse type of ``--port``: 0 (a free port) .. 65535."""
    import argparse

    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
    return value


@dataclass
class ServeOptions:
    """What ``python -m serve`` does, as data: ``prepare(ServeOptions(index="runs/index"))`` opens the same index with
    the same limits as the command line (:func:`prepare`, :func:`main`)."""

    index: str | None = option(None, help="index folder built by python -m serve.index (default: the embedded "
                                          "default: runs/demo/index when python -m train.demo made one, else the toy "
                                          "world's test split under the tiny base, built on first use)")
    host: str = option("127.0.0.1", help="address to listen on; anything but loopback lets other machines in")
    port: int = option(7860, type=port_number, help="port to listen on (0: a free one)")
    device: str = option("cpu", help="torch device for encoding queries, re-ranking and heatmaps")
    annotations: str | None = option(None, group="model",
                                     help="boxes of image queries for adapters that read boxes: COCO instances, "
                                          "Visual Genome objects.json or a toy-world folder, naming the images by "
                                          "file name or id; given, they replace the detector of an adapter trained on "
                                          "detected boxes (default: the index's, else for adapters trained on "
                                          "ground-truth boxes the indexed toy world's)")
    detector: str | None = option(None, group="model",
                                  help="YOLO weights: detect boxes of query images instead (default: the index's "
                                       "box source)")
    concurrency: int = option(2, type=positive_int, group="limits",
                              help="model computations at once (page and API together)")
    queue: int = option(32, type=nonnegative_int, group="limits",
                        help="requests waiting for a free slot; more are told the server is busy")
    max_upload: str = option("10M", type=memory_size, group="limits",
                             help="largest uploaded image, e.g. 10M (request bodies: its base64 plus 1 MiB)")
    max_pixels: int = option(25_000_000, type=positive_int, group="limits",
                             help="largest image, width x height, checked from the header before decoding")
    max_results: int = option(1000, type=positive_int, group="limits",
                              help="hits and re-ranked candidates one request may ask for")
    show_paths: bool = option(False, action="store_true", group="limits",
                              help="HTTP answers also hold each image's file path on this machine (image_path) "
                                   "and no answer is filtered for the server's paths (for a trusted local setup: by "
                                   "default a client gets the image's URL and id, and files by name only)")
    recall: str = option("auto", choices=["auto", "on", "off"], group="limits",
                         help="measure the served R@k once at start-up for the about line; auto: for collections "
                              "of at most 5,000 images + captions")
    debug: bool = option(False, action="store_true", help="show the traceback of an error (also PLUGVLM_DEBUG=1)")


def build_parser() -> Parser:
    return build_cli(ServeOptions, "python -m serve", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> ServeOptions:
    return parse_options(ServeOptions, build_parser(), argv)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------- the default index
def served_checkpoint(report: dict) -> str | None:
    """The adapter checkpoint a ``python -m train.demo`` report says the demo served (``served.checkpoint``: its
    best held-out T2I R@1 over every base); for a report written before it named one, the method with the best
    held-out T2I R@1 among ``adapters.heads``; None when it served none."""
    served = report.get("served") or {}
    if served.get("checkpoint"):
        return served["checkpoint"]
    methods = (report.get("adapters") or {}).get("methods") or {}
    scored = {m: r["val"]["retrieval T2I R@1"] for m, r in methods.items()
              if r.get("checkpoint") and "retrieval T2I R@1" in (r.get("val") or {})}
    return methods[max(scored, key=scored.get)]["checkpoint"] if scored else None


def demo_adapter(demo: Path = DEMO) -> str | None:
    """The checkpoint of the best adapter of ``python -m train.demo`` in ``demo`` (its report), or None."""
    report = demo / "demo_report.json"
    if not report.is_file():
        return None
    try:
        checkpoint = served_checkpoint(json.loads(report.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return checkpoint if checkpoint and Path(checkpoint).exists() else None


def default_index(device: str = "cpu", demo: Path = DEMO, rebuild: bool = False) -> Path:
    """The embedded default's index folder (module docstring), built when missing (or with ``rebuild``)."""
    from serve.index import IndexOptions, build_index, default_out, summary

    demo_index = demo / "index"
    checkpoint = demo_adapter(demo)
    if checkpoint is None and (demo_index / "manifest.json").is_file() and not rebuild:
        return demo_index  # the demo's index whose report went missing: still the demo's adapter
    if checkpoint is not None:
        if (demo_index / "manifest.json").is_file() and not rebuild:
            return demo_index
        say(f"building the index of the demo's best adapter ({checkpoint}) over its toy world's test split")
        opts = IndexOptions(model=checkpoint, data=str(demo / "toyworld"), out=str(demo_index), kind="flat",
                            cache_dir=str(demo / "adapters" / "cache"), device=device)
    else:
        out = Path(default_out("tiny"))
        if (out / "manifest.json").is_file() and not rebuild:
            return out
        say("no trained adapter in runs/demo (python -m train.demo trains them): serving the toy world's test split "
            "under the tiny base")
        from serve.index import with_defaults

        opts = with_defaults(IndexOptions(model="tiny", kind="flat", device=device))
    print(summary(build_index(opts), opts.out))
    return Path(opts.out)


# --------------------------------------------------------------------------------------------- serving
def prepare(opts: ServeOptions):
    """(the Served index with its limits, the index folder): opens ``opts.index`` or the embedded default."""
    from serve.service import Limits, Served
    from serve.layout import IndexDirError, ModelMismatchError

    check_options(opts, build_parser())
    limits = Limits(max_upload_bytes=parse_memory(opts.max_upload), max_pixels=opts.max_pixels,
                    concurrency=opts.concurrency, queue=opts.queue, max_results=opts.max_results,
                    show_paths=opts.show_paths)
    recall = {"auto": None, "on": True, "off": False}[opts.recall]

    def open_(index: Path):
        return Served.open(index, device=opts.device, annotations=opts.annotations, detector=opts.detector,
                           limits=limits, recall=recall)

    if opts.index is not None:
        return open_(Path(opts.index)), Path(opts.index)
    index = default_index(opts.device)
    try:
        return open_(index), index
    except ModelMismatchError:
        raise
    except IndexDirError as e:  # the embedded default is ours to rebuild (a moved cache, an older layout)
        say(f"the default index {index} cannot be served ({str(e).splitlines()[0]}): rebuilding it")
        index = default_index(opts.device, rebuild=True)
        return open_(index), index


def banner(served, index: Path, url: str, opts: ServeOptions) -> str:
    """What the console says once the server is up."""
    from serve.service import recall_text, search_params

    d = served.describe()
    lines = [f"serving {index}: {d['model']} ({d['how']})",
             f"  index {d['index_key']} ({search_params(d)}), {d['images']:,} images, {d['captions']:,} captions",
             "  " + recall_text(d["recall"]).replace("**", "")
             + (f" (measured in {d['recall']['seconds']:.1f} s)" if d["recall"] else ""),
             f"page: {url}",
             f"API:  POST {url}knn-service (clip-retrieval's), GET {url}indices-list, POST {url}metadata; "
             f"gradio_client.Client({url!r})",
             f"limits: {opts.concurrency} computations at once, {opts.queue} waiting; uploads up to {opts.max_upload}"
             f"B and {opts.max_pixels:,} pixels",
             "Ctrl-C stops it"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)

    def job(opts: ServeOptions) -> None:
        import torch

        from serve.http import bind, create_app, server_config

        if not is_loopback(opts.host):
            print(f"warning: listening on {opts.host}: anyone who can reach this machine can search the collection, "
                  "see its images and upload images to it (there is no login); --host 127.0.0.1 keeps it local")
        sock = bind(opts.host, opts.port)  # before the model loads: a port in use fails in a second
        try:
            served, index = prepare(opts)
        except BaseException:
            sock.close()  # a refused start releases the port at once
            raise
        # the cores are shared by the concurrent computations, not multiplied by them (set once the index opened:
        # a refused start leaves the calling process's threads as they were)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.concurrency))
        app = create_app(served)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(banner(served, index, f"http://{shown}:{port}/", opts), flush=True)
        import uvicorn

        try:
            uvicorn.Server(server_config(app)).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
            pass
        print("stopped", flush=True)
        sys.stderr.flush()
        # anyio's idle worker threads are not daemons and would hold the exit for 10 s; nothing is left to flush
        os._exit(0)

    return run_job(job, opts, debug=opts.debug)


if __name__ == "__main__":
    raise SystemExit(main())
