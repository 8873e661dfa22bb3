"""The Gradio page of ``python -m serve``: text -> image with the model's own re-ranking and a heatmap per noun phrase,
image -> text, the caption probe (base vs adapter on a caption and its hard negative), and an about line.

Everything the page does is a method of :class:`serve.service.Served`, which returns plain data and is tested without
a browser;
:func:`build_blocks` lays out the page over it and names its events, which are the app's Gradio API
(``gradio_client.Client(URL).predict(..., api_name=...)``; the page's "Use via API" link lists them):

    /text_to_image(query, k, rerank, candidates)   -> gallery, hits table, notes
    /heatmap(image_id, caption, method)             -> annotated image, explanation of the re-ranked score
    /image_to_text(upload, image_id, k, rerank, candidates) -> the query image, captions table, notes
    /caption_heatmap(upload, image_id, caption, method)     -> annotated image, explanation
    /caption_probe(upload, image_id, caption_a, caption_b, method) -> preferences table, heatmap A, heatmap B, notes
    /about()                                        -> the about line (Markdown)

``image_id`` names an image of the served collection (its ``image_id`` in ``image.arrow``); ``upload`` is a file
(``gradio_client.handle_file(path)``); give one of the two.

Safety. Collection images are read by their row in the index's metadata, never by a path from a request, and
handed to Gradio as pixels (so Gradio's file route needs no ``allowed_paths``); uploads are read from Gradio's upload
folder only, refused above ``Limits.max_upload_bytes`` and decoded by :func:`extract.data.images.decode_image` with
``Limits.max_pixels`` checked from the header before any pixel is decoded (decompression bombs are refused, not
decoded). At most ``Limits.concurrency`` model computations run at once and ``Limits.queue`` more wait
(:class:`Gate`, shared with the HTTP API); beyond that a request is told the server is busy. Every refused input is
one readable message (a ``gr.Error`` in the page, an ``AppError`` for gradio_client) and the app keeps serving.
No output or error line names a path of the server: every handler's answer goes through ``Served.public``
(serve.redact).
"""
from __future__ import annotations

import functools
import html
import json
import math
import re
import traceback
from typing import Any, Sequence


from serve.heatmap_render import fit
from serve.service import DEFAULT_CANDIDATES, THUMBNAIL, Busy, Heatmaps, Probe, Served

#: the longest side of a gallery thumbnail (px); smaller images are enlarged by a whole factor, pixels kept sharp
def rank_change(hit) -> str:
    """"↑2" (moved up two places by re-ranking), "↓1", or "=" ."""
    moved = hit.rank_before - hit.rank_after
    return "=" if moved == 0 else (f"↑{moved}" if moved > 0 else f"↓{-moved}")


def _score(value) -> str:
    return "" if value is None else f"{value:.4f}"


def gallery_items(served: Served, hits) -> list[tuple[Any, str]]:
    """(thumbnail, caption) per image hit: rank, its move under re-ranking, both scores, id."""
    items = []
    for h in hits:
        moved = f" {rank_change(h)} from #{h.rank_before}" if h.rerank_score is not None else ""
        scores = (f"re-ranked {h.rerank_score:.3f} · stage 1 {h.score:.3f}" if h.rerank_score is not None
                  else f"score {h.score:.3f}")
        items.append((served.thumbnail(h.row), f"#{h.rank_after}{moved} · {scores} · {h.id}"))
    return items


HIT_HEADERS = ["rank", "stage-1 rank", "change", "stage-1 score", "re-ranked score", "id", "caption"]


def hits_table(hits) -> dict:
    """The hits as gr.Dataframe data (``headers``, ``data``): image hits show their first caption, caption hits
    their text."""
    data = []
    for h in hits:
        caption = h.text if h.text is not None else next(iter(h.metadata.get("captions") or []), "")
        data.append([h.rank_after, h.rank_before, rank_change(h), _score(h.score), _score(h.rerank_score),
                     h.id, caption])
    return {"headers": HIT_HEADERS, "data": data}


def notes_text(hits, extra: Sequence[str] = ()) -> str:
    """The search's notes and timings as Markdown."""
    stages = ", ".join(f"{k} {v:.1f} ms" for k, v in hits.timings.items())
    what = "images" if hits.direction == "t2i" else "captions"
    head = (f"{len(hits)} {what} of {hits.considered} candidates"
            + (f", first {hits.rerank} re-ranked by the model" if hits.rerank else ", first stage only")
            + (f" · {stages}" if stages else ""))
    return "\n".join([head] + [f"- {html.escape(n)}" for n in [*extra, *hits.notes]])


