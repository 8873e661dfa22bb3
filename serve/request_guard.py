"""What a request may make the server touch: the ASGI middleware in front of every route of ``python -m serve``
(the JSON API and the Gradio page alike), and the rule for file references.

Gradio reads a file named in a request (``{"path": "/any/file", "meta": {"_type": "gradio.FileData"}}``) and copies
it into its cache before the app sees it; its own check that the file came from its upload folder is skipped
for an app mounted with ``gr.mount_gradio_app`` (it runs only once ``launch()`` ran), and a path or url that looks
like ``http(s)://`` is downloaded. Here every request body is read first, bounded, and refused before any route
runs when it names a file that is not a regular file inside the upload folder, or any URL (:func:`file_problem`):
nothing is opened, copied or fetched for it. The same rule guards the app's own reading of an upload
(:func:`inside_upload_folder`, used by ``serve.service.Served.uploaded_image``).

Also refused here: a body over ``max_body`` bytes (413, whether or not it says its length up front: a chunked body
is counted as it arrives), JSON nested deeper than :data:`MAX_DEPTH` (400: Python's parser would recurse until it
fails), a Content-Length that is not a number (400), and Gradio's URL-fetching routes (``/file=http...``,
``/proxy=``; 403). Every refusal is one JSON line ``{"error": ...}``.

A refused request whose body is still on its way ends its connection with the answer (``Connection: close``). Closing
a socket with unread bytes in it makes the kernel send a reset, which can erase the answer before the client reads
it (RFC 9112 §9.6): a client posting a 2 MB image to a 1 MB limit saw "connection reset by peer", not the 413. So a
body that says its length up front, at most :data:`DRAIN_FACTOR` times the limit, is read to its end and dropped
before the answer (:func:`drain`, at most :data:`DRAIN_SECONDS`); a longer one, or one without a length (chunked),
is cut at the answer, so what the server reads stays bounded either way. A client that asked to be told first
(``Expect: 100-continue``) has sent nothing and is answered at once.
"""
from __future__ import annotations

import json
import os
import re
from urllib.parse import unquote, urlsplit

#: JSON deeper than this is refused before it is parsed (a Gradio call nests 4 levels, clip_back's requests 3)
MAX_DEPTH = 64
#: Gradio's upload route: a multipart body, written by Gradio into its upload folder (bounded by max_file_size)
UPLOAD = "/gradio_api/upload"
#: Gradio routes this page never uses that read files a request names (audio / video recordings)
CLOSED = ("/gradio_api/process_recording",)
#: a refused body that says its length is read to its end (and dropped) when at most this many times ``max_body``
DRAIN_FACTOR = 4
#: ... within this many seconds
DRAIN_SECONDS = 10.0
_URL_FETCH = re.compile(r"/(file=(https?:|//)|proxy=)", re.IGNORECASE)
_URL_LIKE = re.compile(r"^\s*([a-z][a-z0-9+.-]*:|//|\\\\)", re.IGNORECASE)  # http:, data:, file:, //host, \\host


class Refused(ValueError):
    """A request refused before it reached a route: ``status`` and the one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def upload_folder() -> str:
    """Gradio's upload folder (``$GRADIO_TEMP_DIR``, else ``<tmp>/gradio``), resolved: what its upload route
    writes into, and the only place a request's file reference may point."""
    import tempfile

    return os.path.realpath(os.environ.get("GRADIO_TEMP_DIR") or os.path.join(tempfile.gettempdir(), "gradio"))


def in_folder(path, folder: str | None = None) -> bool:
    """True when the name ``path``, links and ``..`` resolved, lies strictly inside ``folder`` (default: Gradio's
    upload folder), whether or not it exists. Nothing is opened."""
    if not isinstance(path, (str, os.PathLike)) or _URL_LIKE.match(os.fspath(path)) or "\0" in os.fspath(path):
        return False
    root = os.path.realpath(folder or upload_folder())
    real = os.path.realpath(os.fspath(path))
    return os.path.commonpath([root, real]) == root and real != root


def inside_upload_folder(path, folder: str | None = None) -> bool:
    """:func:`in_folder` and a regular file (examined with stat, not opened)."""
    return in_folder(path, folder) and os.path.isfile(os.path.realpath(os.fspath(path)))


def file_problem(value, folder: str | None = None) -> str | None:
    """Why the request value ``value`` (decoded JSON) may not be served, or None. Every object in it with a
    ``path`` or a ``url`` (Gradio's FileData, in any of its shapes) must name a regular file of the upload folder;
    a ``url`` may only be this server's own ``/file=`` link to that same file (what the page sends back after an
    upload). Any URL-like path is refused: this server fetches nothing."""
    folder = folder or upload_folder()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        stack.extend(item.values())
        if "path" not in item and "url" not in item:
            continue
        path, url = item.get("path"), item.get("url")
        for text in (path, url):
            if text is not None and not isinstance(text, str):
                return "a file reference's path and url must be strings"
        if path is None:
            return "a file reference without a path: upload the file first (gradio_client.handle_file does)"
        if _URL_LIKE.match(path):
            return f"{_shown(path)}: this server fetches no URLs; upload the file instead"
        if not inside_upload_folder(path, folder):
            return (f"{_shown(path)} was not uploaded to this server: only files sent to its upload route are read "
                    "(gradio_client.handle_file uploads a local file)")
        if url is not None and not _own_file_link(url, path):
            return f"{_shown(url)}: this server fetches no URLs; a file reference's url may only be its own /file= link"
    return None


