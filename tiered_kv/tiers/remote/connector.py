"""`RemoteConnector`: the interface between the L3 tier and one kind of remote store.

Owns nothing but the contract. A connector moves whole chunk frames (`tiered_kv.codec`) by key
and raises on failure (`RemoteError`, `OSError`, a client library's own errors); the tier
(`tiered_kv.tiers.l3_remote.RemoteTier`) builds and verifies frames, applies timeouts and turns
every failure into a miss or a skipped store.

Contract for implementers:
- Loop-only: every method is called on the engine's event loop. A connector may move the
  bytes on threads of its own (the tkv client receives into the sink and feeds its hasher on
  a connection's thread), never on the loop's default executor.
- Buffers belong to the caller. `put` reads ``frame``'s parts and `get_into` writes the sink's
  buffers only until it returns or raises (cancellation included): a thread still using them
  is stopped and waited for first. Neither keeps them, with one exception: a `get_into`
  cancelled while a transfer it cannot stop still writes the buffers may instead take a
  reference on ``sink.owner`` (the L1 object they belong to) and return; it drops the
  reference when the transfer has ended, so the buffers are not reused meanwhile.
- `get_into` fills ``sink.header`` then ``sink.payload`` in order and feeds every payload byte
  to ``sink.hasher``; a stored frame whose length is not ``sink.total_len`` is SIZE_MISMATCH
  and nothing is promised about the buffers then.
- `use_host_memory` names the host region (the L1 arena) that the buffers of the following
  `put` / `get_into` calls lie in; a connector whose transport moves bytes straight from and
  into registered memory (Mooncake) registers it once, the others ignore it.
- Keys of different namespaces (tenants) never meet: a connector names a key from its full
  scope (the tkv server uses `ChunkKey.to_bytes`, Redis a prefix that includes the namespace).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from tiered_kv.codec import PayloadHasher
from tiered_kv.keys import ChunkKey

BytesLike = bytes | bytearray | memoryview


def default_pool_size() -> int:
    """Connections per store when none is configured: one per core, at least 4, at most 8
    (each connection receives on a thread of its own; see docs/remote.md)."""
    return max(4, min(8, os.cpu_count() or 1))


class FetchStatus(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    SIZE_MISMATCH = "size mismatch"


class BufferOwner(Protocol):
    """What owns a sink's payload buffers (a `MemoryObj`): references keep them allocated."""

    def ref(self) -> object: ...

    def unref(self) -> None: ...


@dataclasses.dataclass(slots=True, eq=False)
class FrameSink:
    """Where `get_into` puts a frame: its header, then the payload straight into L1 buffers
    (owned by ``owner``, when the caller names it)."""

    header: bytearray
    payload: list[memoryview]
    hasher: PayloadHasher = dataclasses.field(default_factory=PayloadHasher)
    owner: BufferOwner | None = None

    @property
    def total_len(self) -> int:
        return len(self.header) + sum(len(buffer) for buffer in self.payload)

    def buffers(self) -> list[memoryview]:
        return [memoryview(self.header), *self.payload]


class RemoteConnector(abc.ABC):
    """One remote store. ``description`` names it in logs (never with credentials)."""

    description: str

    @abc.abstractmethod
    async def open(self) -> None:
        """Prepare clients; must not fail because the store is down (connect lazily)."""

    @abc.abstractmethod
    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which keys the store holds, in order, in one round trip."""

    @abc.abstractmethod
    async def put(self, key: ChunkKey, frame: Sequence[BytesLike], frame_len: int) -> None:
        """Store the frame given as parts (header, then payload); raises on failure."""

    @abc.abstractmethod
    async def get_into(self, key: ChunkKey, sink: FrameSink) -> FetchStatus:
        """Fill ``sink`` with ``key``'s frame."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Drop keys; which were present."""

    def use_host_memory(self, base_ptr: int, nbytes: int) -> None:
        """The buffers of later calls lie in ``[base_ptr, base_ptr + nbytes)`` (the L1 arena),
        which outlives the connector. Called on the loop, cheaply, before every `put` and
        `get_into`; must not block. Default: nothing to do."""
        return None

    def plane_endpoint(self) -> tuple[str, int, bytes] | None:
        """Where I/O worker processes may reach the store themselves (host, port, shared
        token), moving GET and PUT bytes outside the engine's interpreter; None (the default)
        when only this connector speaks to it."""
        return None

    # Requests worth queuing on one connection at once: a store that answers them back to back
    # takes 2, so the next answer follows the last with no idle round trip between chunks.
    pipeline_depth: int = 1

    @property
    def connections(self) -> int:
        """Requests the connector serves at once (its connections); times `pipeline_depth`,
        the tier's ``read_parallelism``, so a load keeps each connection busy."""
        return default_pool_size()

    async def remote_stats(self) -> Mapping[str, int | float]:
        """The store's own counters, where it has any (one round trip)."""
        return {}

    def stats(self) -> Mapping[str, int | float]:
        """Client-side counters (connections, reconnects)."""
        return {}

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections; safe to call twice."""