def explanation_text(heat: Heatmaps) -> str:
    """The phrases' peaks and, for ComAlign, its text->image score rebuilt from the winning components (eq. 10); for
    the grounded relation head, each relation's subject and object boxes, P(it holds) and, in words, the overlap
    evidence of that pair of boxes (serve.heatmap.OverlapEvidence: where they overlap, whose pixels fill it)."""
    lines = [f"heatmap: **{heat.method}** · " + ", ".join(
        f"{html.escape(m.label)} (peak {m.peak:.3f})" for m in heat.maps)]
    e = heat.explanation
    if e is not None:
        lines += ["", "| component | kind | winning box | similarity |", "|---|---|---|---|"]
        for c in e.components:
            box = "none" if c.box is None else "(" + ", ".join(f"{v:.0f}" for v in c.box) + ")"
            lines.append(f"| {html.escape(c.text)} | {c.kind} | {box} | {c.score:.4f} |")
        if e.overlaps:
            lines.append("")
            lines += [f"- overlap, *{html.escape(ev.relation)}*: {html.escape(ev.sentence())}" for ev in e.overlaps]
        terms = " + ".join(f"{e.weights[k]:.3f} × {k} {e.terms[k]:.4f}" for k in e.weights)
        lines += ["", f"score = {terms} = **{e.score:.4f}** (the re-ranked text→image score)"]
    if heat.note:
        lines += ["", f"- {html.escape(heat.note)}"]
    return "\n".join(lines)


def probe_table(probe: Probe) -> dict:
    data = [[r["model"], f"{r['score_a']:.4f}", f"{r['score_b']:.4f}", r["prefers"]] for r in probe.rows]
    return {"headers": ["model", "caption A", "caption B", "prefers"], "data": data}


# --------------------------------------------------------------------------------------------- calls through the API
_CALL = re.compile(r"^/gradio_api/(?:call|run|api)/(?!v2/)([^/]+)/?$")
_CALL_V2 = re.compile(r"^/gradio_api/call/v2/([^/]+)/?$")


def call_problem(blocks, path: str, body) -> str | None:
    """Why a Gradio API call of this page (``POST /gradio_api/call|run|api/<name>``, ``/call/v2/<name>`` or the
    page's ``/gradio_api/queue/join``) cannot even reach its event, or None: the number of its arguments, and a file
    argument that is not a file reference. Gradio fails on those before any of our code runs, and prints a
    traceback in the server's log for each; refused here with one line instead. A value of the wrong kind for its
    input (a word for a slider) reaches the event and is answered there, by :func:`check_inputs`, as an error
    event every client reads (gradio_client raises it as AppError). Anything else (an unknown name, a body of
    another shape) is left to Gradio, which answers it."""
    import gradio as gr

    if not isinstance(body, dict):
        return None
    fn = None
    m = _CALL.match(path) or _CALL_V2.match(path)
    if m:
        fn = next((f for f in blocks.fns.values() if f.api_name == m.group(1)), None)
    elif path.rstrip("/") == "/gradio_api/queue/join" and isinstance(body.get("fn_index"), int):
        fn = blocks.fns.get(body["fn_index"])
    data = body.get("data")
    if fn is None or not isinstance(data, list):
        return None
    name = fn.api_name if isinstance(fn.api_name, str) else f"event {fn._id}"
    if len(data) != len(fn.inputs):
        return f"{name} takes {len(fn.inputs)} arguments, got {len(data)}"
    for k, (component, value) in enumerate(zip(fn.inputs, data)):
        if isinstance(component, gr.File) and value is not None and not isinstance(value, dict):
            return (f"{name}: argument {k + 1} ({component.label}): expected a file (upload it: "
                    "gradio_client.handle_file) or null")
    return None


def check_inputs(blocks) -> None:
    """Make every input of the page's events refuse a value of the wrong kind with one line (a gr.Error that prints
    nothing in the server's log) before Gradio's own handling of it, which answers too but prints a traceback
    first: each component's ``preprocess`` is wrapped with :func:`argument_problem`."""
    import functools

    import gradio as gr

    seen = set()
    for fn in blocks.fns.values():
        for component in fn.inputs:
            if id(component) in seen or isinstance(component, (gr.File, gr.State)):
                continue
            seen.add(id(component))
            original = component.preprocess

            @functools.wraps(original)
            def preprocess(payload, component=component, original=original):
                label = getattr(component, "label", None) or type(component).__name__
                problem = argument_problem(component, payload)
                if problem:
                    raise gr.Error(html.escape(f"{label}: {problem}"), print_exception=False)
                try:
                    return original(payload)
                except gr.Error as e:
                    raise gr.Error(e.message, print_exception=False) from None
                except Exception as e:  # Gradio's own check of the value: its message, on one line
                    raise gr.Error(html.escape(f"{label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"),
                                   print_exception=False) from None

            component.preprocess = preprocess


