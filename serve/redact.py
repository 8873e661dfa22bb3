"""What an answer may say about the server's files: a file's name, never where it lies.

Why. A client of ``python -m serve`` needs results and the reasons behind them, not the server's folder layout: a
note that named ``/.../runs/demo/toyworld`` told every caller where the operator keeps the data and who they are
(issue 68; ``image_path`` was the same leak before). Decided here, once, for every answer of the JSON API and the
page:

:func:`source_name`
    how serve's own messages name a file or folder of the server (a box file, an index, an upload): its last
    component ("toyworld"), which the operator recognises and from which a client learns nothing.
:class:`Redactor`
    the net under every answer, for the messages written below serve (extract's box and image readers, an
    OSError's text): in any text, each path of the server becomes its :func:`source_name` -- any absolute path,
    and the relative forms of the server's own files and folders (the index, its data, cache, model and box file,
    as they were typed and relative to the working directory: ``runs/demo/toyworld/x.png`` -> ``x.png``).
    :meth:`serve.service.Served.public` applies it; serve.http runs every JSON answer (bodies, the notes header,
    errors) through it, serve.app every output and error line of the page and of its Gradio API. ``--show-paths``
    (``Limits.show_paths``) turns it off: the operator asked for the layout (a trusted local setup).

Not in its reach: Gradio's own file handles (its upload route's answer, an output picture's ``path`` / ``url``)
name files in Gradio's upload folder (``$GRADIO_TEMP_DIR``, else ``<tmp>/gradio``, as content hashes): they are how
a client fetches the pictures and sends an upload back, and name nothing of the server's own folders.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterable

#: characters that end a path in a message (quotes, brackets, separators of prose and of lists)
_END = r"\s'\"`<>()\[\]{},;|*?"
#: a path starts at a separator no word, URL or number runs into ("http://host/a/b", "11.3/47.2", base64's "+/")
_START = r"(?<![\w.:/\\+~-])"
#: an absolute POSIX path of at least two components ("/a/b"; "/knn-service" alone is a route, not a file), or a
#: Windows drive path
_ABSOLUTE = re.compile(rf"{_START}(?:/(?:[^{_END}/]+/)+[^{_END}/]*|[A-Za-z]:[\\/](?:[^{_END}\\/]+[\\/])*"
                       rf"[^{_END}\\/]*)")
#: dict keys whose values are data, not text: a file's bytes in base64 (``return_image``), which may start with "/"
#: (a JPEG's always does: "/9j/")
DATA_KEYS = frozenset({"image"})


def source_name(path) -> str:
    """How an answer names a server-side file or folder: its last component, without the folders above it
    ("/srv/data/toyworld/" -> "toyworld"; a name without folders stays as it is)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    trimmed = text.rstrip("/\\")
    return re.split(r"[/\\]", trimmed)[-1] or text


class Redactor:
    """Turns every path of the server in a text into its :func:`source_name` (module docstring). ``known``: the
    server's own files and folders (any form: absolute, relative, as typed), found in every form (as typed,
    absolute, links resolved, relative to ``cwd``: the working directory, default the process's), whole even where
    a folder's name holds a space; any other absolute path is found by its shape."""

    def __init__(self, known: Iterable = (), cwd: str | None = None):
        cwd = cwd or os.getcwd()
        forms = set()
        for item in known:
            if item is None or not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
                continue
            text = os.fspath(item)
            absolute = os.path.abspath(os.path.join(cwd, text))
            for form in (text, absolute, os.path.realpath(absolute), os.path.relpath(absolute, cwd)):
                form = form.rstrip("/\\")
                if form.startswith("./"):
                    form = form[2:]
                # forms with a folder in them: a bare name ("index") is a name, not a path
                if not form.startswith("..") and re.search(r"[/\\]", form):
                    forms.add(form)
        self.forms = sorted(forms, key=len, reverse=True)
        self._known = re.compile(
            rf"{_START}(?:\./)?(?:{'|'.join(re.escape(f) for f in self.forms)})(?:[/\\][^{_END}]*)?(?![\w.-])"
        ) if self.forms else None

    def text(self, text: str) -> str:
        """``text`` with each path of the server replaced by its name."""
        if self._known is not None:
            text = self._known.sub(lambda m: source_name(m.group(0)), text)
        return _ABSOLUTE.sub(lambda m: source_name(m.group(0)), text)

    def value(self, value: Any) -> Any:
        """Every text in ``value`` (JSON-like data, or a page's outputs: tuples, lists, dicts) redacted; anything else
        (pictures, arrays, numbers) as it is, and the base64 of a file under a :data:`DATA_KEYS` key untouched."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: v if k in DATA_KEYS else self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.value(v) for v in value)
        return value


def server_paths(searcher) -> list:
    """The files and folders a served index knows of, as its manifest and scorer name them (the index folder as it
    was given, every path-like string of the manifest: data, caches, the model's run folder; the box file and the
    detector of a model that reads boxes): what :class:`Redactor` finds in relative form too."""
    found = [searcher.index_dir]
    stack = [searcher.manifest]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and re.search(r"[/\\]", item) and (os.path.isabs(item) or os.path.exists(item)):
            found.append(item)
    extractor = getattr(searcher.scorer, "extractor", None)
    found += [getattr(getattr(extractor, "boxes", None), "source", None),
              getattr(getattr(extractor, "args", None), "detector", None)]
    return [p for p in found if isinstance(p, (str, os.PathLike))]
