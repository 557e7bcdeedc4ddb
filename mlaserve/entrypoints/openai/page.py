"""The web page `mlaserve serve` shows at / (engine option `ui`; docs/UI.md): static files shipped in
the package (entrypoints/openai/ui/), plain JavaScript with no build step and no third-party library.

The files are public even when an API key is set (they hold no data); every call the page makes to the
server's own endpoints carries the key, which the page asks for once and keeps in sessionStorage.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

UI_DIR = Path(__file__).with_name("ui")
# URL path -> (file, media type); "/" is the page itself, the rest is what index.html loads.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}


def add_page(app: FastAPI) -> None:
    """Serve PAGE_FILES (read at each request: a few KB; an edited file shows on reload)."""
    for url, (name, media) in PAGE_FILES.items():

        async def send(name=name, media=media) -> Response:
            # no-cache: a browser revalidates, so a server upgraded in place never runs yesterday's script
            return Response((UI_DIR / name).read_bytes(), media_type=media, headers={"Cache-Control": "no-cache"})

        app.add_api_route(url, send, methods=["GET"], include_in_schema=False)
