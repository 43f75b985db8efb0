"""One listening TCP socket that several server processes accept from (`pagoda serve
--api-server-count N`, `pagoda router --workers N`): the parent binds it once, so a bind error is
one line before anything starts, and the children inherit it."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """Bound, listening and inheritable; raises OSError (closed) when the address cannot be used.

    proto is IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on an accepted connection only when the
    listening socket's proto says TCP (and children rebuild the socket from family, type, proto).
    Without it Nagle holds each small SSE write until the client's delayed ACK, which delays the first
    token by the ACK timer. TCP_NODELAY on the listener too (Linux hands it to accepted sockets)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
