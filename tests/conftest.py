"""Test-wide guards: offline hubs, project-local caches, and no network beyond loopback.

Everything here runs before any test module imports open_clip / ultralytics / huggingface_hub, so the
offline switches are in place when those libraries read them at import time.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

# shared fixtures live in tests/fixtures/ (never in another test file); these are fixtures any test may ask for by name
pytest_plugins = ["fixtures.serve"]

# A missing hub file must fail at once, not after ~45 s of retries (open_clip -> huggingface_hub).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# ultralytics: never phone home, never write settings into $HOME.
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", str(_ROOT / ".yolo"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# MKL's reproducible mode is the library's own (extract/numerics.py), not the tests': nothing set here.
# Keep tests off the 2 CI cores' oversubscription: torch intra-op threads default to all cores. Under pytest-xdist
# (the default: two workers) each worker computes with one thread, so two workers fill two cores, not four threads
# (set, not defaulted: a worker inherits the controller's environment, where this file set 2 first; two workers with
# two OpenMP threads each, spinning at their barriers, once made the suite slower than one process). Waiting OpenMP
# threads sleep instead of spinning, for the same reason.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class NetworkAccessError(RuntimeError):
    """Raised when a test tries to reach anything but loopback."""


def _is_local(address) -> bool:
    if not isinstance(address, tuple):  # AF_UNIX paths, abstract sockets
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a hostname: would need DNS, which is already off-machine


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo


def _guarded_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address):
        raise NetworkAccessError(f"test tried to open a non-loopback socket to {address!r}")
    return _real_connect(self, address)


def _guarded_connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address):
        raise NetworkAccessError(f"test tried to open a non-loopback socket to {address!r}")
    return _real_connect_ex(self, address)


def _guarded_getaddrinfo(host, *args, **kwargs):
    if host is not None and not _is_local((host if isinstance(host, str) else host.decode(), 0)):
        raise NetworkAccessError(f"test tried to resolve the non-loopback host {host!r}")
    return _real_getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test that opens (or resolves) a non-loopback address."""
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", _guarded_getaddrinfo)
    yield


@pytest.fixture(autouse=True)
def normal_verbosity():
    """A test that runs a command with --quiet / --verbose in-process, or meets a warning, must not change the
    next test's output."""
    yield
    from extract.common import cli

    cli.set_verbosity(cli.NORMAL)
    cli.forget_warnings()  # each test sees its own warnings


@pytest.fixture(autouse=True)
def same_torch_threads():
    """A benchmark run in-process sets torch's thread count; the next test must compute with the count the worker
    started with, or a run compared bit for bit with one made earlier (a resume against the session's trained
    ComAlign) differs in float rounding."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        wanted = before if before is not None else int(os.environ["OMP_NUM_THREADS"])
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)


@pytest.fixture
def one_thread():
    """Training steps of the tiny model gain nothing from a second thread, and on a busy 2-core machine OpenMP's
    spinning threads make them several times slower (``pytestmark = pytest.mark.usefixtures("one_thread")``);
    ``same_torch_threads`` restores the count afterwards."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_toy_cache(tmp_path_factory):
    """Factory: ``tiny_toy_cache(components)`` -> the FeatureCache of one 60-scene toy world (train split) under
    the random tiny backbone with those components; built once per component set and session."""
    from extract.pipeline import build_cache
    from extract.worlds.toyworld import generate

    root = tmp_path_factory.mktemp("tiny-toy")
    generate(root / "toy", 60, 0)
    built = {}

    def make(components):
        key = tuple(sorted(components))
        if key not in built:
            built[key] = build_cache(root / "toy", root / "cache", base="tiny", components=list(key), workers=0)
        return built[key]

    return make


# What a failure report needs first: which versions pip resolved. A fresh venv takes the newest release of every
# unpinned package (pytest 9.2 broke a test that passed on 9.0), so the run names them before any test result.
KEY_PACKAGES = ("pytest", "torch", "torchvision", "open_clip_torch", "numpy", "hypothesis", "gradio", "gradio_client",
                "faiss-cpu", "pyarrow", "accelerate", "spacy", "ultralytics", "sam2", "scikit-learn", "clip-benchmark",
                "playwright", "safetensors", "pillow")


