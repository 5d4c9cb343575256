"""The machine's own ceilings for the lower tiers, measured with no tiered_kv code in the path.

- `page_cache_read_gbps`: files already in the page cache read with ``readinto`` straight into
  preallocated buffers by N threads (the L2 warm ceiling).
- `direct_read_gbps`: the same files with their cached pages dropped first
  (``posix_fadvise(DONTNEED)``), read with ``O_DIRECT`` by N threads (the L2 cold ceiling); None
  where the filesystem refuses ``O_DIRECT``.
- `loopback_tcp_gbps`: N TCP streams on loopback, a sender process and this process receiving
  with blocking ``recv_into`` on one thread per stream (the L3 ceiling at N connections).
- `copy_gbps`: pinned host-to-device copies on a CUDA device, plain memory copies on the CPU
  (the bound of every load from host memory). Imports torch when called.

Benchmarks call these in the same run as their own figures and report ratios to them.
"""

from __future__ import annotations

import functools
import mmap
import multiprocessing
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_DIRECT_ALIGN = 4096
_SOCKET_TIMEOUT_S = 60.0  # a loopback ceiling's accept and receives; a dead sender raises


def sweep_text(sweep: Mapping[int, float | None], unit: str = "") -> str:
    """A ceiling sweep as one log line: ``1 threads: 6.67, 4 threads: 21.64 GB/s`` ("-" where
    it could not be measured)."""
    parts = [
        (f"{n} {unit}" if unit else f"{n}") + (": -" if v is None else f": {v:.2f}")
        for n, v in sorted(sweep.items())
    ]
    return ", ".join(parts) + " GB/s"


def _parallel(jobs: Sequence[Callable[[int], None]], threads: int) -> float:
    """Run ``jobs`` on ``threads`` threads (each takes the next job and calls it with its own
    index, 0 to ``threads - 1``); the wall time."""
    lock = threading.Lock()
    pending = list(reversed(jobs))
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        while True:
            with lock:
                if not pending or errors:
                    return
                job = pending.pop()
            try:
                job(index)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(max(1, threads))]
    started = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def _readinto_file(path: Path, buffer: memoryview, flags: int = 0) -> None:
    """Fill ``buffer`` from the start of ``path`` (less at its end)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        filled = 0
        while filled < len(buffer):
            count = os.readv(fd, [buffer[filled:]])
            if not count:
                break
            filled += count
    finally:
        os.close(fd)


def _read_files_gbps(
    paths: Sequence[Path], threads: int, flags: int, make_buffer: Callable[[int], memoryview]
) -> float:
    """GB/s of reading every file of ``paths`` whole, each thread into a buffer of its own
    (``make_buffer(size)``, its pages faulted in before timing) one file after another."""
    sizes = [os.path.getsize(path) for path in paths]
    largest = -(-max(sizes, default=1) // _DIRECT_ALIGN) * _DIRECT_ALIGN
    buffers = [make_buffer(largest) for _ in range(max(1, threads))]
    for buffer in buffers:
        for offset in range(0, len(buffer), 4096):
            buffer[offset] = 0

    def read(worker: int, path: Path, size: int) -> None:
        if flags:
            size = -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN
        _readinto_file(path, buffers[worker][:size], flags)

    jobs = [
        functools.partial(read, path=path, size=size)
        for path, size in zip(paths, sizes, strict=True)
    ]
    return sum(sizes) / _parallel(jobs, threads) / 1e9


def _anonymous(size: int) -> memoryview:
    """Page-aligned memory (``O_DIRECT`` needs aligned buffers)."""
    return memoryview(mmap.mmap(-1, max(size, _DIRECT_ALIGN)))


def page_cache_read_gbps(paths: Sequence[Path], threads: int, reps: int = 3) -> float:
    """GB/s of reading ``paths`` (already in the page cache) by ``threads`` threads with
    ``readinto``, each into a preallocated buffer; the best of ``reps`` passes after one
    warm-up pass."""
    _read_files_gbps(paths, threads, 0, _anonymous)
    return max(_read_files_gbps(paths, threads, 0, _anonymous) for _ in range(reps))


def drop_cached_pages(path: Path) -> None:
    """``fsync``, then ``posix_fadvise(DONTNEED)``: the kernel drops the file's cached pages,
    clean once written back (no root needed; a host-side cache under a VM may remain). L2's
    batched durability leaves recent files dirty for up to its interval."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_page_cache(directory: str | os.PathLike[str]) -> int:
    """`drop_cached_pages` for every file under ``directory``; the bytes advised. Files written
    and fsynced are clean, so the kernel drops them."""
    advised = 0
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                drop_cached_pages(path)
                advised += path.stat().st_size
            except OSError:  # removed meanwhile: nothing cached to drop
                continue
    return advised


