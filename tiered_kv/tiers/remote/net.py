"""Socket helpers the tkv client and server share. Owns nothing.

Address resolution: a numeric host (the usual ``127.0.0.1`` or ``10.0.0.5``) is resolved in
place, so neither side needs the event loop's default executor; only a host name goes through
``loop.getaddrinfo`` (which uses that executor for the DNS lookup).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
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
