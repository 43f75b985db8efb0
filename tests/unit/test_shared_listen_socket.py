"""The listening socket that several processes share (`pagoda/processes/sockets.py`, used by `pagoda serve
--api-server-count N` and `pagoda router --workers N`): a connection accepted from them must have
TCP_NODELAY, or Nagle holds each small SSE write until the client's delayed ACK (which delays the first
token by the ACK timer).

asyncio sets TCP_NODELAY on an accepted connection only when the listening socket's `proto` is
IPPROTO_TCP, and the child processes rebuild the socket from (family, type, proto) as
multiprocessing's socket reduction does; both paths are checked.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from pagoda.launch.supervise import _listen_socket
from pagoda.processes.sockets import listen_socket

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP socket options as on Linux")


def _serve_listen(host: str) -> socket.socket:
    sock = _listen_socket(host, 0)
    sock.listen(16)
    return sock


def _nodelay_of_accepted(listener: socket.socket) -> int:
    """TCP_NODELAY of a connection an asyncio server accepts from listener, rebuilt the way a child
    process gets it (a duplicated descriptor with the parent's family, type and proto)."""
    rebuilt = socket.socket(listener.family, listener.type, listener.proto, fileno=os.dup(listener.fileno()))

    async def main() -> int:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                got.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=rebuilt)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    try:
        return asyncio.run(main())
    finally:
        rebuilt.close()


@pytest.mark.parametrize("make", [_serve_listen, lambda host: listen_socket(host, 0)], ids=["serve", "router"])
def test_connections_accepted_from_the_shared_socket_have_nodelay(make) -> None:
    listener = make("127.0.0.1")
    try:
        assert listener.proto == socket.IPPROTO_TCP
        assert _nodelay_of_accepted(listener) != 0
    finally:
        listener.close()
