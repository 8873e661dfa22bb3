"""train.bench.serve_load against the app launched in-process: a short bounded run of both phases (first stage and
re-ranked) has zero errors and reports its figures; the request cap ends a phase before its time cap; only loopback
URLs are accepted. (The 60-second measurement is the command's job, not a test's.)
"""
from __future__ import annotations


import pytest

from train.bench.serve_load import LoadOptions, check_url, load_test, parse_args, queries, report



@pytest.mark.slow
def test_a_short_run_of_both_phases_has_no_errors(server):
    result = load_test(LoadOptions(url=server.url, clients=3, seconds=1.5, warmup=3, k=5, rerank=8))
    names = [p["name"] for p in result["phases"]]
    assert names == ["text->image, first stage", "text->image, re-ranked K=8"]
    for p in result["phases"]:
        assert p["requests"] > 3 and p["error_count"] == 0 and p["met"], p
        assert 0 < p["p50_ms"] <= p["p99_ms"] and p["rps"] > 0 and p["seconds"] >= 1.0  # ran to its time cap
        assert p["rss_start"] > 0 and p["rss_end"] > 0 and p["growth_mib"] is not None
    assert result["phases"][1]["body"]["rerank"] is True and result["phases"][1]["body"]["k_candidates"] == 8
    text = report(result)
    assert "re-ranked K=8" in text and "misses the bar" not in text and result["served"]["images"] == 12


@pytest.mark.slow
def test_the_request_cap_ends_a_phase_before_its_time_cap(server):
    result = load_test(LoadOptions(url=server.url, clients=2, seconds=120, max_requests=6, warmup=0, k=3))
    assert all(p["requests"] == 6 and p["seconds"] < 120 for p in result["phases"])  # ended by the request cap


def test_only_loopback_urls_and_bounded_options(capsys):
    assert check_url("http://127.0.0.1:7860") == "http://127.0.0.1:7860/"
    assert check_url("http://localhost:7860/") == "http://localhost:7860/"
    for url in ("http://10.1.2.3:7860/", "http://example.com/", "https://127.0.0.1/", "127.0.0.1:7860"):
        with pytest.raises(ValueError, match="--url"):
            check_url(url)
    for argv in (["--seconds", "0"], ["--seconds", "601"], ["--clients", "0"], ["--max-requests", "-1"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and argv[0] in err and argv[1] in err, err  # the flag and the value it refused
    texts = queries()
    assert len(set(texts)) == len(texts) == 512 and all(t.startswith("a ") for t in texts)