@pytest.fixture(scope="session")
def crop_top1():
    """``top1(base, world, objects, classes, prompt="a {}")``: whether each object's crop (its ``crop`` file under
    ``world``) is classified right among the "a colour shape" prompts of ``classes`` [(colour, shape)] ("colour
    shape" written into ``prompt``), by the base's cosine."""
    import torch
    from PIL import Image

    from extract.models.backbone import load_backbone

    def top1(base: str, world: Path, objects: list[dict], classes: list[tuple[str, str]],
             prompt: str = "a {}") -> torch.Tensor:
        bb = load_backbone(base)
        texts = bb.encode_texts([prompt.replace("{}", f"{c} {s}") for c, s in classes]).embedding
        images = torch.stack([bb.preprocess(Image.open(world / o["crop"]).convert("RGB")) for o in objects])
        truth = torch.tensor([classes.index((o["colour"], o["shape"])) for o in objects])
        with torch.no_grad():
            return (bb.encode_images(images).embedding @ texts.T).argmax(1) == truth

    return top1


def installed_versions(names=KEY_PACKAGES) -> list[str]:
    """``["pytest 9.2.0", "torch 2.14.1", ...]``: each distribution's installed version, or "absent"."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return [f"{name} {one(name)}" for name in names]


def pytest_report_header(config):
    import sys
    import time

    rows = [[]]
    for item in installed_versions():  # a few per line, never split inside "name version"
        if rows[-1] and len(", ".join(rows[-1] + [item])) > 100:
            rows.append([])
        rows[-1].append(item)
    return [f"plugvlm test environment: Python {sys.version.split()[0]} at {sys.prefix}, {time.strftime('%H:%M:%S')}",
            *(("packages: " if n == 0 else "  ") + ", ".join(row) + ("," if n < len(rows) - 1 else "")
              for n, row in enumerate(rows))]


_STARTED: list[float] = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every run ends with its wall time and its ten slowest tests (tests/fixtures/run_summary.py)."""
    import time

    from fixtures.run_summary import summary_lines

    if not _STARTED or hasattr(config, "workerinput"):  # the xdist controller reports, its workers do not
        return
    reports = [r for key in ("passed", "failed", "error", "skipped", "") for r in terminalreporter.stats.get(key, [])]
    terminalreporter.section("plugvlm: wall time and the slowest tests")
    for line in summary_lines(time.monotonic() - _STARTED[0], reports):
        terminalreporter.write_line(line)
    if config.getoption("write_durations"):
        from fixtures.balance import write_durations

        # -m / -k leave tests out (under xdist the controller is not told which): the files' seconds stay as they are
        whole = not (config.option.markexpr or config.option.keyword)
        written = write_durations(reports, whole=whole, root=Path(__file__).resolve().parent.parent)
        terminalreporter.write_line(f"seconds per test{' and per file' if whole else ''} written to {written}")


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help="plugvlm: store this run's seconds in tests/durations.json: per test (the slow marker's "
                          "measured bar) and, when no test was left out, per file (the order files go to the "
                          "workers in); run the whole suite, then the fast subset (-m 'not slow')")


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """``-q`` hides pytest's header (the README's and CI's command use it): write the same lines anyway."""
    import time

    _STARTED[:] = [time.monotonic()]
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() < 0:
        for line in pytest_report_header(config):
            reporter.write_line(line)


def pytest_collection_modifyitems(session, config, items):
    """Heaviest test files first (tests/fixtures/balance.py), so the two workers finish together; with
    ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml) xdist hands the files out in this order."""
    from fixtures.balance import heaviest_files_first

    items[:] = heaviest_files_first(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """The slow marker's rule (tests/fixtures/slow_rule.py): what the test's fixtures start counts too."""
    from fixtures import slow_rule

    slow_rule.install()
    slow_rule.start()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    from fixtures import slow_rule

    result = yield
    found = slow_rule.reasons()
    if found and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts {found[0]!r}: mark it @pytest.mark.slow (the rule: two processes, the demo "
                    "end to end, an inductor compile; tests/fixtures/slow_rule.py)", pytrace=False)
    return result
