"""The playground: a page at `/` that chats with the server and shows how each token came
(draft, corrected, bonus, plain), the speculation figures as they stream, a side-by-side run
with speculation off, and the server's /metrics as sparklines. Static files only (static/);
everything the page shows comes from the server's own /v1 routes and /metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

# The page talks to its own server only; the policy makes the browser hold it to that.
_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_playground(app: FastAPI) -> None:
    """`/` serves the page and `/static/` its script and style. The routes stay out of the
    OpenAPI document and in front of no API key: the page is public, its /v1 calls carry the
    key the user types."""

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Content-Security-Policy": _POLICY})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