def _own_file_link(url: str, path: str) -> bool:
    """``url`` is ``[scheme://host]/.../file=<path>``: the link Gradio gives an uploaded file (never fetched)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    linked = unquote(parts.path).partition("/file=")[2]
    return bool(linked) and not parts.query and os.path.realpath(linked) == os.path.realpath(path)


def _shown(text: str) -> str:
    return json.dumps(text[:80], ensure_ascii=True)


def json_depth_ok(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when the JSON text ``body`` nests at most ``limit`` arrays / objects (brackets inside strings are not
    counted): checked before parsing, which recurses once per level."""
    depth, in_string, escaped = 0, False, False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def check_body(body: bytes, folder: str | None = None) -> object:
    """The decoded JSON of a request body (None when it is not JSON: left to the route, which refuses it); raise
    :class:`Refused` when it nests too deeply or names a file outside the upload folder or a URL
    (:func:`file_problem`)."""
    if not json_depth_ok(body):
        raise Refused(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(body)
    except ValueError:
        return None
    problem = file_problem(value, folder)
    if problem:
        raise Refused(403, problem)
    return value


class RequestGuard:
    """ASGI middleware (module docstring). ``max_body``: bytes a request body may hold; ``check_call(path, value)``:
    the app's own check of a decoded JSON body (serve.app.call_problem: a Gradio call's arguments against its
    event's inputs), a reason to refuse it with 400, or None."""

    def __init__(self, app, max_body: int, check_call=None):
        self.app, self.max_body, self.check_call = app, max_body, check_call

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        reader = _BodyReader(receive)
        try:
            body = await self._admit(scope, reader.receive)
        except Refused as e:  # the body may be partly unread: the connection ends with the answer (RFC 9112 §9.6),
            # or a client that stopped sending waits on a kept-alive socket for the server to read the rest
            if not reader.ended and drain_first(scope, self.max_body):
                await drain(reader)
            return await json_reply(send, e.status, {"error": str(e)}, close=True)
        if body is None:
            return await self.app(scope, receive, send)
        sent = False

        async def replay():  # the body read here, then whatever the client sends next (its disconnect)
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _admit(self, scope, receive) -> bytes | None:
        """The request's body, read whole and checked (None: a request without one, passed on as it is)."""
        path = unquote(scope.get("path", ""))
        if _URL_FETCH.search(path):
            raise Refused(403, "this server fetches no URLs")
        if path.rstrip("/") in CLOSED:
            raise Refused(403, f"{path} is not served here")
        length = declared_length(scope)
        if length is not None and length > self.max_body:
            raise Refused(413, f"request body of {length:,} bytes refused (at most {self.max_body:,})")
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return None
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "the client went away before its request body ended")
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:  # counted as it arrives: a chunked body says no length up front
                raise Refused(413, f"request body over {self.max_body:,} bytes refused")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if path.rstrip("/") != UPLOAD:  # an upload is multipart: Gradio writes it into the upload folder itself
            value = check_body(body)
            problem = self.check_call(path, value) if self.check_call is not None and value is not None else None
            if problem:
                raise Refused(400, problem)
        return body


def declared_length(scope) -> int | None:
    """The request's Content-Length (None without one); :class:`Refused` (400) when it is not a number."""
    length = dict(scope.get("headers") or []).get(b"content-length")
    if length is None:
        return None
    if not re.fullmatch(rb"[0-9]{1,18}", length.strip()):
        raise Refused(400, "Content-Length is not a number")
    return int(length)


class _BodyReader:
    """``receive`` that notes when the request's body has ended (its last part or the client's disconnect)."""

    def __init__(self, receive):
        self._receive, self.ended = receive, False

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.ended = True
        return message


def drain_first(scope, max_body: int) -> bool:
    """Whether a refused request's unread body is read (and dropped) before the answer (module docstring): it says
    its length, at most DRAIN_FACTOR x ``max_body``, and the client is sending it (no ``Expect: 100-continue``)."""
    try:
        length = declared_length(scope)
    except Refused:
        return False
    expect = dict(scope.get("headers") or []).get(b"expect", b"").lower()
    return length is not None and 0 < length <= DRAIN_FACTOR * max_body and b"100-continue" not in expect


async def drain(reader: _BodyReader, seconds: float | None = None) -> None:
    """Read the rest of the body and drop it, until it ends or ``seconds`` (DRAIN_SECONDS) pass: a client that
    stalls is then cut, as without the drain."""
    import asyncio

    seconds = DRAIN_SECONDS if seconds is None else seconds

    async def read_all():
        while not reader.ended:
            await reader.receive()

    try:
        await asyncio.wait_for(read_all(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


async def json_reply(send, status: int, payload: dict, close: bool = False) -> None:
    """A complete JSON response (``ensure_ascii``: any text a client sent is echoed safely); ``close``: the server
    closes the connection once it is sent (``Connection: close``)."""
    body = json.dumps(payload, ensure_ascii=True).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})