def argument_problem(component, value) -> str | None:
    """What is wrong with ``value`` as the input of ``component`` of this page, or None (a file argument is checked
    by :func:`call_problem` and serve.request_guard.file_problem, before Gradio reads it)."""
    import gradio as gr

    def number() -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if isinstance(component, gr.Slider):
        if not number():
            return f"expected a number, got {_shown(value)}"
        if not component.minimum <= value <= component.maximum:
            return f"expected {component.minimum:g} to {component.maximum:g}, got {value:g}"
        return None
    if isinstance(component, gr.Checkbox):
        return None if isinstance(value, bool) else f"expected true or false, got {_shown(value)}"
    if isinstance(component, (gr.Radio, gr.Dropdown)):
        choices = [c[1] if isinstance(c, (tuple, list)) else c for c in (component.choices or [])]
        if value is None or (isinstance(component, gr.Dropdown) and component.allow_custom_value
                             and isinstance(value, (str, int, float)) and not isinstance(value, bool)):
            return None
        return None if value in choices else f"expected one of {', '.join(map(str, choices[:8]))}, got {_shown(value)}"
    if isinstance(component, gr.Textbox):
        return None if value is None or isinstance(value, str) else f"expected text, got {_shown(value)}"
    return None


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=True) if isinstance(value, (str, int, float, bool, type(None))) else \
        type(value).__name__
    return text if len(text) <= 60 else text[:60] + "..."


# --------------------------------------------------------------------------------------------- the page
def page_error(e: BaseException, public=None) -> str:
    """The one readable line a refused request shows, through ``public`` (Served.public: no server path) and
    HTML-escaped (Gradio renders error messages as HTML)."""
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    return html.escape(public(line) if public is not None else line)


def _guard(fn, public=None):
    """Wrap a page handler: its outputs go through ``public`` (Served.public: no server path in any answer of the
    page or its API); refused input and a busy server become a gr.Error with their message; anything else is
    logged with its traceback on the console and shown as one line, and the app keeps serving."""
    import functools

    import gradio as gr

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except gr.Error:
            raise
        except (ValueError, OSError, Busy) as e:
            raise gr.Error(page_error(e, public), duration=15, print_exception=False) from None
        except Exception as e:  # a bug: the traceback goes to the server's console, the page gets one line
            traceback.print_exc()
            raise gr.Error(f"internal error ({html.escape(type(e).__name__)}); the server logged it and keeps "
                           "serving", duration=15, print_exception=False) from None
        return out if public is None else public(out)

    return wrapped


