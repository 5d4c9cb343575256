"""`DiskTier` (L2): one checksummed codec frame per chunk, in files under a local directory.

Owns the files under ``root``, their index (key → file, LRU order, bytes used) and the directory
lock. A chunk lives at ``root/<first 2 hex>/<key hex>``; it is written to a temp name in the same
directory, fsynced and renamed, so neither readers nor a restarted process ever see half a chunk;
the directory's fsync after the rename is shared by the puts that renamed into it meanwhile
(`DirectorySyncer`, group commit; ``stats().directory_syncs`` counts them).
``root/.lock`` (flock) keeps a second tier out of the directory. `open` rebuilds the index from
the files' headers; torn, corrupt or misnamed files are removed there and whenever a read finds
them.

Recency survives a restart: every write, read hit and `touch` stamps the file's mtime with a
strictly increasing time, and `open` orders the index by it, so hot chunks are evicted last.

A full filesystem: ``capacity`` is an upper bound, not a promise. A write that fails with
``ENOSPC`` or ``EDQUOT`` sets the *effective capacity* to what the filesystem holds for us (the
bytes of our committed chunks plus its free bytes, `os.statvfs`), evicts least recently used chunks
down to it and tries again: at most `_NO_SPACE_RETRIES` times, and only when files were deleted
since the failed attempt began (by its own eviction or another put's). While the effective
capacity is below ``capacity`` every write also measures the free space (in the write's own
thread hop), so the effective capacity follows the filesystem back up when space is freed (and
down, before the next ``ENOSPC``, when something else fills it); a put that would not fit even
in an emptied tier measures once more before it is refused. ``stats()`` (`DiskStats`) reports
``effective_capacity`` and ``no_space_errors``.

A removed directory: every write checks that ``root/.lock`` is still the file it holds the lock
on. When it is gone, the write recreates the directory and takes the lock on a new lock file, and
the index forgets chunks whose files went with the old directory. If another tier took the new
directory first, this tier leaves it alone: it forgets its index and every later put fails.

Must not: keep `MemoryObj`s or change their reference counts, hand out bytes whose checksum was
not verified, or touch a caller's buffers after the call that lent them has returned.

Threads: every method runs on the engine's event loop; file I/O and hashing run on the tier's
own `BlockingPool`s, one hop per put / get: reads on ``io_threads`` threads (sized from the
machine by default), each chunk's read split into parts (its header, runs of its checksum
stripes) that run at once, straight into its L1 object, so a request's chunks and the stripes
of each are read in parallel; writes, unlinks and recency stamps on a smaller pool of their own
(`write_threads`), so a burst of writes never queues a load behind it. A cancelled call tells
its threads to stop and waits for them before cancellation propagates, so a released
`MemoryObj` is never written. Not aiofiles: its await returns as soon as its task is cancelled
while the thread keeps going, and it leaves the hashing on the loop (docs/benchmarks.md, "Why
the L2 tier does not use aiofiles").

With an I/O plane (`use_plane`, ``io_plane="processes"``), reads and writes of chunks whose
objects lie in the plane's arena go to its worker processes instead (`tiered_kv.io.plane`): a
read comes back as the header's bytes and the stripes' digests, judged here; a write as whether
the file is in place (its header sealed by the worker from `header_template`). The index, the
capacity, evictions, no-space retries and the directory lock stay here, on the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from tiered_kv.codec import (
    DEFAULT_LIMITS,
    STRIPE_BYTES,
    CodecLimits,
    FrameCheck,
    GroupSpec,
    check_encodable,
    check_frame_header,
    check_payload_checksums,
    decode_header,
    encoded_header_len,
    header_template,
    stripe_count,
)
from tiered_kv.config import L2_DURABILITIES, L2Durability
from tiered_kv.errors import CodecError, ConfigError, EngineStateError, TieredKVError
from tiered_kv.eviction import EvictionOrder, EvictionStats, make_order
from tiered_kv.io.pagecache import cached_fraction
from tiered_kv.io.plane import (
    READS_PER_WORKER,
    WRITES_PER_WORKER,
    ChunkBytes,
    WorkerDied,
    WorkerPlane,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj
from tiered_kv.snapshot import counter_fields
from tiered_kv.threads import BlockingPool, default_io_threads, write_threads
from tiered_kv.tiers.base import TIER_OCCUPANCY, LowerTier, TierStats
from tiered_kv.tiers.l2.chunk_io import ChunkRead, ReadOutcome, WriteJob, store_chunk
from tiered_kv.tiers.l2.files import (
    DEFAULT_FILE_OPS,
    NO_SPACE_ERRNOS,
    TEMP_SUFFIX,
    DirectorySyncer,
    FileOps,
    set_mtimes,
    unlink_paths,
    unlink_quietly,
    vanished,
)
from tiered_kv.tiers.l2.lock import DirectoryLock
from tiered_kv.tiers.l2.scan import Entry, rebuild_index

logger = logging.getLogger(__name__)

# Retries of one put after no-space errors; each follows deletions, so each meets more room.
_NO_SPACE_RETRIES = 2
CACHE_PROBES = 4
"""Files `DiskTier.cached_share` probes at most, per call."""
_READ_CACHED_KEPT = 4096  # page-cache verdicts kept for `was_page_cached` (asked right away)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DiskStats(TierStats):
    """`DiskTier.stats()`: occupancy, the effective capacity on a full disk, and counters."""

    bytes_reserved: int = 0  # by writes in flight
    effective_capacity: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    put_refused: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    corrupt_removed: int = 0
    layout_mismatch: int = 0
    read_failures: int = 0
    no_space_errors: int = 0  # writes that failed with ENOSPC or EDQUOT
    no_space_retries: int = 0  # writes tried again after evicting for room
    directory_recreated: int = 0  # the directory or its lock file was removed and made again
    touches: int = 0
    touch_failures: int = 0
    directory_syncs: int = 0  # fsyncs of shard directories after renames (several puts share one)
    filesystem_syncs: int = 0  # durability "batched": syncfs calls, each for many puts
    sync_failures: int = 0  # syncs that failed (logged; the chunks stay, read checks guard them)
    unsynced_puts: int = 0  # puts not yet on the disk itself (durability "batched" / "none")
    write_seconds: float = 0.0  # sum of per-write latencies
    read_seconds: float = 0.0
    # The eviction order's counters (`EvictionStats`).
    keys_reused: int = 0
    keys_first: int = 0
    keys_partial: int = 0
    history_keys: int = 0
    promotions: int = 0
    returns: int = 0


# What the tier counts as events (the rest of DiskStats is measured when asked).
_COUNTERS = counter_fields(
    DiskStats,
    measured=(
        *TIER_OCCUPANCY,
        "bytes_reserved",
        "effective_capacity",
        "directory_syncs",
        "unsynced_puts",
        "write_seconds",
        "read_seconds",
        *(field.name for field in dataclasses.fields(EvictionStats)),
    ),
)


class DiskTier(LowerTier):
    """L2 on a local directory, bounded by ``capacity`` bytes of files, evicting in the order
    ``eviction`` names (`tiered_kv.eviction`: "lru" or "reuse").

    ``durability``: when writes reach the disk itself (`EngineConfig.l2_durability`):
    "batched" syncs the filesystem every ``sync_interval_s`` for all the writes since the last,
    "per_write" fsyncs each file and its directory before the put returns, "none" leaves it to
    the kernel. A crash of the machine may lose the chunks not yet synced; the checksums keep a
    torn file from ever being served. ``io_threads``: the
    tier's blocking threads (reads and writes in parallel); None sizes them from the machine
    (`default_io_threads`). ``file_ops`` is the seam for fault tests (a full disk); leave the
    default otherwise.
    """

    name = "L2"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        *,
        durability: L2Durability = "batched",
        sync_interval_s: float = 0.1,
        limits: CodecLimits = DEFAULT_LIMITS,
        file_ops: FileOps = DEFAULT_FILE_OPS,
        io_threads: int | None = None,
        eviction: str = "lru",
        chunk_tokens: int | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"DiskTier: capacity must be a positive number of bytes, got {capacity!r}"
            )
        if durability not in L2_DURABILITIES:
            raise ConfigError(
                f"DiskTier: durability must be one of {L2_DURABILITIES}, got {durability!r}"
            )
        if not sync_interval_s > 0:
            raise ConfigError(f"DiskTier: sync_interval_s must be > 0, got {sync_interval_s!r}")
        self.root = Path(root)
        self.capacity = capacity
        self.durability = durability
        self.sync_interval_s = sync_interval_s
        self.limits = limits
        self.file_ops = file_ops
        threads = default_io_threads() if io_threads is None else io_threads
        # Reads have threads of their own: a burst of writes never queues a load behind it.
        self._read_pool = BlockingPool("tkv-l2-read", threads)
        self._write_pool = BlockingPool("tkv-l2-write", write_threads(threads))
        # Batched durability's syncs: a thread of their own, so a long one never holds a write.
        self._sync_pool = BlockingPool("tkv-l2-sync", 1)
        self._unsynced = 0  # puts since the last sync began (batched, none)
        self._unsynced_wanted = asyncio.Event()
        self._syncer: asyncio.Task[None] | None = None
        self._lock = DirectoryLock(self.root, file_ops)
        self._directory_sync = DirectorySyncer(file_ops)
        self._state = "new"
        self._index: dict[ChunkKey, Entry] = {}
        # Which entry goes first (`tiered_kv.eviction`); holds exactly the index's keys.
        self._order: EvictionOrder[ChunkKey] = make_order(eviction)
        self._chunk_tokens = chunk_tokens
        self._bytes_used = 0
        self._reserved = 0
        # At most capacity; lower while the filesystem holds less (see the module docstring).
        self._effective_capacity = capacity
        self._last_stamp_ns = 0
        self._bytes_deleted = 0  # grows when files are handed to a thread for unlinking
        # Keys with a put or an unlink in flight; never in the index at an await point.
        self._busy: dict[ChunkKey, asyncio.Event] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Whether each recent hit's file was in the page cache, until `was_page_cached` asks.
        self._read_cached: collections.OrderedDict[ChunkKey, bool] = collections.OrderedDict()
        self._write_seconds = 0.0
        self._read_seconds = 0.0
        self._plane: WorkerPlane | None = None

    def use_plane(self, plane: WorkerPlane | None) -> bool:
        """Read and write chunks whose objects lie in ``plane``'s arena through its worker
        processes (None: all on this tier's threads). A tier with its own ``file_ops`` (a fault
        seam) keeps its I/O on its threads, where that seam is."""
        self._plane = plane if self.file_ops is DEFAULT_FILE_OPS else None
        return self._plane is not None

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> None:
        """Lock the directory, drop stale temp files, and rebuild the index from headers."""
        if self._state != "new":
            raise EngineStateError(f"DiskTier.open: already {self._state}; open is called once")
        try:
            try:
                await self._write_pool.run(self._lock.acquire)
                rebuilt = await self._write_pool.run(
                    functools.partial(rebuild_index, self.root, self.limits)
                )
            except OSError as exc:
                raise TieredKVError(f"L2 directory {self.root} is not usable: {exc}") from exc
            # Oldest file first: the order starts as it ended, by last use (use counts are not
            # on disk: every chunk found starts first-seen, no use counted).
            for key, entry, mtime_ns in rebuilt.entries:
                self._insert(key, entry)
                self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
            self._counters["corrupt_removed"] += rebuilt.corrupt_removed
            victims = self._evict_until(lambda: self._bytes_used <= self.capacity)
            if victims:
                await self._unlink_entries(victims)
        except BaseException:
            self._lock.release()
            self._clear_index()
            # A failed open may be tried again: its threads end, a new pool serves the retry.
            await self._write_pool.aclose()
            await self._read_pool.aclose()
            self._write_pool = BlockingPool(self._write_pool.name, self._write_pool.size)
            self._read_pool = BlockingPool(self._read_pool.name, self._read_pool.size)
            raise
        self._state = "open"
        if self.durability == "batched":
            self._syncer = asyncio.get_running_loop().create_task(
                self._sync_loop(), name="tkv-l2-sync"
            )
        logger.info(
            "L2 %s: %d chunks, %d bytes; removed %d corrupt and %d temp files",
            self.root,
            len(self._index),
            self._bytes_used,
            rebuilt.corrupt_removed,
            rebuilt.temp_removed,
        )

    @property
    def read_parallelism(self) -> int:
        """Its read threads; with an I/O plane, `READS_PER_WORKER` per worker process."""
        if self._plane is not None:
            return self._plane.size * READS_PER_WORKER
        return self._read_pool.size

    @property
    def write_parallelism(self) -> int:
        """Its write threads: a write in flight on each (docs/benchmarks.md, "L2 writes"); with
        an I/O plane, `WRITES_PER_WORKER` per write worker, so small chunks go many to a
        message."""
        if self._plane is not None:
            return self._plane.write_size * WRITES_PER_WORKER
        return self._write_pool.size

    async def aclose(self) -> None:
        """Sync what batched durability has not synced yet, release the directory lock and join
        the I/O threads. Await or cancel this tier's operations first."""
        if self._state == "closed":
            return
        was_open = self._state == "open"
        self._state = "closed"
        syncer, self._syncer = self._syncer, None
        if syncer is not None:
            syncer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await syncer
        try:
            if was_open and self.durability == "batched" and self._unsynced:
                await self._sync()
        finally:
            await self._sync_pool.aclose()
        self._lock.release()
        self._clear_index()
        await self._write_pool.aclose()
        await self._read_pool.aclose()

    async def _sync_loop(self) -> None:
        """Batched durability: ``sync_interval_s`` after the first unsynced put, one sync of
        the filesystem for every put until then."""
        while True:
            await self._unsynced_wanted.wait()
            await asyncio.sleep(self.sync_interval_s)
            await self._sync()

    async def _sync(self) -> None:
        self._unsynced_wanted.clear()
        self._unsynced = 0  # puts landing during the sync wait for the next one
        try:
            await self._sync_pool.run(functools.partial(self.file_ops.sync_filesystem, self.root))
        except OSError:
            self._counters["sync_failures"] += 1
            logger.warning("L2 sync of %s failed", self.root, exc_info=True)
        else:
            self._counters["filesystem_syncs"] += 1

    def _check_open(self, verb: str) -> None:
        if self._state != "open":
            raise EngineStateError(
                f"DiskTier.{verb}: the tier is {self._state}; call open() first, not after aclose()"
            )

    # -- index ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    page_cached_reads = True

    def cached_share(self, keys: Sequence[ChunkKey]) -> float | None:
        """The share of the bytes of ``keys``' files in the page cache, from at most
        `CACHE_PROBES` files, evenly spread (`cached_fraction`: ``mincore``, which reads
        nothing in). Runs on the loop: a few system calls each, no device I/O."""
        held = [self._index[key] for key in keys if key in self._index]
        if not held:
            return None
        step = max(1, len(held) // CACHE_PROBES)
        answers = []
        for entry in held[::step][:CACHE_PROBES]:
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except OSError:
                continue
            try:
                answers.append(cached_fraction(fd, entry.size))
            finally:
                os.close(fd)
        known = [answer for answer in answers if answer is not None]
        return sum(known) / len(known) if known else None

    def was_page_cached(self, key: ChunkKey) -> bool | None:
        return self._read_cached.pop(key, None)

    def entries(self) -> list[tuple[ChunkKey, int, int]]:
        """(key, num_tokens, file size) of every chunk, first to be evicted first."""
        index = self._index
        return [(key, index[key].num_tokens, index[key].size) for key in self._order.victims()]

    def stats(self) -> DiskStats:
        return DiskStats(
            entries=len(self._index),
            bytes_used=self._bytes_used,
            capacity=self.capacity,
            bytes_reserved=self._reserved,
            effective_capacity=self._effective_capacity,
            write_seconds=self._write_seconds,
            read_seconds=self._read_seconds,
            directory_syncs=self._directory_sync.calls,
            unsynced_puts=self._unsynced,
            **dataclasses.asdict(self._order.stats()),
            **self._counters,
        )

    def _stamp(self) -> int:
        """A file time for a chunk used now, later than every earlier one (ties would lose the
        order at the next open: file times have the clock tick's granularity)."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _fit_to_filesystem(self, free_bytes: int | None) -> None:
        """Effective capacity: our committed chunks plus the filesystem's free bytes.

        Writes in flight are not counted: whatever part of them is on disk already is missing
        from ``free_bytes``, so the estimate errs low by at most what they wrote; counting their
        whole size would err high, and the next write would meet ``ENOSPC`` again.
        """
        if free_bytes is not None:
            self._effective_capacity = max(0, min(self.capacity, self._bytes_used + free_bytes))

    def _path_for(self, key: ChunkKey) -> Path:
        name = key.hex
        return self.root / name[:2] / name

    def _evict_until(self, fits: Callable[[], bool]) -> list[tuple[ChunkKey, Entry]]:
        """Pop entries, first to go first, until ``fits()``; the caller unlinks them."""
        victims = []
        while self._index and not fits():
            key = next(self._order.victims())
            entry = self._index.pop(key)
            self._order.remove(key)
            self._bytes_used -= entry.size
            victims.append((key, entry))
        self._counters["evictions"] += len(victims)
        return victims

    def _drop(self, key: ChunkKey, entry: Entry) -> bool:
        """Remove ``entry`` from the index if it is still ``key``'s entry."""
        if self._index.get(key) is not entry:
            return False
        del self._index[key]
        self._order.remove(key)
        self._bytes_used -= entry.size
        return True

    async def _wait_idle(self, key: ChunkKey) -> None:
        while (event := self._busy.get(key)) is not None:
            await event.wait()

    async def _unlink_entries(self, victims: Sequence[tuple[ChunkKey, Entry]]) -> None:
        """Delete files already dropped from the index; their keys stay busy meanwhile."""
        if self.events is not None:
            for key, _ in victims:
                self.events.emit("removed", self.name, key)
        events = [(key, asyncio.Event()) for key, _ in victims]
        self._busy.update(events)
        self._bytes_deleted += sum(entry.size for _, entry in victims)
        try:
            await self._write_pool.run(
                functools.partial(unlink_paths, [e.path for _, e in victims])
            )
        finally:
            for key, event in events:
                del self._busy[key]
                event.set()

    # -- data -------------------------------------------------------------------------------
    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("put")
        await self._wait_idle(key)
        if key in self._index:
            self._order.touch(key)
            return True
        if self._lock.lost:
            self._counters["put_failures"] += 1
            return False
        specs = obj.group_specs()
        key_bytes = key.to_bytes()
        size = encoded_header_len(len(key_bytes), specs) + sum(spec.nbytes for spec in specs)
        if size + self._reserved > self.capacity:
            self._refuse(key, size)
            return False
        done = asyncio.Event()
        self._busy[key] = done
        try:
            if size + self._reserved > self._effective_capacity:
                # Even an empty tier would not hold it on this filesystem: has space come back?
                free_bytes = await self._write_pool.run(
                    functools.partial(self.file_ops.free_bytes, self.root)
                )
                self._fit_to_filesystem(free_bytes)
                if size + self._reserved > self._effective_capacity:
                    self._refuse(key, size)
                    return False
            victims = self._evict_until(
                lambda: self._bytes_used + self._reserved + size <= self._effective_capacity
            )
            self._reserved += size
            try:
                if victims:
                    await self._unlink_entries(victims)
                return await self._write(key, key_bytes, obj, specs, size)
            finally:
                self._reserved -= size
        finally:
            del self._busy[key]
            done.set()

    def _refuse(self, key: ChunkKey, size: int) -> None:
        self._counters["put_refused"] += 1
        logger.debug(
            "L2 put of %s refused: %d bytes, capacity %d (effective %d), %d reserved by writes "
            "in flight",
            key.hex,
            size,
            self.capacity,
            self._effective_capacity,
            self._reserved,
        )

    async def _write(
        self,
        key: ChunkKey,
        key_bytes: bytes,
        obj: MemoryObj,
        specs: tuple[GroupSpec, ...],
        size: int,
    ) -> bool:
        """Write the file, evicting and trying again after no-space errors; ``size`` is reserved."""
        final_path = self._path_for(key)
        entry = Entry(final_path, size, obj.num_tokens, specs)
        plane = self._plane if self._plane is not None and self._plane.serves(obj.arena) else None
        attempt = 0
        while True:
            temp_name = f".{final_path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
            job = WriteJob(
                directory=final_path.parent,
                temp_path=final_path.parent / temp_name,
                final_path=final_path,
                key_bytes=key_bytes,
                num_tokens=obj.num_tokens,
                specs=specs,
                buffers=obj.group_buffers(),
                fsync=self.durability == "per_write",
                limits=self.limits,
                file_ops=self.file_ops,
                directory_sync=self._directory_sync,
                lock=self._lock,
                stamp_ns=self._stamp(),
                measure_free_space=self._effective_capacity < self.capacity,
            )
            deleted_before = self._bytes_deleted
            started = time.perf_counter()
            try:
                if plane is not None:
                    await self._write_in_worker(plane, job, obj)
                else:
                    await self._write_pool.run(functools.partial(store_chunk, job), job.abort)
            except asyncio.CancelledError:
                # Cancelled after the rename: the chunk is complete, so keep it indexed.
                if job.committed:
                    self._insert(key, entry)
                raise
            except Exception as exc:
                if self._lock.lost:
                    self._forget_lost_directory()
                elif job.lock_retaken:
                    await self._forget_vanished_files()
                if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
                    await self._make_room_after_no_space(key, job, size)
                    # Again only if files went (ours or other puts' victims) since this try began.
                    if self._bytes_deleted > deleted_before and attempt < _NO_SPACE_RETRIES:
                        attempt += 1
                        self._counters["no_space_retries"] += 1
                        continue
                self._counters["put_failures"] += 1
                logger.warning("L2 put of %s failed", key.hex, exc_info=True)
                return False
            finally:
                self._write_seconds += time.perf_counter() - started
            self._insert(key, entry)
            if job.measure_free_space:
                self._fit_to_filesystem(job.free_bytes)
            self._counters["puts"] += 1
            self._counters["bytes_written"] += size
            if self.durability != "per_write":
                self._unsynced += 1
                self._unsynced_wanted.set()
            if job.lock_retaken:
                await self._forget_vanished_files()  # after the insert: a cancel keeps the chunk
            return True

    async def _write_in_worker(self, plane: WorkerPlane, job: WriteJob, obj: MemoryObj) -> None:
        """`store_chunk`'s work done by an I/O worker, from ``obj``'s arena runs; its outcome in
        ``job`` as `store_chunk` leaves it (an `OSError` for a failed write)."""
        template = header_template(job.key_bytes, job.num_tokens, job.specs, limits=self.limits)
        job.lock_retaken = self._lock.ensure_held(job.fsync)
        write = plane.submit_write(
            str(job.temp_path),
            str(job.final_path),
            template.data,
            template.checksums_at,
            obj.group_runs(),
            STRIPE_BYTES,
            job.stamp_ns,
            job.fsync,
            job.measure_free_space,
        )
        try:
            done = await write.done()
        except asyncio.CancelledError:
            settled = await write.settle()  # nothing reads obj's bytes after this
            if settled is None:  # its worker died: whatever it left is not ours to keep
                unlink_quietly(job.temp_path)
                unlink_quietly(job.final_path)
            job.committed = settled is not None and settled.status == "written"
            raise
        except WorkerDied:
            unlink_quietly(job.temp_path)
            unlink_quietly(job.final_path)
            raise
        job.free_bytes = done.free_bytes
        if done.status != "written":
            raise OSError(done.errno, done.detail)
        job.committed = True

    async def _make_room_after_no_space(self, key: ChunkKey, job: WriteJob, size: int) -> None:
        """Lower the effective capacity to what the filesystem holds and evict down to it."""
        self._counters["no_space_errors"] += 1
        self._fit_to_filesystem(job.free_bytes)
        if job.free_bytes is None:  # unknown: assume the disk holds what we hold now
            self._effective_capacity = min(self._effective_capacity, self._bytes_used)
        victims = self._evict_until(
            lambda: self._bytes_used + self._reserved <= self._effective_capacity
        )
        logger.info(
            "L2: no space for %s (%d bytes): effective capacity now %d of %d, evicting %d chunks",
            key.hex,
            size,
            self._effective_capacity,
            self.capacity,
            len(victims),
        )
        if victims:
            await self._unlink_entries(victims)

    def _forget_lost_directory(self) -> None:
        """Another tier owns the directory now: none of its files are ours to read or delete."""
        if self._index:
            logger.warning(
                "L2 %s: another tier took the directory; forgetting %d chunks",
                self.root,
                len(self._index),
            )
        self._clear_index()

    async def _forget_vanished_files(self) -> None:
        """The directory was recreated: drop the entries whose files went with the old one."""
        self._counters["directory_recreated"] += 1
        snapshot = list(self._index.items())
        gone_flags = await self._write_pool.run(
            functools.partial(vanished, [entry.path for _, entry in snapshot])
        )
        for (key, entry), gone in zip(snapshot, gone_flags, strict=True):
            if gone:
                self._drop(key, entry)

    def _insert(self, key: ChunkKey, entry: Entry) -> None:
        self._index[key] = entry
        partial = self._chunk_tokens is not None and entry.num_tokens < self._chunk_tokens
        self._order.insert(key, partial=partial)
        self._bytes_used += entry.size

    def _clear_index(self) -> None:
        for key in self._index:
            self._order.remove(key)
        self._index.clear()
        self._bytes_used = 0

    def use(self, keys: Sequence[ChunkKey]) -> None:
        self._order.use(keys)

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("get_into")
        entry = self._index.get(key)
        if entry is None:
            self._counters["misses"] += 1
            return False
        specs = obj.group_specs()
        if entry.num_tokens != obj.num_tokens or entry.groups != specs:
            self._counters["layout_mismatch"] += 1
            self._counters["misses"] += 1
            return False
        started = time.perf_counter()
        cached: bool | None = None
        try:
            plane = self._plane
            outcome, detail = ReadOutcome.CORRUPT, "not read"
            if plane is not None and plane.serves(obj.arena):
                outcome, detail, cached = await self._read_in_worker(plane, key, entry, obj, specs)
            if outcome is not ReadOutcome.HIT:
                # On the tier's threads (also what judges a file the worker's read did not
                # pass: the threads read the whole header, so their verdict names the cause).
                abort = threading.Event()
                read = ChunkRead(
                    entry.path,
                    key.to_bytes(),
                    obj.num_tokens,
                    specs,
                    obj.group_buffers(),
                    self.limits,
                    abort,
                    self._stamp(),
                    self.file_ops,
                )
                await self._read_pool.run_all(read.parts(), abort)
                outcome, detail = read.outcome()
                cached = read.cached
        except Exception:
            self._counters["read_failures"] += 1
            self._counters["misses"] += 1
            logger.warning("L2 read of %s failed", key.hex, exc_info=True)
            return False
        finally:
            self._read_seconds += time.perf_counter() - started

        if outcome is ReadOutcome.HIT:
            if cached is not None:
                self._read_cached[key] = cached
                if len(self._read_cached) > _READ_CACHED_KEPT:
                    self._read_cached.popitem(last=False)
            if self._index.get(key) is entry:
                self._order.touch(key)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += entry.payload_len
            return True
        self._counters["misses"] += 1
        if outcome is ReadOutcome.MISSING:
            self._drop(key, entry)
        elif outcome is ReadOutcome.LAYOUT_MISMATCH:
            self._counters["layout_mismatch"] += 1
        elif outcome is ReadOutcome.CORRUPT:
            logger.warning("L2: removing corrupt %s: %s", entry.path, detail)
            if self._drop(key, entry):
                self._counters["corrupt_removed"] += 1
                await self._unlink_entries([(key, entry)])
        else:
            logger.warning("L2: %s: %s", entry.path, detail)
        return False

    async def _read_in_worker(
        self,
        plane: WorkerPlane,
        key: ChunkKey,
        entry: Entry,
        obj: MemoryObj,
        specs: tuple[GroupSpec, ...],
    ) -> tuple[ReadOutcome, str, bool | None]:
        """The chunk read by an I/O worker straight into ``obj``, judged here: HIT, MISSING, or
        CORRUPT with why (the caller reads it again on its threads to name the cause); and
        whether its file was in the page cache before."""
        key_bytes = key.to_bytes()
        header_len = check_encodable(key_bytes, obj.num_tokens, specs, self.limits)
        extents = obj.group_runs()
        payload_len = sum(length for _, length in extents)
        # As on the threads: runs of whole stripes, one job each, so one chunk's read spreads
        # over several workers. Every part ends before this returns, whatever the outcome.
        stripes = stripe_count(payload_len)
        per_part = max(1, self.file_ops.read_slice_bytes // STRIPE_BYTES)
        stamp = self._stamp()
        parts = await asyncio.gather(
            *(
                plane.read(
                    str(entry.path),
                    header_len,
                    payload_len,
                    extents,
                    STRIPE_BYTES,
                    stamp,
                    (start, min(start + per_part, stripes)),
                )
                for start in range(0, max(stripes, 1), per_part)
            ),
            return_exceptions=True,
        )
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        answers = typing.cast("list[ChunkBytes]", parts)
        answer = answers[0]
        for part in answers:
            if part.status != "read":
                answer = part
                break
        digests = [digest for part in answers for digest in part.digests]
        if answer.status == "missing":
            return ReadOutcome.MISSING, "", None
        if answer.status != "read":
            return ReadOutcome.CORRUPT, answer.detail, None
        try:
            header = decode_header(answer.header, self.limits)
        except CodecError as exc:
            return ReadOutcome.CORRUPT, f"bad header: {exc}", None
        check, detail = check_frame_header(
            header,
            key_bytes=key_bytes,
            num_tokens=obj.num_tokens,
            groups=specs,
            frame_len=answer.file_size,
        )
        if check is not FrameCheck.OK:
            return ReadOutcome.CORRUPT, detail, None
        problem = check_payload_checksums(header, digests)
        if problem is not None:
            return ReadOutcome.CORRUPT, problem, None
        return ReadOutcome.HIT, "", answer.cached

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Move ``keys`` to the recent end of the LRU and stamp their files' mtimes (one thread
        hop for the batch), so that the order survives a restart. After close: a no-op."""
        if self._state != "open":
            return
        stamps = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None:
                continue
            self._order.touch(key)
            stamps.append((entry.path, self._stamp()))
        if not stamps:
            return
        try:
            failures = await self._write_pool.run(functools.partial(set_mtimes, stamps))
        except Exception:  # recency is a hint: the in-memory order stands
            logger.warning("L2: stamping %d touched files failed", len(stamps), exc_info=True)
            failures = len(stamps)
        self._counters["touches"] += len(stamps) - failures
        self._counters["touch_failures"] += failures

    async def remove(self, key: ChunkKey) -> bool:
        self._check_open("remove")
        await self._wait_idle(key)
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._order.remove(key)
        self._bytes_used -= entry.size
        await self._unlink_entries([(key, entry)])
        return True
