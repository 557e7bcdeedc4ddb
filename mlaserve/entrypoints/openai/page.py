"""The web page `mlaserve serve` shows at / (engine option `ui`; docs/UI.md): static files shipped in
the package (entrypoints/openai/ui/), plain JavaScript with no build step and no third-party library.

The files are public even when an API key is set (they hold no data; /ui/server.json says only whether a
key is needed and whether the debug endpoints are on); every call the page makes to the server's own
endpoints carries the key, which the page asks for once and keeps in sessionStorage.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

UI_DIR = Path(__file__).with_name("ui")
# URL path -> (file, media type); "/" is the page itself, the rest is what index.html loads.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}


# What the page must know before its first call, public like the files: whether to ask for the key
# before calling (no refused call first) and whether the debug endpoints exist (no call to a 404).
SERVER_INFO = "/ui/server.json"
PUBLIC_PATHS = (*PAGE_FILES, SERVER_INFO)


def add_page(app: FastAPI, keyed: bool, debug_endpoints: bool) -> None:
    """Serve PAGE_FILES (read at each request: a few KB; an edited file shows on reload) and SERVER_INFO."""
    for url, (name, media) in PAGE_FILES.items():

        async def send(name=name, media=media) -> Response:
            # no-cache: a browser revalidates, so a server upgraded in place never runs yesterday's script
            return Response((UI_DIR / name).read_bytes(), media_type=media, headers={"Cache-Control": "no-cache"})

        app.add_api_route(url, send, methods=["GET"], include_in_schema=False)
    info = {"api_key": keyed, "debug_endpoints": debug_endpoints}

    async def server_info() -> JSONResponse:
        return JSONResponse(info, headers={"Cache-Control": "no-cache"})

    app.add_api_route(SERVER_INFO, server_info, methods=["GET"], include_in_schema=False)
