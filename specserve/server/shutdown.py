"""The server's graceful stop: uvicorn's, with the end of the grace period handled by the engine.

On SIGTERM uvicorn closes its listeners and waits for open connections. When the grace period
runs out, uvicorn itself would cancel the tasks still running, cutting streams mid-chunk (no
finish_reason, no `data: [DONE]`, a CancelledError per stream in the log). Here the engine
aborts every request at that moment instead: each stream gets its last chunk with
finish_reason "abort" and its `data: [DONE]`, and each waiting client its answer, so the
connections close by themselves. uvicorn's cancellation stays as the last resort, a margin later.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from specserve.engine.async_engine import AsyncEngine

# How long the aborted requests get to send their last chunks before uvicorn cancels what is
# left: an engine step (aborts land at step boundaries) plus a write.
CUT_MARGIN_S = 10.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server(uvicorn.Config(app, **options)) serving `engine`, whose requests get
    `grace_period_s` seconds to finish once a stop was asked for."""

    def __init__(self, app, engine: AsyncEngine, grace_period_s: float, **options):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_period_s + CUT_MARGIN_S, **options))
        self.engine = engine
        self.grace_period_s = grace_period_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # New requests on connections still open get 503 (and /health says so) while running
        # ones finish.
        self.engine.stop_accepting()
        cut = asyncio.get_running_loop().call_later(self.grace_period_s, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()
