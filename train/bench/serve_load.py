"""``python -m train.bench.serve_load``: N concurrent clients against the running app for a fixed time, text -> image
without and with re-ranking; prints requests/s, p50 / p99 latency, the error count and the server's resident memory
at the start and the end of each phase.

    python -m train.bench.serve_load                                   # starts python -m serve (the embedded default)
    python -m train.bench.serve_load --url http://127.0.0.1:7860/ --clients 8 --seconds 60

Each client is a thread with one keep-alive connection sending ``POST /knn-service`` (clip-retrieval's request
shape, ``num_images`` = ``--k``) one after the other; the queries are toy-world captions ("a red circle to the left
of a blue square"), a different one each time. A phase first sends ``--warmup`` requests (not counted: the first
re-ranking reads the cache's pages), then runs until ``--seconds`` have passed or ``--max-requests`` were sent,
whichever comes first. The server's memory is read from its ``/health`` before and after the counted requests.

Bounded on purpose: a fixed number of requests, a time cap, and only loopback addresses (a load generator pointed
at another machine is refused). Without ``--url`` it starts ``python -m serve --port 0`` itself (``--index`` passed
on), waits for it and stops it at the end. The bar: zero errors and no memory growth across a run; a
phase that misses it is marked and the exit status is 1.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

from extract.common.cli import JobFailed, Parser, build_parser as build_cli, check_options, option, parse_options, run_job
from extract.common.config import nonnegative_int, positive_float, positive_int

#: growth of the server's RSS over a phase still counted as none: allocator noise, lazily touched pages
GROWTH_TOLERANCE_MIB = 16.0
MAX_SECONDS = 600.0


def phase_seconds(text: str) -> float:
    """argparse type of ``--seconds``: a number > 0 and <= MAX_SECONDS (the time cap)."""
    import argparse

    value = positive_float(text)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS:.0f} seconds, got {value:g}")
    return value


@dataclass
class LoadOptions:
    """What ``python -m train.bench.serve_load`` does, as data: ``load_test(LoadOptions(url=..., seconds=5))``."""

    url: str | None = option(None, help="the running app (loopback only), e.g. http://127.0.0.1:7860/ (default: start "
                                        "python -m serve on a free port and stop it at the end)")
    index: str | None = option(None, help="without --url: the index python -m serve serves (default: its default)")
    clients: int = option(8, type=positive_int, help="concurrent clients")
    seconds: float = option(60.0, type=phase_seconds, help=f"length of each phase, at most {MAX_SECONDS:.0f}")
    max_requests: int = option(100_000, type=positive_int, help="requests per phase at most (a second bound)")
    warmup: int = option(20, type=nonnegative_int, help="requests per phase sent first and not counted")
    k: int = option(10, type=positive_int, help="hits per request (num_images)")
    rerank: int = option(50, type=positive_int, metavar="K", help="first-stage candidates re-ranked in the second "
                                                                   "phase (k_candidates)")
    timeout: float = option(60.0, type=positive_float, help="seconds a request may take before it counts as an error")
    startup_timeout: float = option(600.0, type=positive_float,
                                    help="without --url: seconds to wait for the server to start (it may build the "
                                         "default index first)")
    json: str | None = option(None, metavar="PATH", help="also write the figures to this JSON file")


def build_parser() -> Parser:
    return build_cli(LoadOptions, "python -m train.bench.serve_load", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> LoadOptions:
    return parse_options(LoadOptions, build_parser(), argv)


class LoadFailed(JobFailed):
    """A phase with errors or memory growth: the figures are printed, the exit status says it missed the bar."""

    exit_code = 1


# --------------------------------------------------------------------------------------------- queries
def queries(n: int = 512, seed: int = 0) -> list[str]:
    """``n`` distinct toy-world captions (an object, or two objects and a relation), in a fixed shuffled order."""
    import itertools

    import numpy as np

    from extract.worlds.toyworld import COLOURS, PREDICATES, SHAPES

    objects = [f"a {c} {s}" for c in COLOURS for s in SHAPES]
    relation = {p: ("to the " + p if p in ("left of", "right of") else p) for p in PREDICATES}
    texts = objects + [f"{a} {relation[p]} {b}" for a, p, b in itertools.product(objects, PREDICATES, objects)
                       if a != b]
    order = np.random.default_rng(seed).permutation(len(texts))[:n]
    return [texts[i] for i in order]


# --------------------------------------------------------------------------------------------- one phase
@dataclass
class Phase:
    """The figures of one phase: ``requests`` counted, ``seconds``, ``rps``, ``p50_ms`` / ``p99_ms`` of the
    successful ones, ``errors`` (by cause), server RSS at ``rss_start`` / ``rss_end`` (bytes; None if unknown)."""

    name: str
    body: dict
    requests: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: dict = field(default_factory=dict)
    rss_start: int | None = None
    rss_end: int | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def growth_mib(self) -> float | None:
        if self.rss_start is None or self.rss_end is None:
            return None
        return (self.rss_end - self.rss_start) / 2**20

    @property
    def met(self) -> bool:
        return self.error_count == 0 and (self.growth_mib is None or self.growth_mib <= GROWTH_TOLERANCE_MIB)


class _Client:
    """One keep-alive connection to the app."""

    def __init__(self, url: str, timeout: float):
        import http.client

        parts = urlsplit(url)
        self._make = lambda: http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        self.prefix = parts.path.rstrip("/")
        self.conn = self._make()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self.conn.request(method, self.prefix + path, body=data, headers=headers)
            response = self.conn.getresponse()
            return response.status, response.read()
        except Exception:
            self.conn.close()
            self.conn = self._make()  # a broken connection is not reused
            raise

    def close(self) -> None:
        self.conn.close()


def server_rss(url: str, timeout: float = 30.0) -> int | None:
    """The server's resident memory in bytes, from its /health."""
    client = _Client(url, timeout)
    try:
        status, data = client.request("GET", "/health")
        return json.loads(data).get("rss_bytes") if status == 200 else None
    finally:
        client.close()


