"""The try-a-voice web page at `/`: static files shipped in the package (web/), no build step, no CDN."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response

WEB_DIR = Path(__file__).with_name("web")


async def index(request: Request) -> Response:
    """The page itself."""
    return FileResponse(WEB_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})
