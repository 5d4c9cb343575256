"""`WorkerPlane`: L2 reads and writes, and ``tkv://`` GETs and PUTs, in worker processes,
straight into and out of the shared L1 arena (each worker holds its own connection to a
``tkv://`` server).

Owns the worker processes (`tiered_kv/io/worker.py`, started by path with ``python -I``: they
import no tiered_kv and no torch, and hold no CUDA state; fork + exec, never a bare fork), one
``SOCK_SEQPACKET`` socket to each, and the jobs in flight on each. Reads and writes have workers
of their own, so a burst of writes never queues a load behind it. The loop sends a descriptor
per chunk (the file, the header's length or its template, the arena runs of the payload) and
awaits one answer (a read: the header's bytes and each stripe's digest; a write: whether the
file is in place); the bytes themselves never cross the interpreter of the engine's process,
whose lock therefore never paces them. The descriptors started in one loop iteration go to a
worker in one message; it answers them as they end, several to a message at most every
`tiered_kv.io.worker.ANSWER_EVERY_S` (a long backlog's first chunks are answered while the rest
are still read).

Faults: a worker that dies fails the jobs it held (misses; a dead process writes nothing more
into their buffers) and is replaced. A caller cancelled while its job runs waits for the job to
end, `STUCK_GRACE_S` at most; then the worker is killed (its death ends the job) and replaced, so
a stuck worker costs the deadline plus the grace, no buffer is ever written after its read
returned, and none is read after its write returned. Workers die with the engine's process
(``PR_SET_PDEATHSIG``, and their socket's EOF).

Must not: judge the bytes (the tier checks the header and compares the digests), or know about
tiers or keys (a key is opaque bytes here). Threads: loop-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from tiered_kv.errors import ConfigError, EngineStateError, TieredKVError
from tiered_kv.memory import HostArena

logger = logging.getLogger(__name__)

WORKER_PATH = Path(__file__).with_name("worker.py")
STUCK_GRACE_S = 1.0
MAX_MESSAGE = 1 << 20
MAX_BATCH = 256  # jobs per message (a job's descriptor is a few hundred bytes)
# Reads worth having in flight per worker: a worker's share of a prefetch then goes out in one
# message and comes back in one.
READS_PER_WORKER = 4
# Writes worth having in flight per write worker: small chunks go many to a message.
WRITES_PER_WORKER = 16


class WorkerDied(TieredKVError):
    """The worker holding a job died before answering: the job's chunk is a miss."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkBytes:
    """A worker's answer: ``status`` "read" (``header``: the file's first bytes; ``digests``:
    one per stripe, None past a short file's end), "missing" or "error" (``detail``)."""

    status: Literal["read", "missing", "mismatch", "error"]
    header: bytes
    digests: list[int | None]
    file_size: int
    cached: bool | None  # the payload's first pages were in the page cache before the read
    detail: str


@dataclasses.dataclass(frozen=True, slots=True)
class WriteDone:
    """A worker's answer to a write: ``status`` "written" (the file is in place) or "error"
    (``errno``, ``detail``; no file left at either path); ``free_bytes``: the filesystem's
    free bytes when asked for or after a no-space error, else None."""

    status: Literal["written", "error"]
    errno: int
    detail: str
    free_bytes: int | None


Role = Literal["read", "write"]
RemoteEndpoint = tuple[str, int, bytes]  # a tkv:// server: host, port, shared token (b"": none)


@dataclasses.dataclass(eq=False)
class _Worker:
    role: Role
    process: subprocess.Popen[bytes]
    channel: socket.socket
    pending: dict[int, asyncio.Future[tuple[object, ...]]] = dataclasses.field(default_factory=dict)
    dead: bool = False
    killed: bool = False  # stuck: killed by the plane
    outbox: list[tuple[object, ...]] = dataclasses.field(default_factory=list)  # not sent yet


@dataclasses.dataclass(frozen=True, slots=True)
class PlaneStats:
    workers: int  # readers and writers
    write_workers: int
    reads: int  # jobs sent, by kind
    writes: int
    in_flight: int
    worker_deaths: int
    stuck_killed: int


