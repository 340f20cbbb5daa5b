"""The page at `/`: a chat playground and a live dashboard, for a person with a browser.

Three static files (nanopaged/entrypoints/frontend/: index.html, app.js, style.css), read once and
served as they are, without the API key: they hold no data. What the page shows comes from routes
behind the key like every other: /v1/models, /v1/chat/completions, and /dashboard.json, the
engine's figures over the last minutes (dashboard.py). No file names a remote address, and the
Content-Security-Policy header lets the page load nothing but this server's own files, so it works
on a machine with no internet. `nanopaged serve --disable-frontend` leaves all of it out (404).
docs/08_server.md, "The page".
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

FOLDER = Path(__file__).resolve().parent.parent / "frontend"
# path -> (file in FOLDER, media type); these are the paths RequireApiKey leaves open (limits.py).
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/frontend/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/frontend/style.css": ("style.css", "text/css; charset=utf-8")}
PAGE_PATHS = tuple(FILES)
# Only this server's own scripts, styles and connections; `data:` for the empty icon (no /favicon.ico).
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def register_frontend(app: FastAPI, metrics) -> None:
    """Add the page's files and its feed to the app (app.py: build_app); `metrics`: the ServerMetrics
    whose history (dashboard.py) the feed reads."""
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, static(FOLDER / name, media_type), methods=["GET"], include_in_schema=False)

    @app.get("/dashboard.json")
    async def dashboard() -> dict:
        """The engine's figures now and over the last minutes, for the page's charts."""
        history = metrics.history
        return {"interval_s": history.interval_s, "window_s": history.window_s, "now": history.latest(),
                "points": history.points()}


def static(file: Path, media_type: str):
    """A route answering one file, read now: a file missing from the install stops the start here."""
    body = file.read_bytes()

    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)
    return serve_file