def run_phase(url: str, phase: Phase, opts: LoadOptions, texts: Sequence[str]) -> Phase:
    """Run one phase (module docstring) and fill in its figures."""
    import numpy as np

    seconds = opts.seconds
    counter = {"next": 0}
    lock = threading.Lock()

    def take(limit: int) -> int | None:
        with lock:
            if counter["next"] >= limit:
                return None
            counter["next"] += 1
            return counter["next"] - 1

    def worker(limit: int, deadline: float, latencies: list, errors: dict) -> None:
        client = _Client(url, opts.timeout)
        try:
            while time.monotonic() < deadline:
                n = take(limit)
                if n is None:
                    return
                body = {**phase.body, "text": texts[n % len(texts)]}
                started = time.perf_counter()
                try:
                    status, _ = client.request("POST", "/knn-service", body)
                except Exception as e:  # a refused or dropped connection, a timeout
                    cause = type(e).__name__
                else:
                    cause = None if status == 200 else f"HTTP {status}"
                with lock:
                    if cause is None:
                        latencies.append((time.perf_counter() - started) * 1000)
                    else:
                        errors[cause] = errors.get(cause, 0) + 1
        finally:
            client.close()

    def run(limit: int, duration: float) -> tuple[list, dict, float]:
        counter["next"] = 0
        latencies, errors = [], {}
        started = time.monotonic()
        threads = [threading.Thread(target=worker, args=(limit, started + duration, latencies, errors), daemon=True)
                   for _ in range(opts.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + opts.timeout + 5)
        return latencies, errors, time.monotonic() - started

    if opts.warmup:
        _, warm_errors, _ = run(opts.warmup, opts.timeout * max(1, opts.warmup))
        if warm_errors:
            phase.errors = {f"warm-up {k}": v for k, v in warm_errors.items()}
    phase.rss_start = server_rss(url)
    latencies, errors, elapsed = run(opts.max_requests, seconds)
    phase.rss_end = server_rss(url)
    phase.errors.update(errors)
    phase.requests, phase.seconds = len(latencies) + sum(errors.values()), round(elapsed, 2)
    phase.rps = round(len(latencies) / elapsed, 2) if elapsed > 0 else 0.0
    if latencies:
        phase.p50_ms, phase.p99_ms = (round(float(v), 2) for v in np.percentile(latencies, [50, 99]))
    return phase


# --------------------------------------------------------------------------------------------- the job
def check_url(url: str) -> str:
    """``url`` when it is an http URL of a loopback address (ValueError otherwise), with a trailing slash."""
    from serve.__main__ import is_loopback

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--url must be an http:// URL of the running app, got {url!r}")
    if not is_loopback(parts.hostname):
        raise ValueError(f"--url {url}: the load check runs against this machine only (127.0.0.1, ::1 or localhost)")
    return url if url.endswith("/") else url + "/"


class _Server:
    """``python -m serve`` started in a subprocess on a free port (the URL read from its banner)."""

    def __init__(self, opts: LoadOptions):
        command = [sys.executable, "-m", "serve", "--port", "0", "--recall", "off"]
        if opts.index:
            command += ["--index", opts.index]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        bufsize=1)
        self.url, self.lines = None, []
        found = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("page: ") and self.url is None:
                    self.url = line.split("page: ", 1)[1].strip()
                    found.set()
            found.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        found.wait(opts.startup_timeout)
        if self.url is None:
            self.stop()
            tail = "\n  ".join(self.lines[-5:])
            raise RuntimeError(f"python -m serve did not start within {opts.startup_timeout:.0f} s:\n  {tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful stop
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def phases(opts: LoadOptions, second_stage: bool) -> list[Phase]:
    base = {"modality": "image", "num_images": opts.k, "num_result_ids": opts.k, "deduplicate": False}
    out = [Phase("text->image, first stage", base)]
    if second_stage:
        out.append(Phase(f"text->image, re-ranked K={opts.rerank}", {**base, "rerank": True,
                                                                       "k_candidates": opts.rerank}))
    return out


def load_test(opts: LoadOptions) -> dict:
    """Run the phases against ``opts.url`` (or a server started here); returns what is printed, as data:
    ``{"url", "served", "clients", "phases": [...]}``."""
    check_options(opts, build_parser())
    url = check_url(opts.url) if opts.url else None
    server = None if url else _Server(opts)
    try:
        url = url or check_url(server.url)
        client = _Client(url, opts.timeout)
        try:
            status, data = client.request("GET", "/health")
        finally:
            client.close()
        if status != 200:
            raise ValueError(f"{url}health answered HTTP {status}: is this python -m serve?")
        served = json.loads(data)["served"]
        texts = queries()
        done = [run_phase(url, p, opts, texts) for p in phases(opts, bool(served.get("second_stage")))]
    finally:
        if server is not None:
            server.stop()
    return {"url": url, "served": served, "clients": opts.clients, "seconds": opts.seconds,
            "phases": [{**asdict(p), "error_count": p.error_count, "growth_mib": p.growth_mib, "met": p.met}
                       for p in done]}


def report(result: dict) -> str:
    """The figures as a table, with what was measured above it."""
    s = result["served"]
    mib = lambda b: "?" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"load test: {result['clients']} clients x {result['seconds']:g} s per phase against {result['url']} "
             f"({s['model']}; {s['index_key']}; {s['images']:,} images); POST /knn-service",
             f"{'phase':<32}{'requests':>9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}  server RSS MiB",
             ]
    for p in result["phases"]:
        growth = "" if p["growth_mib"] is None else f" ({p['growth_mib']:+.1f})"
        p50 = "-" if p["p50_ms"] is None else f"{p['p50_ms']:.1f}"
        p99 = "-" if p["p99_ms"] is None else f"{p['p99_ms']:.1f}"
        lines.append(f"{p['name']:<32}{p['requests']:>9,}{p['rps']:>9.1f}{p50:>9}{p99:>9}{p['error_count']:>8}  "
                     f"{mib(p['rss_start'])} -> {mib(p['rss_end'])}{growth}"
                     + ("" if p["met"] else "   <- misses the bar (errors or memory growth)"))
        if p["errors"]:
            lines.append("  errors: " + ", ".join(f"{k} x{v}" for k, v in p["errors"].items()))
    if not s.get("second_stage"):
        lines.append(f"({s['model']} has no second stage: no re-ranked phase)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: LoadOptions) -> None:
        result = load_test(opts)
        print(report(result))
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(result, f, indent=2)
        missed = [p["name"] for p in result["phases"] if not p["met"]]
        if missed:
            raise LoadFailed(f"{', '.join(missed)}: errors or memory growth (above {GROWTH_TOLERANCE_MIB:g} MiB)")

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
