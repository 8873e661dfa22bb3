"""The page in a real browser: headless Chromium (Debian's ``chromium`` package) driven by Playwright types a query,
sees k results, opens the heatmap of a hit, searches captions for an image, runs the caption probe and uploads a
non-image to see the error message. Playwright's own browser download is never used (``executable_path``).

Skipped, with the reason, where Chromium or Playwright is missing. With ``PLUGVLM_SCREENSHOTS=1`` it saves a
screenshot of each panel under examples/serve/ (the README's pictures); otherwise it writes nothing there. The
README's pictures show the demo's trained model, not the tests' random-weights one:

    PLUGVLM_SCREENSHOTS=1 PLUGVLM_SCREENSHOT_INDEX=runs/demo/index python -m pytest tests/serve/test_serve_browser.py

(``PLUGVLM_SCREENSHOT_INDEX``: the index the page serves instead of the tests' own; the same checks run on it.)
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

from fixtures.serve import shared_served

CHROMIUM = Path(os.environ.get("PLUGVLM_CHROMIUM", "/usr/bin/chromium"))
# offline and quiet: no sandbox (root in CI containers), no GPU, nothing phoned home
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "examples" / "serve"
QUERY = "a red circle to the left of a blue square"
WAIT_MS = 180_000  # per expectation; met at once on a quiet machine, in 60+ s on a loaded one (seen in CI)


def _skip_reason() -> str | None:
    if not CHROMIUM.is_file():
        return (f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does), or set PLUGVLM_CHROMIUM "
                "to a Chromium binary")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed: pip install playwright (the dev extra); never `playwright install`"
    return None


if _skip_reason():
    print(f"\n{__name__} skipped: {_skip_reason()}")
pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def served(setup):
    index = os.environ.get("PLUGVLM_SCREENSHOT_INDEX")
    if not index:
        return shared_served(setup)
    from serve.service import Served

    return Served.open(index, recall=True)


class PageLog:
    """What the page sent and heard, for a failure's message: its Gradio API requests and their answers, failed
    requests, console errors (the last :attr:`keep`, each with seconds since the page opened)."""

    keep = 25

    def __init__(self):
        self.t0, self.lines = time.perf_counter(), []

    def add(self, text: str) -> None:
        self.lines = [*self.lines[-(self.keep - 1):], f"{time.perf_counter() - self.t0:.1f}s {text}"]

    def attach(self, page) -> None:
        def short(url: str) -> str:
            return url.split("//", 1)[-1].split("/", 1)[-1][:90]

        def api(url: str) -> bool:  # the API's calls and streams; the images' file= requests only when they fail
            return "gradio_api" in url and "/file=" not in url

        page.on("request", lambda r: api(r.url) and self.add(f"> {r.method} {short(r.url)}"))
        page.on("response", lambda r: (api(r.url) or r.status >= 400) and self.add(f"< {r.status} {short(r.url)}"))
        page.on("requestfailed", lambda r: self.add(f"! failed {short(r.url)}: {r.failure}"))
        page.on("console", lambda m: m.type in ("error", "warning") and self.add(f"console {m.type}: {m.text[:200]}"))


def server_state(server) -> str:
    """The in-process server's side of a failure: each Gradio concurrency group's waiting and running events, the
    last events it recorded, and where its worker threads are (the innermost frames of each)."""
    import sys
    import threading
    import traceback

    lines = []
    try:
        queue = server.blocks._queue
        for cid, q in queue.event_queue_per_concurrency_id.items():
            lines.append(f"group {cid}: {len(q.queue)} waiting, {q.current_concurrency} running")
        now = time.time()
        for a in list(queue.event_analytics.values())[-6:]:
            lines.append(f"event {a['function']} {a['status']} {now - a['time']:.1f}s ago, took {a['process_time']}")
    except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure it explains
        lines.append(f"(queue state unreadable: {type(e).__name__}: {e})")
    frames, where = sys._current_frames(), Counter()
    for thread in threading.enumerate():
        if thread.name.startswith(("AnyIO", "plugvlm-serve", "ThreadPool")) and thread.ident in frames:
            stack = traceback.extract_stack(frames[thread.ident])[-4:]
            where[f"{thread.name}: " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                                   for f in reversed(stack))] += 1
    lines += [f"{n} x thread {text}" for text, n in where.items()]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def page_log():
    return PageLog()


@pytest.fixture(scope="module")
def page(server, page_log):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.set_default_timeout(WAIT_MS)
            page_log.attach(page)
            page.goto(server.url)
            yield page
        finally:
            browser.close()


def shot(page, name: str, full_page: bool = False) -> None:
    """Save the panel's screenshot for the README, only when asked (PLUGVLM_SCREENSHOTS=1); ``full_page``: the
    whole page, not only the window (the probe's two heatmaps lie below it)."""
    if os.environ.get("PLUGVLM_SCREENSHOTS") != "1":
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # every picture on the page decoded first (gallery thumbnails arrive after the table)
    page.wait_for_function("() => [...document.images].every(i => i.complete && i.naturalWidth > 0)")
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=full_page)


