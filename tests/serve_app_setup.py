"""Fixtures shared by the app's tests (test_serve_app, _http, _browser, _load_test), imported by name.

``setup``: the session's ComAlign index of the toy world's 12-image test split (tests/test_serve_search.py).
``served``: that index served with :data:`LIMITS` and its served R@k measured (the about line as python -m serve
shows it); ``server``: the app (page and JSON API) running in-process on a free loopback port. Both are made once
per test process and shared by the four modules (a fixture imported into several modules is a fixture of each, so
the sharing is here): opening the model, loading spaCy for the heatmaps, building the page and starting the server
happen once. The server is stopped when pytest ends. Tests that change ``served`` (its gate) do it through
``monkeypatch``.
"""
from __future__ import annotations

import pytest

from serve.app import Limits, Served, measure_recall
from serve.search import Searcher

#: small enough that a test can cross them cheaply: 64 KiB uploads (request bodies: their base64 plus 1 MiB), 1 Mpx
LIMITS = Limits(max_upload_bytes=64 * 1024, max_pixels=1_000_000)

_SHARED: dict = {}


def shared_served(setup) -> Served:
    """The process's Served of ``setup.adapter_index`` (made on first use)."""
    key = ("served", str(setup.adapter_index))
    if key not in _SHARED:
        searcher = Searcher.open(setup.adapter_index)
        _SHARED[key] = Served(searcher, LIMITS, recall=measure_recall(searcher))
    return _SHARED[key]


def shared_server(served: Served, config):
    """The process's running app over ``served``; pytest's end stops it (``config.add_cleanup``)."""
    key = ("server", id(served))
    if key not in _SHARED:
        from serve.http import RunningServer, create_app

        running = RunningServer(create_app(served))
        config.add_cleanup(running.stop)
        _SHARED[key] = running
    return _SHARED[key]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_serve_search import serve_setup

    return serve_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def served(setup):
    return shared_served(setup)


@pytest.fixture(scope="module")
def server(served, request):
    return shared_server(served, request.config)
