"""The server against hostile clients: slow headers and too many connections (the header timeout
and the connection cap), foreign Host names on loopback (DNS rebinding), a deprecated max_tokens
out of range beside max_completion_tokens, security headers and no CDN pages, a bad --host, the
Bearer scheme in any case, and one request asking for more choices than the cap."""

import json
import socket
import time

import httpx
import pytest

from specserve.cli import build_parser
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.server.launcher import _allow_files, _bind, allowed_hosts, run_serve
from tests.server_helpers import RunningServer


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded=tiny["loaded"], max_num_seqs=4, max_model_len=64)


def connect(server: RunningServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    received = b""
    try:
        while chunk := conn.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def wait_for_health(server: RunningServer) -> httpx.Response:
    """/health once it answers 200, or its last answer after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(f"{server.url}/health", timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_slow_headers_are_answered_408_and_closed_while_health_answers(llm):
    """200 connections hold half a request each (one sends nothing, one finished a request and
    began the next on its kept-alive connection): /health answers meanwhile, and each of them
    gets 408 and is closed once --header-timeout has passed."""
    with RunningServer(llm, header_timeout_s=1.0) as s:
        slow = [connect(s) for _ in range(200)]
        for conn in slow[1:-1]:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: localho")
        kept = slow[-1]
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += kept.recv(65536)
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        r = httpx.get(f"{s.url}/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        for conn in slow:
            with conn:
                received = read_until_closed(conn)
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), received
            error = json.loads(body)["error"]
            assert "--header-timeout" in error["message"] and error["code"] == "header_timeout"
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200


def test_connections_past_the_cap_get_503_and_the_server_stays_up(llm):
    with RunningServer(llm, max_connections=8, header_timeout_s=60.0) as s:
        held = [connect(s) for _ in range(8)]
        for conn in held:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: local")
        with connect(s) as extra:
            try:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before the request went out: refused cleanly too
            received = read_until_closed(extra)
        # Either the 503 arrived, or the close reached the client first (its request unread).
        if received:
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), received
            assert "--max-connections" in json.loads(body)["error"]["message"]
        for conn in held:
            conn.close()
        assert wait_for_health(s).status_code == 200


def test_bad_limits_are_refused_before_the_model_loads():
    parse = build_parser().parse_args
    for flags, param in [(["--header-timeout", "0"], "header_timeout"), (["--max-connections", "0"], "max_connections"),
                         (["--max-request-choices", "0"], "max_request_choices"),
                         (["--host", "0.0.0.0.0"], "host")]:
        with pytest.raises(InvalidParameterError) as e:
            run_serve(parse(["serve", "--model", "/nonexistent", *flags]))
        assert e.value.param == param, e.value
    with pytest.raises(InvalidParameterError, match="ulimit -n"):
        _allow_files(10**9)


def test_a_host_that_is_no_address_is_named_as_the_host():
    """`--host 0.0.0.0.0` once got a message about the port."""
    with pytest.raises(InvalidParameterError) as e:
        _bind("0.0.0.0.0", 0)
    assert str(e.value) == "invalid host='0.0.0.0.0': not an IP address or resolvable name"


def test_on_loopback_only_local_host_names_are_answered(llm):
    with RunningServer(llm) as s:
        port = s.url.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.3.2.1", f"[::1]:{port}", "LOCALHOST"):
            assert httpx.get(f"{s.url}/health", headers={"Host": host}).status_code == 200, host
        for path in ("/health", "/v1/models", "/", "/openapi.json"):
            r = httpx.get(f"{s.url}{path}", headers={"Host": f"rebind.example:{port}"})
            assert r.status_code == 421, (path, r.text)
            error = r.json()["error"]
            assert "rebind.example" in error["message"] and "--allowed-host" in error["message"]
            assert error["code"] == "invalid_host"
    with RunningServer(llm, allowed_host=["api.example"]) as s:
        assert httpx.get(f"{s.url}/health", headers={"Host": "api.example:443"}).status_code == 200
        assert httpx.get(f"{s.url}/health", headers={"Host": "localhost"}).status_code == 200
        assert httpx.get(f"{s.url}/health", headers={"Host": "other.example"}).status_code == 421
    with RunningServer(llm, allowed_host=["*"]) as s:
        assert httpx.get(f"{s.url}/health", headers={"Host": "other.example"}).status_code == 200


def test_which_hosts_are_checked_follows_the_address():
    assert allowed_hosts("127.0.0.1", None) == () and allowed_hosts("::1", None) == ()
    assert allowed_hosts("localhost", ["A.example."]) == ("a.example",)
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("10.1.2.3", None) is None
    assert allowed_hosts("0.0.0.0", ["a.example"]) == ("a.example",)
    assert allowed_hosts("127.0.0.1", ["a.example", "*"]) is None
    with pytest.raises(InvalidParameterError, match="without port"):
        allowed_hosts("127.0.0.1", ["a.example:80"])


def test_the_bearer_scheme_is_case_insensitive(llm):
    with RunningServer(llm, api_key="k3y") as s:
        for header in ("Bearer k3y", "bearer k3y", "BEARER  k3y"):
            assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("Basic k3y", "bearer K3Y", "bearerk3y", "k3y"):
            assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": header}).status_code == 401, header


def test_security_headers_and_no_pages_from_a_cdn(llm):
    with RunningServer(llm, api_key="k") as s:
        for path in ("/", "/static/playground.js", "/static/playground.css", "/static/index.html"):
            r = httpx.get(f"{s.url}{path}")
            assert r.status_code == 200, path
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"], path
            assert r.headers["x-frame-options"] == "DENY" and r.headers["referrer-policy"] == "no-referrer", path
            assert r.headers.get_list("x-content-type-options") == ["nosniff"], path
        for path in ("/health", "/metrics", "/v1/models", "/openapi.json", "/nothing"):
            assert httpx.get(f"{s.url}{path}").headers["x-content-type-options"] == "nosniff", path
        assert httpx.post(f"{s.url}/v1/completions", headers={"Authorization": "Bearer k"},
                          json={"prompt": 3}).headers["x-content-type-options"] == "nosniff"
        assert httpx.get(f"{s.url}/docs").status_code == 404 and httpx.get(f"{s.url}/redoc").status_code == 404
        assert httpx.get(f"{s.url}/openapi.json").json()["paths"]["/v1/completions"]  # public, as the page is


def test_chat_max_tokens_is_checked_beside_max_completion_tokens(llm):
    """max_completion_tokens wins, but a max_tokens out of range is refused, named, even with it."""
    messages = [{"role": "user", "content": "t5 t6"}]
    with RunningServer(llm) as s:
        url = f"{s.url}/v1/chat/completions"
        r = httpx.post(url, json={"messages": messages, "max_completion_tokens": 2, "max_tokens": 99999999999})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "99999999999" in r.json()["error"]["message"]
        r = httpx.post(url, json={"messages": messages, "max_completion_tokens": 99999999999, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
        r = httpx.post(url, json={"messages": messages, "max_completion_tokens": 2, "max_tokens": 5,
                                  "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_one_request_cannot_ask_for_more_choices_than_the_cap(llm):
    with RunningServer(llm, max_request_choices=4) as s:
        url = f"{s.url}/v1/completions"
        r = httpx.post(url, json={"prompt": ["t1", "t2"], "n": 3, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        message = r.json()["error"]["message"]
        assert "2 prompt(s) x n=3 = 6" in message and "at most 4" in message and "--max-request-choices" in message
        r = httpx.post(url, json={"prompt": ["t1", "t2"], "n": 2, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "t1"}], "n": 5})
        assert r.status_code == 400 and "n=5" in r.json()["error"]["message"]
    with RunningServer(llm) as s:  # the default cap: 64
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": ["t1"] * 5, "n": 16, "max_tokens": 1})
        assert r.status_code == 400 and "= 80" in r.json()["error"]["message"] and "at most 64" in r.json()["error"]["message"]
