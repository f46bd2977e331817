"""The server's connections: the listening socket makes asyncio turn Nagle's algorithm off on
every accepted connection."""

import asyncio
import socket

from specserve.server.launcher import _bind


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
