"""The playground: a page at `/` that chats with the server and shows how each token came
(draft, corrected, bonus, plain), the speculation figures as they stream, a side-by-side run
with speculation off, and the server's /metrics as sparklines. Static files only (static/);
everything the page shows comes from the server's own /v1 routes and /metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"

# The page talks to its own server only; the policy makes the browser hold it to that.
_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# On the page and each of its files (a file opened directly is a page too): no framing (the
# header for browsers without frame-ancestors), no guessing of content types, no referrer.
PAGE_HEADERS = {"Content-Security-Policy": _POLICY, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer"}


class _PageFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def add_playground(app: FastAPI) -> None:
    """`/` serves the page and `/static/` its script and style. The routes stay out of the
    OpenAPI document and in front of no API key: the page is public, its /v1 calls carry the
    key the user types."""

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers=PAGE_HEADERS)

    app.mount("/static", _PageFiles(directory=STATIC_DIR), name="static")
