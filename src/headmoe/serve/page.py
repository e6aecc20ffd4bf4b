"""The web page of ``headmoe serve``: ``GET /`` and its script and style sheet.

A static page (`headmoe/serve/web/`, package data: plain HTML, CSS and JavaScript, no build
step, nothing from another site) on the server's own HTTP API: it lists the served model's
presets (``GET /v1/models``), submits jobs (``POST /v1/videos``, JSON or multipart with the
image), polls ``GET /v1/videos`` for the progress bars and the list of jobs, and plays a
finished one from ``GET /v1/videos/{id}/content``. The page and its two files need no key
(they hold nothing of the server's); every API call it makes sends the key the person types
as ``Authorization: Bearer <key>``, which the API checks as it checks any client's.

Every response of the page carries `CONTENT_SECURITY_POLICY`: scripts only from the
server's own files (no inline script, no ``eval``), requests only to the server itself,
media and images from it or from the page's own ``blob:`` URLs (the fetched video, the
dropped image's preview).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: the page's files (in ``headmoe/serve/web/``) and their media types; ``/`` is index.html,
#: the others are served at ``/web/<name>``
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' blob: data:; media-src 'self' blob:; form-action 'none'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def page_files() -> dict[str, bytes]:
    """The bytes of each of `FILES`, read from the installed package (a missing one raises
    `FileNotFoundError` naming it, when the app is made)."""
    folder = resources.files("headmoe.serve").joinpath("web")
    return {name: folder.joinpath(name).read_bytes() for name in FILES}


def add_page(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files at ``/web/<name>`` (no key needed)."""
    files = page_files()

    def respond(name: str) -> Response:
        return Response(files[name], media_type=FILES[name], headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return respond("index.html")

    @app.get("/web/app.js", include_in_schema=False)
    async def script() -> Response:
        return respond("app.js")

    @app.get("/web/style.css", include_in_schema=False)
    async def style() -> Response:
        return respond("style.css")
