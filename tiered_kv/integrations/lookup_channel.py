"""The local lookup channel: a scheduler asks a worker-side engine how much of a prompt is cached.

Owns the wire format (one Unix stream socket per worker rank; frames are a 4-byte big-endian
length and a UTF-8 JSON object), `LookupServer` (served on the engine's event loop, answering
with a coroutine the worker side supplies) and `LookupClient` (used by the scheduler from its
own thread: a question is sent and its answer picked up by a later call, or by the same call
when the caller lends it a few milliseconds, ``wait_s``). Must not import a serving stack,
touch KV bytes, or let a slow or missing worker block the scheduler beyond that loan: an answer
that has not arrived yet is "ask again" (None), an unreachable worker is a miss (0).

Messages: request ``{"id": n, "req": request_id, "tokens": [ints]}`` plus ``"salt": [[offset,
hex], ...]`` for a salted request (`KeySalt.to_wire`) and ``"limit": n``, the most tokens the
scheduler may claim (a hybrid model's answer depends on it); reply ``{"id": n, "ready": int or
null}`` where null means "a load is still in flight, ask again". A worker that cannot answer
replies ``{"id": n, "ready": 0, "error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.keys import KeySalt

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a 4M-token prompt as JSON; anything larger is a broken peer

LookupHandler = Callable[[str, list[int], KeySalt | None, int | None], Awaitable[int | None]]


def default_socket_dir() -> str:
    """A per-user directory under the temp dir (mode 0700): other users cannot ask or answer."""
    return os.path.join(tempfile.gettempdir(), f"tiered-kv-{os.getuid()}")


def socket_path(directory: str, instance_id: str, rank: int) -> str:
    """Where rank ``rank`` of serving instance ``instance_id`` listens."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in instance_id)[:64]
    path = os.path.join(directory, f"{safe}-r{rank}.sock")
    if len(path.encode()) > 100:  # sun_path is 108 bytes on Linux, 104 on macOS
        raise ConfigError(
            f"lookup socket path {path!r} is longer than 100 bytes; set lookup_socket_dir "
            "to a shorter directory"
        )
    return path


def _encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