def direct_read_gbps(paths: Sequence[Path], threads: int) -> float | None:
    """GB/s of ``O_DIRECT`` reads of ``paths`` by ``threads`` threads after dropping their
    cached pages; None where the filesystem refuses ``O_DIRECT``."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct or not paths:
        return None
    try:
        _readinto_file(paths[0], _anonymous(_DIRECT_ALIGN), direct)
    except OSError:
        return None
    for path in paths:
        drop_cached_pages(path)
    return _read_files_gbps(paths, threads, direct, _anonymous)


def _send_streams(port: int, streams: int, message_bytes: int, messages: int) -> None:
    """Sender process: ``streams`` connections, each sending ``messages`` messages of
    ``message_bytes`` from one buffer (``sendall``), paced by a 1-byte ack per message."""
    payload = memoryview(bytearray(os.urandom(1 << 16)) * (message_bytes >> 16))

    def send(sock: socket.socket) -> None:
        ack = bytearray(1)
        for _ in range(messages):
            sock.sendall(payload)
            sock.recv_into(ack)

    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    workers = [threading.Thread(target=send, args=(sock,)) for sock in sockets]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    for sock in sockets:
        sock.close()


def loopback_tcp_gbps(
    streams: int, *, message_bytes: int = 32 << 20, total_bytes: int = 2 << 30, reps: int = 3
) -> float:
    """GB/s received over ``streams`` loopback TCP connections from a sender process, each
    stream on its own receiving thread (``recv_into`` one preallocated buffer per stream);
    ``total_bytes`` per pass, median of ``reps`` passes."""
    message_bytes = max(1 << 16, message_bytes >> 16 << 16)
    messages = max(1, total_bytes // (message_bytes * streams))
    context = multiprocessing.get_context("spawn")
    results = []
    for _ in range(reps):
        with socket.create_server(("127.0.0.1", 0), backlog=streams) as server:
            port = server.getsockname()[1]
            sender = context.Process(
                target=_send_streams, args=(port, streams, message_bytes, messages), daemon=True
            )
            sender.start()
            # A sender that dies (a broken import in the spawned process) must not hang us.
            server.settimeout(_SOCKET_TIMEOUT_S)
            try:
                conns = [server.accept()[0] for _ in range(streams)]
                for conn in conns:
                    conn.settimeout(_SOCKET_TIMEOUT_S)
                buffers = [memoryview(bytearray(message_bytes)) for _ in range(streams)]

                def receive(conn: socket.socket, buffer: memoryview) -> None:
                    for _ in range(messages):
                        filled = 0
                        while filled < message_bytes:
                            count = conn.recv_into(buffer[filled:])
                            if not count:
                                raise ConnectionError("sender closed early")
                            filled += count
                        conn.sendall(b"\x01")

                jobs = [
                    (lambda _worker, c=conn, b=buffer: receive(c, b))
                    for conn, buffer in zip(conns, buffers, strict=True)
                ]
                elapsed = _parallel(jobs, streams)
                for conn in conns:
                    conn.close()
            finally:
                sender.join(30)
                if sender.is_alive():
                    sender.kill()
        results.append(message_bytes * messages * streams / elapsed / 1e9)
    return statistics.median(results)


def copy_gbps(device: str = "cpu", nbytes: int = 256 << 20, reps: int = 5) -> float:
    """GB/s of the best of ``reps`` copies of ``nbytes``: pinned host to ``device`` when it is
    a CUDA device (timed with CUDA events), host to host otherwise; one untimed copy first
    (page faults, lazy initialisation)."""
    import torch

    target_device = torch.device(device)
    cuda = target_device.type == "cuda"
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    if cuda:
        source = source.pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=target_device)
    target.copy_(source, non_blocking=cuda)
    best = float("inf")
    for _ in range(reps):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize(target_device)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9
