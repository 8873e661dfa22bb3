"""Fixtures shared by the app's tests (test_serve_app, _http, _browser, _load_test), imported by name: the session's
ComAlign index of the toy world's 12-image test split (tests/test_serve_search.py) served with the test module's
``LIMITS`` (default: serve.app.Limits()) and its served R@k measured when the module sets ``RECALL = True``, and ``server``: the app running in-process on a free loopback port (the
module's ``APP_OPTIONS`` go to serve.http.create_app)."""
from __future__ import annotations

import pytest

from serve.app import Limits, Served, measure_recall
from serve.search import Searcher


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_serve_search import serve_setup

    return serve_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def served(setup, request):
    searcher = Searcher.open(setup.adapter_index)
    recall = measure_recall(searcher) if getattr(request.module, "RECALL", False) else None
    return Served(searcher, getattr(request.module, "LIMITS", Limits()), recall=recall)


@pytest.fixture(scope="module")
def server(served, request):
    from serve.http import RunningServer, create_app

    running = RunningServer(create_app(served, **getattr(request.module, "APP_OPTIONS", {})))
    yield running
    running.stop()
