"""`RemoteTier` (L3): chunk frames in a remote store, through a `RemoteConnector`.

Owns the codec glue (frames built from and verified into `MemoryObj` buffers), per-request
timeouts, the local set of keys known to be remote (what `contains` answers from), and the
counters. `tiered_kv.tiers.factory` builds it from ``EngineConfig.l3_url``.

Must not: raise into the serving path (every failure or timeout is a miss or a skipped store,
logged and counted), keep `MemoryObj`s or change their reference counts (but a connector may
hold a reference on a get's object past a timeout, see below), hand out bytes whose key, layout
and checksum were not verified, or do I/O in `contains`.

Threads: loop-only, like every tier. A call cancelled or timed out while a connector holds the
caller's buffers returns only after the connector let go of them, or, for a get whose transfer
cannot be stopped at once (Mooncake), after it took a reference on the object that it drops
when the transfer ends (see `RemoteConnector`): the object then stays allocated, unused.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tiered_kv.codec import (
    DEFAULT_LIMITS,
    STRIPE_BYTES,
    CodecLimits,
    FrameCheck,
    GroupSpec,
    check_frame_header,
    check_payload_checksums,
    decode_header,
    encode_header,
    encoded_header_len,
    header_template,
    payload_checksums,
)
from tiered_kv.errors import CodecError, ConfigError, EngineStateError, RemoteDown, RemoteError
from tiered_kv.io.plane import READS_PER_WORKER, WRITES_PER_WORKER, WorkerPlane
from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj
from tiered_kv.snapshot import counter_fields
from tiered_kv.tiers.base import TIER_OCCUPANCY, LowerTier, TierStats
from tiered_kv.tiers.remote.connector import FetchStatus, FrameSink, RemoteConnector

logger = logging.getLogger(__name__)

DEFAULT_KNOWN_KEYS = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RemoteStats(TierStats):
    """`RemoteTier.stats()`. No occupancy: the store is shared, and only it knows; ``known_keys``
    is what `contains` answers from. ``client``: the connector's own counters."""

    known_keys: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    exists_calls: int = 0
    exists_keys: int = 0
    exists_failures: int = 0
    read_failures: int = 0
    timeouts: int = 0
    refused_down: int = 0  # requests refused at once: the store is known down (its circuit)
    layout_mismatch: int = 0
    corrupt: int = 0
    corrupt_removed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # sum of per-request latencies
    read_seconds: float = 0.0
    client: Mapping[str, int | float] = dataclasses.field(default_factory=dict)


# What the tier counts as events (the rest of RemoteStats is measured when asked).
_COUNTERS = counter_fields(
    RemoteStats, measured=(*TIER_OCCUPANCY, "known_keys", "write_seconds", "read_seconds", "client")
)


