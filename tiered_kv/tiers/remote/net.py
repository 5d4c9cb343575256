"""Socket helpers the tkv client and server share. Owns nothing.

`send_all`: every byte of a list of buffers through blocking ``sendmsg`` calls (no copies; the
list is consumed as bytes go, so a sent buffer is let go at once).

Address resolution: a numeric host (the usual ``127.0.0.1`` or ``10.0.0.5``) is resolved in
place, so neither side needs the event loop's default executor; only a host name goes through
``loop.getaddrinfo`` (which uses that executor for the DNS lookup).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any

AddressInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


async def resolve(host: str, port: int, *, passive: bool = False) -> Sequence[AddressInfo]:
    """``getaddrinfo`` for a TCP ``host``/``port``; ``passive``: for binding a listener."""
    flags = socket.AI_PASSIVE if passive else 0
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=flags | socket.AI_NUMERICHOST
        )
    except socket.gaierror:
        loop = asyncio.get_running_loop()
        return await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)


def send_all(
    sock: socket.socket, parts: list[memoryview], on_progress: Callable[[], None] | None = None
) -> None:
    """Send every byte of ``parts`` (at most 512 buffers a ``sendmsg``), removing each buffer
    from the list once it is sent; ``on_progress`` after each call that took bytes. Raises
    what ``sendmsg`` raises (a timeout, a broken connection)."""
    while parts:
        sent = sock.sendmsg(parts[:512])
        if on_progress is not None:
            on_progress()
        while sent:
            if sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            else:
                parts[0] = parts[0][sent:]
                sent = 0