def page_theme():
    """Gradio's default theme with system fonts: the page fetches no web font (it works offline)."""
    import gradio as gr

    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def build_blocks(served: Served):
    """The gr.Blocks page over ``served`` (module docstring), its queue set from ``served.limits``."""
    import gradio as gr

    guard = functools.partial(_guard, public=served.public)  # every answer of the page: no server path
    methods = list(served.heatmap_methods)
    example = served.examples[0] if served.examples else None
    id_choices = served.image_ids(2000)  # a dropdown of a million ids helps nobody; any id can be typed
    first_id = example.image_id if example else (id_choices[0] if id_choices else None)

    def image_input(label: str, elem: str):
        with gr.Row():
            upload = gr.File(label=f"{label}: upload an image (it takes precedence)", type="filepath",
                             file_count="single", scale=2, elem_id=f"{elem}-upload")
            image_id = gr.Dropdown(choices=id_choices, value=first_id, allow_custom_value=True, scale=1,
                                   label="... or an image of the collection (its id)", elem_id=f"{elem}-image-id")
        return upload, image_id

    def search_controls(noun: str):
        """k, the re-ranking switch (off and fixed for a model without a second stage) and K."""
        second = served.searcher.has_second_stage
        return (gr.Slider(1, 50, value=10, step=1, label=f"k ({noun})"),
                gr.Checkbox(value=second, label="re-rank with the model's score", interactive=second),
                gr.Slider(1, min(1000, served.limits.max_results), value=DEFAULT_CANDIDATES, step=1,
                          label="K (first-stage candidates re-ranked)"))

    def annotated(heat: Heatmaps | None):
        return None if heat is None else (heat.image, heat.annotations)

    @guard
    def text_to_image(query, k, rerank, candidates):
        hits = served.text_to_image(query, k, candidates if rerank else None)
        state = {"query": hits.query, "ids": [h.id for h in hits]}
        return gallery_items(served, hits), hits_table(hits), notes_text(hits), state, hits.query

    @guard
    def heatmap(image_id, caption, method):
        heat = served.heatmaps(served.collection_image(image_id), caption, method)
        return annotated(heat), explanation_text(heat)

    def pick(state, evt):
        ids = (state or {}).get("ids") or []
        return ids[evt.index] if isinstance(evt.index, int) and evt.index < len(ids) else None

    @guard
    def image_to_text(upload, image_id, k, rerank, candidates):
        image = served.query_image(upload, image_id)
        hits = served.image_to_text(image, k, candidates if rerank else None)
        caption = hits[0].text if hits else ""
        return fit(image.image, THUMBNAIL), hits_table(hits), notes_text(hits), caption

    @guard
    def caption_heatmap(upload, image_id, caption, method):
        heat = served.heatmaps(served.query_image(upload, image_id), caption, method)
        return annotated(heat), explanation_text(heat)

    def pick_caption(table, evt):
        try:
            row = evt.index[0] if isinstance(evt.index, (list, tuple)) else int(evt.index)
            rows = table.values.tolist() if hasattr(table, "values") else table["data"]
            return str(rows[row][HIT_HEADERS.index("caption")])
        except (IndexError, KeyError, TypeError, ValueError):
            return gr.skip()

    @guard
    def caption_probe(upload, image_id, caption_a, caption_b, method):
        result = served.probe(served.query_image(upload, image_id), caption_a, caption_b, method)
        notes = "\n".join(f"- {html.escape(n)}" for n in result.notes)
        return (probe_table(result), annotated(result.heat_a), explanation_text(result.heat_a),
                annotated(result.heat_b), explanation_text(result.heat_b), notes)

    # Gradio passes the selection to the parameter annotated gr.SelectData; the class itself, since this module's
    # annotations are strings (from __future__ import annotations) that Gradio cannot resolve to a local import
    pick.__annotations__["evt"] = pick_caption.__annotations__["evt"] = gr.SelectData

    def use_example(label):
        chosen = next((e for e in served.examples if e.label == label), None)
        if chosen is None:
            return gr.skip(), gr.skip(), gr.skip()
        return chosen.image_id, chosen.positive, chosen.negative

    heavy = {"concurrency_id": "model"}  # one concurrency limit shared by every event that runs the model
    # analytics off: the server calls nobody; delete_cache: the heatmaps and thumbnails Gradio saved for the page
    # are removed an hour after they were made, so the disk does not fill over a long run
    with gr.Blocks(title="plugvlm retrieval", analytics_enabled=False, delete_cache=(600, 3600)) as blocks:
        gr.Markdown("## plugvlm: compositional retrieval")
        about = gr.Markdown(served.public(served.about()), elem_id="about")
        with gr.Tab("Text → image", id="t2i"):
            with gr.Row():
                query = gr.Textbox(label="query", placeholder="a red circle to the left of a blue square", scale=4,
                                   elem_id="query", max_length=2000)
                search = gr.Button("Search", variant="primary", scale=1, elem_id="search")
            with gr.Row():
                k, rerank, candidates = search_controls("hits")
            notes = gr.Markdown(elem_id="t2i-notes")
            gallery = gr.Gallery(label="hits (select one for its heatmaps)", columns=5, height="auto",
                                 elem_id="gallery", allow_preview=False, format="png")
            table = gr.Dataframe(headers=HIT_HEADERS, label="hits", interactive=False, elem_id="t2i-table")
            state = gr.State({})
            gr.Markdown("### Heatmap of a hit: where the backbone finds each noun phrase of the query")
            with gr.Row():
                hit_id = gr.Textbox(label="image id", elem_id="hit-id", scale=1)
                hit_caption = gr.Textbox(label="caption whose phrases are mapped", elem_id="hit-caption", scale=3)
                method = gr.Radio(methods, value=methods[0], label="heatmap", elem_id="method", scale=1)
                show = gr.Button("Show heatmap", elem_id="show-heatmap", scale=1)
            heat = gr.AnnotatedImage(label="per-phrase heatmaps", elem_id="heatmap", height=420)
            explanation = gr.Markdown(elem_id="explanation")
        with gr.Tab("Image → text", id="i2t"):
            upload, image_id = image_input("query image", "i2t")
            with gr.Row():
                k2, rerank2, candidates2 = search_controls("captions")
                search2 = gr.Button("Search captions", variant="primary", elem_id="search-captions")
            with gr.Row():
                shown = gr.Image(label="query image", interactive=False, height=260, scale=1)
                with gr.Column(scale=3):
                    notes2 = gr.Markdown(elem_id="i2t-notes")
                    table2 = gr.Dataframe(headers=HIT_HEADERS, label="captions (select one for its heatmaps)",
                                          interactive=False, elem_id="i2t-table")
            with gr.Row():
                caption2 = gr.Textbox(label="caption whose phrases are mapped", scale=3)
                method2 = gr.Radio(methods, value=methods[0], label="heatmap", scale=1)
                show2 = gr.Button("Show heatmap", scale=1)
            heat2 = gr.AnnotatedImage(label="per-phrase heatmaps", height=420)
            explanation2 = gr.Markdown()
        with gr.Tab("Caption probe", id="probe"):
            gr.Markdown("One image, two captions: which does each model prefer? Pre-filled with a caption of the "
                        "image and one of its hard negatives (the toy world's swapped or replaced attributes, "
                        "objects, relations).")
            examples = gr.Dropdown([e.label for e in served.examples], value=example.label if example else None,
                                   label="hard-negative examples of the collection", elem_id="examples")
            upload3, image_id3 = image_input("image", "probe")
            with gr.Row():
                caption_a = gr.Textbox(value=example.positive if example else "", label="caption A",
                                       elem_id="caption-a")
                caption_b = gr.Textbox(value=example.negative if example else "", label="caption B",
                                       elem_id="caption-b")
            with gr.Row():
                method3 = gr.Radio(methods, value=methods[0], label="heatmap")
                compare = gr.Button("Compare", variant="primary", elem_id="compare")
            preferences = gr.Dataframe(headers=["model", "caption A", "caption B", "prefers"], interactive=False,
                                       label="scores (image → text direction)", elem_id="preferences")
            probe_notes = gr.Markdown()
            with gr.Row():
                with gr.Column():
                    heat_a = gr.AnnotatedImage(label="caption A's phrases", height=360, elem_id="heat-a")
                    explain_a = gr.Markdown()
                with gr.Column():
                    heat_b = gr.AnnotatedImage(label="caption B's phrases", height=360, elem_id="heat-b")
                    explain_b = gr.Markdown()

        # the named endpoints first: an event registered earlier with the same function would take its name
        gr.on([search.click, query.submit], text_to_image, [query, k, rerank, candidates],
              [gallery, table, notes, state, hit_caption], api_name="text_to_image", **heavy)
        show.click(heatmap, [hit_id, hit_caption, method], [heat, explanation], api_name="heatmap", **heavy)
        search2.click(image_to_text, [upload, image_id, k2, rerank2, candidates2], [shown, table2, notes2, caption2],
                      api_name="image_to_text", **heavy)
        show2.click(caption_heatmap, [upload, image_id, caption2, method2], [heat2, explanation2],
                    api_name="caption_heatmap", **heavy)
        compare.click(caption_probe, [upload3, image_id3, caption_a, caption_b, method3],
                      [preferences, heat_a, explain_a, heat_b, explain_b, probe_notes], api_name="caption_probe",
                      **heavy)
        # Events that run no model skip the queue (queue=False: a plain request, no event stream). A queued event
        # still in flight when the next one joins can lose that one's answer in Gradio's event stream, and the page
        # then waits forever: the about line's load event did it to a search clicked 0.3-0.9 s after the page
        # opened, 2 of 60 page loads (measured here; none of 60 with the load unqueued)
        blocks.load(guard(served.about), None, [about], api_name="about", queue=False)
        # the page's own wiring
        gallery.select(pick, [state], [hit_id], api_visibility="private", queue=False).then(
            heatmap, [hit_id, hit_caption, method], [heat, explanation], api_visibility="private", **heavy)
        method.change(lambda i, c, m: heatmap(i, c, m) if i else (gr.skip(), gr.skip()),  # no hit chosen yet
                      [hit_id, hit_caption, method], [heat, explanation], api_visibility="private", **heavy)
        table2.select(pick_caption, [table2], [caption2], api_visibility="private", queue=False).then(
            caption_heatmap, [upload, image_id, caption2, method2], [heat2, explanation2], api_visibility="private",
            **heavy)
        examples.change(use_example, [examples], [image_id3, caption_a, caption_b], api_visibility="private",
                        queue=False)
    blocks.queue(max_size=served.limits.queue, default_concurrency_limit=served.limits.concurrency)
    check_inputs(blocks)
    return blocks
