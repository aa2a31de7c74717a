"""The web console: `GET /` serves a static page that watches the server through its own API.

The page (`index.html`, `console.js`, `console.css`, shipped as package data; no build step and
nothing loaded from elsewhere) polls `/actors` for the supervision tree and the actors' restarts,
`/metrics` for throughput, KV cache usage and queue charts (the Prometheus text parsed in the
browser), and streams a chat from `/v1/chat/completions`. It holds no data itself, so its three
files answer without the API key; with `--api-key` set, the page asks for the key and sends it as
a bearer token, and the data routes keep refusing a request without it. The Content-Security-Policy
allows only this origin's scripts, styles and fetches.
"""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

#: The page's files by route, with their media types.
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
}

#: The routes that answer without the API key: the page's static files, which carry no data.
CONSOLE_PATHS = frozenset(ASSETS)

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def console_routes() -> list[Route]:
    """The GET routes of the page's files (read once, here: they never change while serving)."""
    here = files(__name__)
    routes = []
    for path, (name, media_type) in ASSETS.items():
        body = here.joinpath(name).read_bytes()

        async def asset(request: Request, body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        routes.append(Route(path, asset, methods=["GET"]))
    return routes