class RemoteTier(LowerTier):
    """L3 over ``connector``; every remote call is bounded by ``timeout_s``.

    ``known_keys`` bounds the set `contains` answers from (least recently seen keys are
    forgotten first; a forgotten key is only a later `contains_many` round trip away).
    """

    name = "L3"

    def __init__(
        self,
        connector: RemoteConnector,
        *,
        timeout_s: float = 5.0,
        known_keys: int = DEFAULT_KNOWN_KEYS,
        limits: CodecLimits = DEFAULT_LIMITS,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"RemoteTier: timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(known_keys, bool) or not isinstance(known_keys, int) or known_keys < 1:
            raise ConfigError(f"RemoteTier: known_keys must be an int >= 1, got {known_keys!r}")
        self.connector = connector
        self.timeout_s = timeout_s
        self.limits = limits
        self._known_max = known_keys
        self._known: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._write_seconds = 0.0
        self._read_seconds = 0.0
        self._state = "new"
        self._plane: WorkerPlane | None = None
        self._endpoint: tuple[str, int, bytes] | None = None

    def use_plane(self, plane: WorkerPlane | None) -> bool:
        """GET and PUT the bytes of chunks whose objects lie in ``plane``'s arena through its
        worker processes, each over its own connection to the store, when the connector says
        where the store is (`RemoteConnector.plane_endpoint`: ``tkv://``); lookups, deletes
        and stats stay on the connector."""
        self._endpoint = self.connector.plane_endpoint() if plane is not None else None
        self._plane = plane if self._endpoint is not None else None
        return self._plane is not None

    def _plane_for(self, obj: MemoryObj) -> WorkerPlane | None:
        plane = self._plane
        return plane if plane is not None and plane.serves(obj.arena) else None

    @property
    def read_parallelism(self) -> int:
        """The connector's connections, each with `RemoteConnector.pipeline_depth` loads in
        flight; with an I/O plane, `READS_PER_WORKER` per read worker."""
        if self._plane is not None:
            return self._plane.size * READS_PER_WORKER
        return self.connector.connections * self.connector.pipeline_depth

    @property
    def write_parallelism(self) -> int:
        """With an I/O plane, `WRITES_PER_WORKER` per write worker."""
        if self._plane is not None:
            return self._plane.write_size * WRITES_PER_WORKER
        return super().write_parallelism

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> None:
        if self._state != "new":
            raise EngineStateError(f"RemoteTier.open: already {self._state}; open is called once")
        await self.connector.open()
        self._state = "open"
        logger.info("L3: %s", self.connector.description)

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self._known.clear()
        await self.connector.aclose()

    def _check_open(self, verb: str) -> None:
        if self._state != "open":
            raise EngineStateError(
                f"RemoteTier.{verb}: the tier is {self._state}; call open() first, not after "
                "aclose()"
            )

    # -- known keys -------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._known

    def _remember(self, key: ChunkKey) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > self._known_max:
            self._known.popitem(last=False)

    def _forget(self, key: ChunkKey) -> None:
        """``key`` is gone from the store (checked, read as missing, or deleted here): a known
        key's departure is announced (the store's own evictions are learnt only so)."""
        if key in self._known:
            del self._known[key]
            if self.events is not None:
                self.events.emit("removed", self.name, key)

    def _failed(self, what: str, key: ChunkKey | None, exc: Exception) -> None:
        if isinstance(exc, RemoteDown):  # the connector logged the outage once
            self._counters["refused_down"] += 1
            logger.debug("L3 %s of %s refused: %s", what, _name(key), exc)
        elif isinstance(exc, TimeoutError):
            self._counters["timeouts"] += 1
            logger.info("L3 %s of %s timed out after %.2fs", what, _name(key), self.timeout_s)
        else:
            logger.warning(
                "L3 %s of %s failed on %s",
                what,
                _name(key),
                self.connector.description,
                exc_info=True,
            )

    def stats(self) -> RemoteStats:
        return RemoteStats(
            known_keys=len(self._known),
            write_seconds=self._write_seconds,
            read_seconds=self._read_seconds,
            client=dict(self.connector.stats()),
            **self._counters,
        )

    # -- data -------------------------------------------------------------------------------
    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open("contains_many")
        if not keys:
            return []
        self._counters["exists_calls"] += 1
        self._counters["exists_keys"] += len(keys)
        try:
            async with asyncio.timeout(self.timeout_s):
                flags = await self.connector.exists(keys)
            if len(flags) != len(keys):
                raise CodecError(f"exists answered {len(flags)} flags for {len(keys)} keys")
        except Exception as exc:  # tier boundary: a miss
            self._counters["exists_failures"] += 1
            self._failed("exists", None, exc)
            return [False] * len(keys)
        for key, flag in zip(keys, flags, strict=True):
            if flag:
                self._remember(key)
            else:
                self._forget(key)
        return flags

    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("put")
        specs = obj.group_specs()
        buffers = obj.group_buffers()
        key_bytes = key.to_bytes()
        plane = self._plane_for(obj)
        if plane is None:
            self.connector.use_host_memory(obj.arena.base_ptr, obj.arena.capacity)
        started = time.perf_counter()
        try:
            if plane is not None:
                frame_len = await self._put_in_worker(plane, key_bytes, obj, specs)
            else:
                header = encode_header(
                    key_bytes,
                    obj.num_tokens,
                    specs,
                    payload_checksums(buffers),
                    limits=self.limits,
                )
                frame_len = len(header) + sum(len(buffer) for buffer in buffers)
                async with asyncio.timeout(self.timeout_s):
                    await self.connector.put(key, [header, *buffers], frame_len)
        except Exception as exc:  # tier boundary: a skipped store
            self._counters["put_failures"] += 1
            self._failed("put", key, exc)
            return False
        finally:
            self._write_seconds += time.perf_counter() - started
        self._remember(key)
        self._counters["puts"] += 1
        self._counters["bytes_written"] += frame_len
        return True

    async def _put_in_worker(
        self, plane: WorkerPlane, key_bytes: bytes, obj: MemoryObj, specs: tuple[GroupSpec, ...]
    ) -> int:
        """The frame sent by a write worker, its header sealed there; its length. Raises on
        failure (the caller's tier boundary counts it)."""
        assert self._endpoint is not None
        template = header_template(key_bytes, obj.num_tokens, specs, limits=self.limits)
        extents = obj.group_runs()
        write = plane.submit_remote_put(
            self._endpoint,
            key_bytes,
            template.data,
            template.checksums_at,
            extents,
            STRIPE_BYTES,
            self.timeout_s,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                done = await write.done()
        except BaseException:
            await write.settle()  # nothing reads obj's bytes after this
            raise
        if done.status != "written":
            raise RemoteError(f"PUT through an I/O worker: {done.detail}")
        return len(template.data) + sum(length for _, length in extents)

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("get_into")
        specs = obj.group_specs()
        key_bytes = key.to_bytes()
        header_len = encoded_header_len(len(key_bytes), specs)
        plane = self._plane_for(obj)
        if plane is not None:
            return await self._get_in_worker(plane, key, key_bytes, header_len, obj, specs)
        sink = FrameSink(bytearray(header_len), obj.group_buffers(), owner=obj)
        self.connector.use_host_memory(obj.arena.base_ptr, obj.arena.capacity)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                status = await self.connector.get_into(key, sink)
        except Exception as exc:  # tier boundary: a miss
            self._read_failed(key, exc)
            return False
        finally:
            self._read_seconds += time.perf_counter() - started
        if status is FetchStatus.MISSING:
            self._forget(key)
            self._counters["misses"] += 1
            return False
        if status is FetchStatus.SIZE_MISMATCH:
            self._counters["layout_mismatch"] += 1
            self._counters["misses"] += 1
            return False
        problem = self._verify(
            key_bytes, obj.num_tokens, specs, sink.header, sink.total_len, sink.hasher.digests()
        )
        return await self._judged(key, problem, sink.total_len)

    async def _get_in_worker(
        self,
        plane: WorkerPlane,
        key: ChunkKey,
        key_bytes: bytes,
        header_len: int,
        obj: MemoryObj,
        specs: tuple[GroupSpec, ...],
    ) -> bool:
        """The frame received by a read worker straight into ``obj``, judged here as the
        connector's would be."""
        extents = obj.group_runs()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await plane.remote_get(
                    self._endpoint,  # type: ignore[arg-type]
                    key_bytes,
                    header_len,
                    sum(length for _, length in extents),
                    extents,
                    STRIPE_BYTES,
                    self.timeout_s,
                )
            if answer.status == "error":
                raise RemoteError(answer.detail)
        except Exception as exc:  # tier boundary: a miss
            self._read_failed(key, exc)
            return False
        finally:
            self._read_seconds += time.perf_counter() - started
        if answer.status == "missing":
            self._forget(key)
            self._counters["misses"] += 1
            return False
        if answer.status == "mismatch":
            self._counters["layout_mismatch"] += 1
            self._counters["misses"] += 1
            return False
        problem = self._verify(
            key_bytes, obj.num_tokens, specs, answer.header, answer.file_size, answer.digests
        )
        return await self._judged(key, problem, answer.file_size)

    def _read_failed(self, key: ChunkKey, exc: Exception) -> None:
        self._counters["read_failures"] += 1
        self._counters["misses"] += 1
        self._failed("get", key, exc)

    async def _judged(self, key: ChunkKey, problem: str | None, frame_len: int) -> bool:
        """Count a received frame by ``problem`` (`_verify`'s verdict); True for a hit."""
        if problem is not None:
            self._counters["misses"] += 1
            if problem == "layout":
                self._counters["layout_mismatch"] += 1
                return False
            self._counters["corrupt"] += 1
            logger.warning("L3: %s is corrupt (%s); removing it", key.hex, problem)
            await self._remove_corrupt(key)
            return False
        self._remember(key)
        self._counters["hits"] += 1
        self._counters["bytes_read"] += frame_len
        return True

    def _verify(
        self,
        key_bytes: bytes,
        num_tokens: int,
        specs: tuple[GroupSpec, ...],
        header_bytes: bytes | bytearray,
        frame_len: int,
        digests: Sequence[int | None],
    ) -> str | None:
        """None when the frame is ours and intact; else "layout" or what is corrupt."""
        try:
            header = decode_header(header_bytes, self.limits)
        except CodecError as exc:
            return f"bad header: {exc}"
        check, detail = check_frame_header(
            header,
            key_bytes=key_bytes,
            num_tokens=num_tokens,
            groups=specs,
            frame_len=frame_len,
        )
        if check is FrameCheck.OTHER_LAYOUT:
            return "layout"
        if check is not FrameCheck.OK:  # another key under this key's name: corrupt here
            return detail
        return check_payload_checksums(header, digests)

    async def _remove_corrupt(self, key: ChunkKey) -> None:
        self._forget(key)
        try:
            async with asyncio.timeout(self.timeout_s):
                removed = await self.connector.delete([key])
        except Exception as exc:  # tier boundary: best effort
            self._failed("delete", key, exc)
            return
        if any(removed):
            self._counters["corrupt_removed"] += 1

    async def remove(self, key: ChunkKey) -> bool:
        self._check_open("remove")
        self._forget(key)
        try:
            async with asyncio.timeout(self.timeout_s):
                removed = await self.connector.delete([key])
        except Exception as exc:  # tier boundary
            self._failed("delete", key, exc)
            return False
        return any(removed)

    async def remote_stats(self) -> dict[str, int | float]:
        """The store's own counters (one round trip); empty when it cannot be reached."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return dict(await self.connector.remote_stats())
        except Exception as exc:  # tier boundary
            self._failed("stats", None, exc)
            return {}


def _name(key: ChunkKey | None) -> str:
    return "a batch" if key is None else key.hex


# -- configuration ------------------------------------------------------------------------------
def read_token_file(path: str) -> bytes:
    """The token in ``path`` (one trailing newline dropped); `ConfigError` when unusable."""
    try:
        token = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"l3_token_file: cannot read {path!r}: {exc}") from None
    token = token.removesuffix(b"\n").removesuffix(b"\r")
    if not token:
        raise ConfigError(f"l3_token_file: {path!r} is empty")
    return token