class LookupServer:
    """Serves lookups on a Unix socket. Create, `start` and `aclose` on the engine's loop.

    Each connection's requests are answered in order by ``handler(request_id, token_ids,
    salt, limit)``;
    a malformed frame closes only that connection.
    """

    def __init__(self, path: str, handler: LookupHandler) -> None:
        self.path = path
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.requests = 0
        self.errors = 0

    async def start(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket of a crashed run with the same instance id
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections[task] = writer
        try:
            while True:
                try:
                    head = await reader.readexactly(_LEN.size)
                except asyncio.IncompleteReadError:
                    return
                (length,) = _LEN.unpack(head)
                if length > MAX_FRAME_BYTES:
                    logger.warning("tiered_kv lookup channel: %d-byte frame refused", length)
                    return
                message = json.loads(await reader.readexactly(length))
                reply = await self._answer(message)
                writer.write(_encode(reply))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            logger.warning("tiered_kv lookup channel: connection closed: %s", exc)
        finally:
            writer.close()
            if task is not None:
                self._connections.pop(task, None)

    async def _answer(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise ValueError("a request must be a JSON object")
        request_id, tokens = message.get("req"), message.get("tokens")
        if not isinstance(request_id, str) or not isinstance(tokens, list):
            raise ValueError("a request needs 'req' (str) and 'tokens' (list of ints)")
        salt = KeySalt.from_wire(message.get("salt"))  # ValueError: a broken peer
        limit = message.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"'limit' must be an int, got {limit!r}")
        self.requests += 1
        try:
            ready = await self._handler(request_id, tokens, salt, limit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel's boundary: a failed lookup is a miss
            self.errors += 1
            logger.warning("tiered_kv lookup of %s failed", request_id, exc_info=True)
            return {"id": message.get("id"), "ready": 0, "error": f"{type(exc).__name__}: {exc}"}
        return {"id": message.get("id"), "ready": ready}

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # Closing a connection's transport ends its reader with EOF: the handler returns by
        # itself (cancelling it would make asyncio log the CancelledError as an error).
        for writer in list(self._connections.values()):
            writer.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5.0)
        if server is not None:
            await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _Peer:
    """One rank's connection, owned by a `LookupClient` (scheduler thread only). Never blocks:
    the socket is non-blocking, questions wait in ``outbox`` until the socket takes them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.pending: dict[int, str] = {}  # message id -> request id ("" once forgotten)
        self.asking: set[str] = set()  # request ids with a question on the way
        self.answers: dict[str, int | None] = {}
        self.retry_at = 0.0

    def connect(self) -> socket.socket | None:
        if self.sock is not None:
            return self.sock
        if time.monotonic() < self.retry_at:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)  # a Unix socket connects at once or fails at once
        except OSError as exc:
            sock.close()
            self.retry_at = time.monotonic() + 1.0
            logger.warning("tiered_kv: lookup channel %s unreachable: %s", self.path, exc)
            return None
        self.sock = sock
        return sock

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.inbox.clear()
        self.outbox.clear()
        self.pending.clear()
        self.asking.clear()
        self.retry_at = time.monotonic() + 1.0

    def ask(
        self,
        message_id: int,
        request_id: str,
        token_ids: Sequence[int],
        salt: KeySalt | None = None,
        limit: int | None = None,
    ) -> None:
        self.pending[message_id] = request_id
        self.asking.add(request_id)
        message: dict[str, Any] = {"id": message_id, "req": request_id, "tokens": list(token_ids)}
        if salt is not None:
            message["salt"] = salt.to_wire()
        if limit is not None:
            message["limit"] = limit
        self.outbox += _encode(message)

    def flush(self) -> None:
        """Send what the socket takes now."""
        while self.sock is not None and self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("tiered_kv: lookup channel %s failed: %s", self.path, exc)
                self.drop()
                return
            del self.outbox[:sent]

    def read_available(self) -> None:
        sock = self.sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.drop()
                return
            if not data:
                self.drop()
                return
            self.inbox += data
        while len(self.inbox) >= _LEN.size:
            (length,) = _LEN.unpack_from(self.inbox)
            if length > MAX_FRAME_BYTES:
                self.drop()
                return
            if len(self.inbox) < _LEN.size + length:
                break
            body = bytes(self.inbox[_LEN.size : _LEN.size + length])
            del self.inbox[: _LEN.size + length]
            try:
                reply = json.loads(body)
                request_id = self.pending.pop(reply["id"])
            except (ValueError, KeyError, TypeError):
                self.drop()
                return
            ready = reply.get("ready")
            if "error" in reply:
                logger.warning(
                    "tiered_kv: lookup of %s failed on %s: %s",
                    request_id,
                    self.path,
                    reply["error"],
                )
            if request_id:  # "" marks a request the scheduler forgot
                self.asking.discard(request_id)
                self.answers[request_id] = ready if isinstance(ready, int) else None


class LookupClient:
    """Asks every rank's `LookupServer`; the answer is the minimum over ranks.

    Scheduler thread only. The first call for a request sends the question; without an
    answer from every rank by then (or within ``wait_s``) it answers None ("ask again"), and a
    later call returns the answer once every rank's has arrived. An unreachable or broken
    worker is a miss (0), retried after a second.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        self._peers = [_Peer(path) for path in paths]
        self._next_id = 0
        self.unreachable = 0

    def lookup(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: KeySalt | None = None,
        limit: int | None = None,
        wait_s: float = 0.0,
    ) -> int | None:
        """Cached tokens of ``token_ids`` (under ``salt``, at most ``limit``) ready on every
        rank; None: ask again; 0 on failure. ``wait_s``: how long this call may wait for the
        ranks' replies (in ``select``, so a worker in this process gets the GIL to answer);
        a rank answers at once, "ask again" while its disk or remote loads are in flight, so
        the wait is the channel's round trip, never a load."""
        for peer in self._peers:
            if request_id in peer.answers or request_id in peer.asking:
                continue
            if peer.connect() is None:
                return self._unreachable(request_id)
            self._next_id += 1
            peer.ask(self._next_id, request_id, token_ids, salt, limit)
        for peer in self._peers:
            peer.flush()
            peer.read_available()
            if peer.sock is None and request_id not in peer.answers:
                return self._unreachable(request_id)
        if wait_s > 0:
            self._wait(request_id, time.monotonic() + wait_s)
        if not all(request_id in peer.answers for peer in self._peers):
            return None
        answers = [peer.answers.pop(request_id) for peer in self._peers]
        if any(answer is None for answer in answers):
            return None  # a rank's loads are in flight: the next call asks again
        return min(answer for answer in answers if answer is not None)

    def _wait(self, request_id: str, deadline: float) -> None:
        """Read replies until every rank has answered ``request_id`` or ``deadline`` passes."""
        while True:
            waiting = {
                peer.sock: peer
                for peer in self._peers
                if request_id not in peer.answers and peer.sock is not None
            }
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            readable, _, _ = select.select(list(waiting), [], [], left)
            for sock in readable:
                waiting[sock].read_available()

    def _unreachable(self, request_id: str) -> int:
        self.unreachable += 1
        self.forget(request_id)
        return 0

    def forget(self, request_id: str) -> None:
        """Drop answers for ``request_id`` (a reply still on the way is discarded on arrival)."""
        for peer in self._peers:
            peer.answers.pop(request_id, None)
            peer.asking.discard(request_id)
            for message_id in [m for m, r in peer.pending.items() if r == request_id]:
                peer.pending[message_id] = ""  # keeps the id matched; the answer is dropped

    def close(self) -> None:
        for peer in self._peers:
            peer.drop()