class WorkerPlane:
    """``workers`` processes reading into ``arena`` (which must be shared: ``shared=True``) and
    ``write_workers`` writing from it."""

    def __init__(self, arena: HostArena, workers: int, write_workers: int = 2) -> None:
        if arena.shared_fd is None:
            raise ConfigError("io_plane 'processes' needs a shared arena (HostArena shared=True)")
        for name, value in (("io_workers", workers), ("write_workers", write_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
        self.arena = arena
        self.size = workers
        self.write_size = write_workers
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closing = False
        self._started = False
        self._flush_scheduled = False
        self._jobs = {"read": 0, "write": 0}
        self._deaths = 0
        self._stuck_killed = 0

    def serves(self, arena: HostArena) -> bool:
        return self._started and not self._closing and arena is self.arena

    def start(self) -> None:
        """Start the workers (on the loop; each start is a fork + exec, milliseconds)."""
        if self._started:
            raise EngineStateError("WorkerPlane.start: already started")
        self._started = True
        for _ in range(self.size):
            self._workers.append(self._spawn("read"))
        for _ in range(self.write_size):
            self._workers.append(self._spawn("write"))

    def _spawn(self, role: Role) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        arena_fd = self.arena.shared_fd
        assert arena_fd is not None  # checked in __init__
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    str(WORKER_PATH),
                    str(arena_fd),
                    str(self.arena.mapped_bytes),
                    str(theirs.fileno()),
                ],
                pass_fds=(arena_fd, theirs.fileno()),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        worker = _Worker(role, process, ours)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_readable, worker)
        return worker

    def worker_pids(self, role: Role | None = None) -> list[int]:
        """The live workers' process ids, of ``role`` or all (for inspection and fault tests)."""
        return [
            worker.process.pid
            for worker in self._workers
            if not worker.dead and role in (None, worker.role)
        ]

    def stats(self) -> PlaneStats:
        """Its workers, reads and writes sent, jobs in flight, deaths and stuck workers
        killed."""
        live = [worker for worker in self._workers if not worker.dead]
        return PlaneStats(
            len(live),
            sum(worker.role == "write" for worker in live),
            self._jobs["read"],
            self._jobs["write"],
            sum(len(worker.pending) for worker in live),
            self._deaths,
            self._stuck_killed,
        )

    async def read(
        self,
        path: str,
        header_len: int,
        payload_len: int,
        extents: list[tuple[int, int]],
        stripe_bytes: int,
        stamp_ns: int,
        stripes: tuple[int, int] | None = None,
    ) -> ChunkBytes:
        """Read the chunk file at ``path``: its payload's stripes ``stripes`` (first, last + 1;
        None: all) into the arena runs ``extents`` (the whole payload's, in order), hashed per
        ``stripe_bytes``; the reading of stripe 0 also returns the first ``header_len`` bytes.
        `WorkerDied` when its worker died first. Cancelled: returns once nothing writes the
        runs any more."""
        first, last = stripes if stripes is not None else (0, -(-payload_len // stripe_bytes))
        worker, future = self._submit(
            "read",
            (path, header_len, payload_len, extents, stripe_bytes, stamp_ns, first, last),
        )
        return ChunkBytes(*await self._answer(worker, future))  # type: ignore[arg-type]

    def submit_write(
        self,
        temp_path: str,
        final_path: str,
        header: bytes,
        checksums_at: int,
        extents: list[tuple[int, int]],
        stripe_bytes: int,
        stamp_ns: int,
        fsync: bool,
        measure_free: bool,
    ) -> PlaneWrite:
        """Start writing the chunk whose payload lies in the arena runs ``extents`` (in order)
        to ``temp_path``, then renaming it to ``final_path`` (worker.py says how). Await
        `PlaneWrite.done`; a caller cancelled meanwhile awaits `PlaneWrite.settle` before the bytes
        may change. `WorkerDied` when no worker is alive."""
        worker, future = self._submit(
            "write",
            (
                temp_path,
                final_path,
                header,
                checksums_at,
                extents,
                stripe_bytes,
                stamp_ns,
                fsync,
                measure_free,
            ),
        )
        return PlaneWrite(future, functools.partial(self._until_done, worker, future))

    async def remote_get(
        self,
        endpoint: RemoteEndpoint,
        key: bytes,
        header_len: int,
        payload_len: int,
        extents: list[tuple[int, int]],
        stripe_bytes: int,
        timeout_s: float,
    ) -> ChunkBytes:
        """GET ``key`` from the ``tkv://`` server at ``endpoint`` over a read worker's own
        connection: the chunk frame's first ``header_len`` bytes back, its payload into the
        arena runs ``extents``, hashed per ``stripe_bytes`` (status "mismatch": a frame of
        another length, not read). Cancellation as for `read`."""
        worker, future = self._submit(
            "read",
            (
                *endpoint,
                key,
                header_len,
                payload_len,
                extents,
                stripe_bytes,
                timeout_s,
            ),
            kind="get",
        )
        return ChunkBytes(*await self._answer(worker, future))  # type: ignore[arg-type]

    def submit_remote_put(
        self,
        endpoint: RemoteEndpoint,
        key: bytes,
        header: bytes,
        checksums_at: int,
        extents: list[tuple[int, int]],
        stripe_bytes: int,
        timeout_s: float,
    ) -> PlaneWrite:
        """PUT the chunk whose payload lies in the arena runs ``extents`` under ``key`` on the
        ``tkv://`` server at ``endpoint``, over a write worker's own connection; the header
        (``header``, a `tiered_kv.codec.HeaderTemplate`'s bytes) is sealed there. As for
        `submit_write`."""
        worker, future = self._submit(
            "write",
            (*endpoint, key, header, checksums_at, extents, stripe_bytes, timeout_s),
            kind="put",
        )
        return PlaneWrite(future, functools.partial(self._until_done, worker, future))

    async def _answer(
        self, worker: _Worker, future: asyncio.Future[tuple[object, ...]]
    ) -> tuple[object, ...]:
        """``future``'s answer; cancelled: returns once its job no longer runs (`_until_done`)."""
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await self._until_done(worker, future)
            raise

    def _submit(
        self, role: Role, job: tuple[object, ...], kind: str | None = None
    ) -> tuple[_Worker, asyncio.Future[tuple[object, ...]]]:
        if self._closing or not self._started:
            raise EngineStateError(f"WorkerPlane: {role}: the plane is not running")
        worker = min(
            (w for w in self._workers if not w.dead and w.role == role),
            key=lambda w: len(w.pending),
            default=None,
        )
        if worker is None:
            raise WorkerDied(f"no live I/O {role} worker")
        job_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[object, ...]] = loop.create_future()
        worker.pending[job_id] = future
        worker.outbox.append((kind or role, job_id, *job))
        self._jobs[role] += 1
        if not self._flush_scheduled:  # the jobs started in this loop iteration go together
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return worker, future

    async def _until_done(
        self, worker: _Worker, future: asyncio.Future[tuple[object, ...]]
    ) -> None:
        """A cancelled caller's job: wait for it to end, killing its worker after the grace."""
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(future), STUCK_GRACE_S)
        if not future.done():
            if not worker.killed:  # its other jobs' callers may be leaving at the same time
                worker.killed = True
                self._stuck_killed += 1
                logger.warning(
                    "I/O worker %d still busy %.1fs after its caller left: killing it",
                    worker.process.pid,
                    STUCK_GRACE_S,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGKILL)
            await _exited(worker.process, 10.0)
            self._died(worker)
        if not future.cancelled():
            future.exception()  # retrieved: the caller sees its cancellation

    def _flush(self) -> None:
        """Send each worker the jobs queued for it, `MAX_BATCH` to a message."""
        self._flush_scheduled = False
        for worker in list(self._workers):
            while worker.outbox and not worker.dead:
                batch, worker.outbox = worker.outbox[:MAX_BATCH], worker.outbox[MAX_BATCH:]
                try:
                    worker.channel.send(pickle.dumps(batch))
                except OSError as exc:
                    logger.warning("I/O worker %d: %s", worker.process.pid, exc)
                    self._died(worker)

    def _on_readable(self, worker: _Worker) -> None:
        while not worker.dead:
            try:
                message = worker.channel.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                message = b""
            if not message:
                self._died(worker)
                return
            for job_id, *answer in pickle.loads(message):
                future = worker.pending.pop(job_id, None)
                if future is not None and not future.done():
                    future.set_result(tuple(answer))

    def _died(self, worker: _Worker) -> None:
        """Fail its jobs (a dead worker writes nothing more), reap it, start another."""
        if worker.dead:
            return
        worker.dead = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(worker.channel.fileno())
        worker.channel.close()
        pending, worker.pending = worker.pending, {}
        worker.outbox.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(WorkerDied(f"I/O worker {worker.process.pid} died"))
        if worker.process.poll() is None:
            # Its socket closed but it may live on: it must not write into the arena any more.
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGKILL)
            threading.Thread(target=worker.process.wait, name="tkv-io-reap", daemon=True).start()
        if self._closing:
            return
        self._deaths += 1
        logger.warning("I/O worker %d died; starting another", worker.process.pid)
        self._workers = [w for w in self._workers if w is not worker]
        self._workers.append(self._spawn(worker.role))

    async def aclose(self) -> None:
        """Stop every worker (its socket closes; it exits) and wait for them; jobs still in
        flight fail. Idempotent."""
        if self._closing:
            return
        self._closing = True
        workers, self._workers = self._workers, []
        for worker in workers:
            if not worker.dead:
                self._died(worker)
        for worker in workers:
            await _exited(worker.process, 10.0)


