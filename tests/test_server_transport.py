"""The server's connections: the listening socket makes asyncio turn Nagle's algorithm off on
every accepted connection, and a client that never finishes its body loses its connection."""

import asyncio
import json
import socket

import httpx

from specserve.llm import LLM
from specserve.server.launcher import _bind
from tests.server_helpers import RunningServer


def test_accepted_connections_have_tcp_nodelay():
    """uvicorn serves on the socket `_bind` makes, through asyncio's transports: the same path
    as here. A kept-alive connection without TCP_NODELAY waits for the client's delayed ACK
    before each response's last segment."""
    sock = _bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP

    async def run() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await accepted
            writer.close()
            return nodelay

    assert asyncio.run(run()) != 0


def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closes(tiny):
    """A client declares 1000 bytes and sends 13: after --body-timeout the server answers 408
    and closes the connection instead of holding it for as long as the client likes. The
    server answers the next client as usual."""
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=2, max_model_len=64)
    with RunningServer(llm, body_timeout_s=0.5) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "t')
            received = b""
            while chunk := conn.recv(65536):  # until the server closes the connection
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), received
        error = json.loads(body)["error"]
        assert "--body-timeout" in error["message"] and error["code"] == "body_timeout"
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "t5", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
