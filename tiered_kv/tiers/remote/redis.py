"""`RedisConnector`: chunk frames in Redis or Valkey (single node or Cluster) via redis-py.

Owns the redis-py client, key naming and TTLs. A value is one whole codec frame (header with
checksums, then payload). Names are ``<prefix>:<namespace>:<key hex>``: the prefix separates
deployments sharing a server, the (percent-encoded) namespace separates tenants, and the key's
chunk hash is seeded by its whole scope (model, fingerprint, worker, layout), so different
shards never collide; the frame's key bytes are still compared on every read. Percent-encoding
keeps ``{`` and ``}`` out of names, so no hash tag pins a tenant to one Cluster slot.

Threads: every call runs on the connector's own `BlockingPool` (as many threads as
``max_connections``) with redis-py's blocking client, so the bytes of a value are received,
parsed, copied into L1 and hashed on those threads, several chunks at once, never on the event
loop. Batches go out as one non-transactional pipeline: a single round trip on one node, one
per node holding any of the keys in Cluster mode (no MULTI, so cross-slot keys are fine). On a
single node the connection pool blocks: a request beyond it waits for a connection (within the
timeout) rather than failing; in Cluster mode redis-py keeps a pool per node.

Copies: redis-py needs a value as one argument, so `put` joins header and payload into one
buffer (one memcpy per chunk), and `get_into` copies the reply into the L1 buffers, hashing each
piece as it lands. The built-in ``tkv://`` server avoids both. A cancelled call waits for its
thread's command to end (bounded by ``timeout_s``, the socket timeout) before it returns, so
an L1 buffer handed back by a cancelled load is never written afterwards.
"""

from __future__ import annotations

import functools
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.cluster

from tiered_kv.config import L3_SCHEMES, parse_l3_url
from tiered_kv.errors import ConfigError
from tiered_kv.keys import ChunkKey
from tiered_kv.threads import BlockingPool
from tiered_kv.tiers.remote.connector import BytesLike, FetchStatus, FrameSink, RemoteConnector

_T = TypeVar("_T")


def redis_key_name(prefix: str, key: ChunkKey) -> str:
    namespace = urllib.parse.quote(key.scope.namespace, safe="")
    return f"{prefix}:{namespace}:{key.hex}"


def describe_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def redis_py_url(url: str) -> str:
    """``url`` (a redis-store scheme of `tiered_kv.config.L3_SCHEMES`) as redis-py takes it:
    redis-py knows redis:// and rediss:// (TLS) only, so valkey and +cluster forms map onto them."""
    scheme = "rediss" if parse_l3_url(url).scheme.tls else "redis"
    return urllib.parse.urlunsplit((scheme, *urllib.parse.urlsplit(url)[1:]))


class RedisConnector(RemoteConnector):
    """Redis / Valkey at ``url`` (a scheme of `tiered_kv.config.L3_SCHEMES` whose store is redis).

    ``password`` is used when the URL carries none (e.g. read from a token file). ``ttl_s``
    makes every stored chunk expire (None: keep until Redis evicts it under maxmemory).
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "tkv",
        ttl_s: float | None = None,
        timeout_s: float = 5.0,
        password: str | None = None,
        max_connections: int = 16,
    ) -> None:
        parsed = parse_l3_url(url)
        if parsed.scheme.store != "redis":
            redis_schemes = [name for name, s in L3_SCHEMES.items() if s.store == "redis"]
            raise ConfigError(
                f"RedisConnector: scheme {parsed.scheme_name!r} not one of "
                f"{', '.join(redis_schemes)}"
            )
        self.cluster = parsed.scheme.cluster
        parts = urllib.parse.urlsplit(url)
        self._url = redis_py_url(url)
        self.description = describe_url(url)
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "max_connections": max_connections,
        }
        if password is not None and parts.password is None:
            self._kwargs["password"] = password
        self._client: Any = None
        self._client_lock = threading.Lock()  # one cluster client, built by the first caller
        self._threads = BlockingPool("tkv-redis", max_connections)

    @property
    def connections(self) -> int:
        return int(self._kwargs["max_connections"])

    def name(self, key: ChunkKey) -> str:
        return redis_key_name(self.key_prefix, key)

    async def open(self) -> None:
        if not self.cluster:
            # Connects lazily. A blocking pool: requests beyond max_connections wait for a
            # connection (within the timeout) instead of failing with "Too many connections".
            pool = redis.BlockingConnectionPool.from_url(
                self._url, timeout=self._timeout_s, **self._kwargs
            )
            self._client = redis.Redis.from_pool(pool)  # closing the client closes the pool
        # Cluster discovery needs a live node: the first request does it (`_redis`), so a store
        # that is down at start-up costs misses, not a failed engine start.

    async def _run(self, call: Callable[[Any], _T]) -> _T:
        """``call(client)`` on one of the connector's threads."""
        return await self._threads.run(lambda: call(self._redis()))

    def _redis(self) -> Any:
        """The client (a thread's view); builds the cluster client on first use."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                self._client = redis.cluster.RedisCluster.from_url(self._url, **self._kwargs)
            return self._client

    def _per_key(self, command: str, keys: Sequence[ChunkKey], client: Any) -> list[bool]:
        """``command`` (EXISTS, DEL) for each key in one pipeline; whether each answered > 0."""
        pipe = client.pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(self.name(key))
        return [bool(result) for result in pipe.execute()]

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        return await self._run(functools.partial(self._per_key, "exists", keys))

    async def put(self, key: ChunkKey, frame: Sequence[BytesLike], frame_len: int) -> None:
        def put(client: Any) -> None:
            value = bytearray(frame_len)
            view = memoryview(value)
            position = 0
            for part in frame:
                size = len(part)
                view[position : position + size] = part
                position += size
            client.set(self.name(key), view, px=self.ttl_ms)

        await self._run(put)

    async def get_into(self, key: ChunkKey, sink: FrameSink) -> FetchStatus:
        return await self._run(functools.partial(self._get_into, key, sink))

    def _get_into(self, key: ChunkKey, sink: FrameSink, client: Any) -> FetchStatus:
        value = client.get(self.name(key))
        if value is None:
            return FetchStatus.MISSING
        if len(value) != sink.total_len:
            return FetchStatus.SIZE_MISMATCH
        view = memoryview(value)
        header_len = len(sink.header)
        sink.header[:] = view[:header_len]
        position = header_len
        for buffer in sink.payload:
            piece = view[position : position + len(buffer)]
            buffer[:] = piece
            sink.hasher.update(piece)
            position += len(buffer)
        return FetchStatus.HIT

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        return await self._run(functools.partial(self._per_key, "delete", keys))

    def stats(self) -> dict[str, int | float]:
        """The connector's threads now: started, running a command, and calls waiting for one."""
        pool = self._threads.stats()
        return {"threads": pool.threads, "threads_busy": pool.busy, "calls_queued": pool.queued}

    async def remote_stats(self) -> dict[str, int | float]:
        info = await self._run(lambda client: client.info("memory"))
        if self.cluster:  # one dict per node: sum what is numeric
            totals: dict[str, int | float] = {}
            for node_info in info.values():
                for name, value in node_info.items():
                    if isinstance(value, int | float):
                        totals[name] = totals.get(name, 0) + value
            return totals
        return {k: v for k, v in info.items() if isinstance(v, int | float)}

    async def aclose(self) -> None:
        await self._threads.aclose()
        client, self._client = self._client, None
        if client is not None:
            client.close()