class Walk:
    """The steps of the walk through the page and how long each took; on a failed expectation, what the page showed
    (its error messages, the searches' notes, the query box) and the steps' times are added to the message: on a
    busy CI machine a failure is otherwise only "0 thumbnails"."""

    def __init__(self, page):
        self.page, self.times, self.name, self.t0 = page, [], "start", time.perf_counter()

    def step(self, name: str) -> None:
        now = time.perf_counter()
        self.times.append(f"{self.name} {now - self.t0:.1f} s")
        self.name, self.t0 = name, now

    def texts(self, selector: str) -> list[str]:
        try:
            return [t.strip() for t in self.page.locator(selector).all_inner_texts() if t.strip()]
        except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure it explains
            return [f"({type(e).__name__})"]

    def state(self) -> str:
        return (f"failed in step {self.name!r} after {time.perf_counter() - self.t0:.1f} s; steps before: "
                f"{', '.join(self.times)}\npage: toasts {self.texts('.toast-body')}, t2i notes "
                f"{self.texts('#t2i-notes')}, i2t notes {self.texts('#i2t-notes')}, query box {self.query()!r}")

    def query(self) -> str:
        try:
            return self.page.locator("#query textarea").input_value(timeout=5_000)
        except Exception as e:  # noqa: BLE001 - as in texts()
            return f"({type(e).__name__})"


@pytest.mark.slow
def test_the_page_in_a_real_browser(page, page_log, served, server, tmp_path):
    walk = Walk(page)
    try:
        walk_the_page(page, served, tmp_path, walk)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{walk.state()}\nthe page's requests and errors:\n  "
                             + "\n  ".join(page_log.lines) + f"\nthe server:\n{server_state(server)}") from None


def walk_the_page(page, served, tmp_path, walk: Walk) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)  # a busy CI machine is slow, not wrong
    walk.step("the about line")
    about = page.locator("#about")
    n_images, n_captions = served.searcher.num_images, served.searcher.num_captions
    expect(about).to_contain_text(f"{n_images:,} images, {n_captions:,} captions")
    expect(about).to_contain_text("first stage: text→image")
    # text -> image: k hits with both scores, then one hit's heatmaps
    walk.step("text -> image search")
    page.locator("#query textarea").fill(QUERY)
    page.locator("#search").click()
    thumbnails = page.locator("#gallery .thumbnail-item")
    expect(thumbnails).to_have_count(10)
    expect(page.locator("#t2i-notes")).to_contain_text(f"first {min(50, n_images)} re-ranked by the model")
    expect(page.locator("#gallery")).to_contain_text("re-ranked")
    shot(page, "text_to_image")
    walk.step("a hit's heatmap")
    thumbnails.first.click()
    best = served.searcher.search_text(QUERY, k=1, rerank=50)[0]
    expect(page.locator("#hit-id textarea")).to_have_value(best.id)
    heatmap = page.locator("#heatmap")
    expect(heatmap.locator("img").first).to_be_visible()
    expect(heatmap).to_contain_text("red circle")
    expect(heatmap).to_contain_text("blue square")
    expect(page.locator("#explanation")).to_contain_text("score =")
    heatmap.scroll_into_view_if_needed()
    shot(page, "heatmap")

    # image -> text for an image of the collection, then an upload that is not an image
    walk.step("image -> text search")
    page.get_by_role("tab", name="Image → text").click()
    page.locator("#search-captions").click()
    table = page.locator("#i2t-table [role=grid][aria-rowcount]")  # the grid that counts its rows
    expect(table).to_have_attribute("aria-rowcount", "11")  # a header and 10 captions
    path = served.searcher.collection("image").column("path")[served.row_of(served.image_ids()[0])]
    top = served.searcher.search_image(str(path), k=1, rerank=50)[0].text
    expect(table).to_contain_text(top)
    shot(page, "image_to_text")
    walk.step("an upload that is not an image")
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("this is a text file, not a picture")
    page.locator("#i2t-upload input[type=file]").set_input_files(str(not_an_image))
    # uploaded: the file's download link (the name's text changes form while the upload runs)
    expect(page.locator("#i2t-upload a[href$='/notes.txt']")).to_be_visible()
    page.locator("#search-captions").click()
    error = page.get_by_text("corrupt or unrecognised image data")
    expect(error.first).to_be_visible()
    shot(page, "bad_upload")
    for close in page.locator(".toast-close").all():  # the user dismisses the message; the page goes on serving
        close.click()
    expect(error).to_have_count(0)

    # the caption probe, pre-filled with a hard negative of a collection image
    walk.step("the caption probe")
    page.get_by_role("tab", name="Caption probe").click()
    example = served.examples[0]
    expect(page.locator("#caption-b textarea")).to_have_value(example.negative)
    page.locator("#compare").click()
    preferences = page.locator("#preferences [role=grid][aria-rowcount]")
    expect(preferences).to_have_attribute("aria-rowcount", "3")  # a header, the base and the adapter
    expect(preferences).to_contain_text("base: " + served.base.name)
    expect(preferences).to_contain_text(served.searcher.scorer.name)
    expect(page.locator("#heat-a img").first).to_be_visible()
    expect(page.locator("#heat-b img").first).to_be_visible()
    shot(page, "caption_probe", full_page=True)

    # a script in the page (what a malicious page or extension could do) names a file of the server's disk and a URL
    walk.step("a request from the page naming a server file or a URL")
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG not really")
    for path, message in ((str(secret), "not uploaded to this server"), ("http://127.0.0.1:9/x.png", "fetches no URLs")):
        answer = page.evaluate("""async ([path]) => {
            const r = await fetch('gradio_api/call/image_to_text', {method: 'POST',
                headers: {'Content-Type': 'application/json'},
                body: JSON.stringify({data: [{path, meta: {_type: 'gradio.FileData'}}, null, 3, false, 50]})});
            return [r.status, await r.text()];
        }""", [path])
        assert answer[0] == 403 and message in answer[1], answer
    walk.step("done")
