"""A real specserve server on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn

from specserve.llm import LLM
from specserve.server.connections import connection_protocol
from specserve.server.launcher import _bind, allowed_hosts, build_app_for
from specserve.server.serving import ServerConfig


class RunningServer:
    """`with RunningServer(llm, ...) as s:` serves `llm`'s engine at `s.url` until the block ends,
    on loopback with the connections, Host check and limits `specserve serve` has there
    (`allowed_host`: its --allowed-host; `**limits`: other ServerConfig fields)."""

    def __init__(self, llm: LLM, name: str = "tiny", api_key: str | None = None, max_waiting: int | None = None,
                 max_body_bytes: int = 2 << 20, body_timeout_s: float = 10.0, ui: bool = True,
                 allowed_host: list[str] | None = None, **limits):
        self.config = ServerConfig(served_model_names=(name,), max_model_len=llm.engine_config.max_model_len,
                                   api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, ui=ui,
                                   allowed_hosts=allowed_hosts("127.0.0.1", allowed_host), **limits)
        self.app, self.engine = build_app_for(llm, self.config, max_waiting)
        self._sock = _bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        http = connection_protocol(self.config.header_timeout_s, self.config.max_connections)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on", http=http,
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "RunningServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def samples(self):
        """(name, labels, value) of every /metrics sample."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$", line)
            if m and not line.startswith("#"):
                yield m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name, summed over label sets."""
        out: dict[str, float] = {}
        for name, _, value in self.samples():
            out[name] = out.get(name, 0.0) + value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """One metric summed over the samples carrying `labels` (0 when absent)."""
        return sum(v for n, have, v in self.samples() if n == name and all(have.get(k) == x for k, x in labels.items()))

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once the engine holds no request (aborts land at the next step boundary) and
        the server has counted the end of every request it submitted."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m.get("specserve_num_requests_in_engine", 1) == 0 and m.get("specserve_num_requests_open", 1) == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def fail_seed(monkeypatch, seed: int) -> None:
    """Inject a failure into the verification of every step that holds a request with `seed`."""
    from specserve.engine import engine as engine_module

    verify = engine_module.verify_flat

    def failing(trees, logits, logit_start, params, *args):
        if any(p.seed == seed for p in params):
            raise RuntimeError("injected sampler failure")
        return verify(trees, logits, logit_start, params, *args)

    monkeypatch.setattr(engine_module, "verify_flat", failing)


def hold_after_one_step(engine, monkeypatch) -> threading.Event:
    """The engine's next step runs (its outputs go out); the one after waits for the event."""
    step, steps, release = engine.step, [], threading.Event()

    def held():
        steps.append(1)
        if len(steps) > 1:
            if engine.before_forward is not None:  # the server hands a step's outputs over at the next pass
                engine.before_forward()
            release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", held)
    return release


def raw_post(server: RunningServer, path: str, body: bytes) -> socket.socket:
    """A connection that sent one POST and reads nothing: closing it is the client going away."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(body), body))
    return conn