class PlaneWrite:
    """A write handed to a worker (`WorkerPlane.submit_write`)."""

    def __init__(
        self,
        future: asyncio.Future[tuple[object, ...]],
        until_done: Callable[[], Awaitable[None]],
    ) -> None:
        self._future = future
        self._until_done = until_done

    async def done(self) -> WriteDone:
        """Its answer; `WorkerDied` when its worker died first (nothing at the final path is
        known then: see `settle`)."""
        return WriteDone(*await asyncio.shield(self._future))  # type: ignore[arg-type]

    async def settle(self) -> WriteDone | None:
        """After the caller was cancelled: wait until no worker reads the payload any more
        (`STUCK_GRACE_S`, then its worker is killed); its answer, or None when it never came
        (the files it may have left are the caller's to remove)."""
        await self._until_done()
        future = self._future
        if future.done() and not future.cancelled() and future.exception() is None:
            return WriteDone(*future.result())  # type: ignore[arg-type]
        return None


async def _exited(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait, without blocking the loop, until ``process`` has exited and is reaped (at most
    ``timeout_s``), on a thread of its own."""
    if process.poll() is not None:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def wait() -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=wait, name="tkv-io-reap", daemon=True).start()
    await done


def shared_memory_works() -> bool:
    """Whether this system offers what the plane needs: an anonymous shared mapping to pass to
    worker processes (``memfd_create``, Linux)."""
    return hasattr(os, "memfd_create")


def default_io_workers() -> int:
    """Workers when none are configured: one per core, 2 to 16."""
    return max(2, min(16, os.cpu_count() or 1))
