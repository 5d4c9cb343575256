"""L2 under SIGKILL: a writer process is killed at random points, again and again; then a fresh
tier on the same directory serves only complete chunks, bit-exact, and no temp file survives.

The writers are forked from one helper process that imported torch and tiered_kv once (a fresh
interpreter per kill would spend most of the test importing). Each writer opens a `DiskTier`,
stores deterministic chunks (content and key follow from an index) in a loop (under each
durability), touches some earlier ones, and prints each index once its put returned True; the
test kills it after a random delay. Run as ``python -m tests.faults.test_l2_crash ROOT`` it is
that helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO

import pytest

from tests.faults.indexed_chunks import CHUNK, IndexedChunks, chunk_files, temp_files
from tiered_kv.memory import HostArena
from tiered_kv.tiers.l2 import DiskTier, FileOps, scan_directory

CAPACITY = 1 << 30  # no eviction: every chunk a writer reported must still be there
KILLS = 12
# Where kills land: in renames and the batched syncs of the default durability ("batched"),
# mid-write without syncs ("slow"), mid-write and in per-write fsyncs ("slow+fsync").
WRITER_MODES = ("batched", "slow", "slow+fsync")
WORKER_RANGE = 1_000_000  # writer w stores indices w * WORKER_RANGE, w * WORKER_RANGE + 1, ...
REPO_ROOT = Path(__file__).resolve().parents[2]


# -- the chunks: key and content are functions of the index ------------------------------------
def num_tokens_of(index: int) -> int:
    return 1 + (index * 7919) % CHUNK  # partial chunks of every length


CHUNKS = IndexedChunks("crash", num_tokens_of)


# -- the writer (in the forked process) ---------------------------------------------------------
class SlowDisk(FileOps):
    """Short writes, each followed by a pause: a put spends most of its time mid-write, so that
    is where most kills land."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        written = super().pwrite(fd, data[: 16 << 10], offset)
        time.sleep(0.002)
        return written


async def _write_chunks(root: Path, first: int, mode: str) -> None:
    arena = HostArena(4 << 20, pin=False)
    if mode == "batched":
        tier = DiskTier(root, CAPACITY, sync_interval_s=0.01)
    else:
        durability = "per_write" if mode == "slow+fsync" else "none"
        tier = DiskTier(root, CAPACITY, durability=durability, file_ops=SlowDisk())
    await tier.open()
    os.write(1, b"ready\n")
    rng = random.Random(first)
    for index in itertools.count(first):
        obj = CHUNKS.chunk_of(arena, index)
        try:
            stored = await tier.put(CHUNKS.key_of(index), obj)
        finally:
            obj.unref()
        if stored:
            os.write(1, f"committed {index}\n".encode())  # one write: a kill cannot split it
        if index % 4 == 3:
            await tier.touch([CHUNKS.key_of(rng.randrange(first, index + 1)) for _ in range(3)])


def _helper(root: str) -> None:
    """Fork one writer per line on stdin (first index, mode); report its pid and its end."""
    for line in sys.stdin:
        first_word, mode = line.split()
        first = int(first_word)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.run(_write_chunks(Path(root), first, mode))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the helper's loop
        print(f"forked {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {status}", flush=True)


# -- the test -----------------------------------------------------------------------------------
@dataclasses.dataclass
class KillReport:
    last_committed: dict[int, int] = dataclasses.field(default_factory=dict)  # first -> last
    committed: int = 0  # puts the writers reported as stored
    killed_while_opening: int = 0
    temp_files_left: int = 0  # found after each kill, before the next writer's open
    torn_chunk_files: list[str] = dataclasses.field(default_factory=list)  # must stay empty


def inspect_after_kill(root: Path, report: KillReport) -> None:
    """Read every header the kill left (no lock taken, nothing removed)."""
    for scanned in scan_directory(root):
        if scanned.path.name.endswith(".tmp"):
            report.temp_files_left += 1
        elif scanned.error is not None:
            report.torn_chunk_files.append(f"{scanned.path.name}: {scanned.error}")


def _forward_lines(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def _kill_writers(root: Path, rng: random.Random) -> KillReport:
    """Run ``KILLS`` writers, each SIGKILLed after a random delay; what they reported."""
    report = KillReport()
    writer_pid = None
    with subprocess.Popen(
        [sys.executable, "-m", "tests.faults.test_l2_crash", str(root)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as helper:
        assert helper.stdin is not None and helper.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=_forward_lines, args=(helper.stdout, lines))
        reader.start()
        try:
            for kill in range(KILLS):
                first = kill * WORKER_RANGE
                # A kill (unlike a power cut) loses nothing the process wrote, fsync or not.
                helper.stdin.write(f"{first} {WRITER_MODES[kill % len(WRITER_MODES)]}\n")
                helper.stdin.flush()
                line = lines.get(timeout=60)  # the first one waits for the helper's imports
                assert line.startswith("forked "), line
                writer_pid = int(line.split()[1])
                # A few kills land while the writer opens the tier, most while it writes.
                time.sleep(rng.uniform(0, 0.01) if kill % 4 == 0 else rng.uniform(0.02, 0.4))
                try:
                    os.kill(writer_pid, signal.SIGKILL)
                except ProcessLookupError:
                    raise AssertionError(
                        "a writer ended before its kill (traceback above)"
                    ) from None
                ready = False
                while not (line := lines.get(timeout=30)).startswith("reaped "):
                    if line == "ready\n":
                        ready = True
                        continue
                    assert line.startswith("committed "), line
                    report.last_committed[first] = int(line.split()[1])
                    report.committed += 1
                assert line.split() == ["reaped", str(writer_pid), str(signal.SIGKILL)], line
                writer_pid = None
                report.killed_while_opening += not ready
                if root.exists():
                    inspect_after_kill(root, report)
        finally:
            if writer_pid is not None:  # a failed assertion: leave no writer behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(writer_pid, signal.SIGKILL)
            helper.stdin.close()
            helper.wait(timeout=30)
            reader.join(timeout=30)
    return report


@pytest.mark.slow
async def test_sigkilled_writers_leave_only_complete_chunks(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    started = time.perf_counter()
    report = await asyncio.to_thread(_kill_writers, root, random.Random(2026))
    # A writer may have been killed after the rename of the chunk after its last report.
    expected = {
        CHUNKS.key_of(index): index
        for first in (kill * WORKER_RANGE for kill in range(KILLS))
        for index in range(first, report.last_committed.get(first, first - 1) + 2)
    }
    committed = {
        CHUNKS.key_of(index)
        for first, last in report.last_committed.items()
        for index in range(first, last + 1)
    }
    assert report.torn_chunk_files == []  # after every kill, every chunk file was whole
    temp_before_open = len(temp_files(root))

    arena = HostArena(4 << 20, pin=False)
    tier = DiskTier(root, CAPACITY)
    await tier.open()
    verified = 0
    try:
        found = {key for key, _, _ in tier.entries()}
        assert tier.stats().corrupt_removed == 0  # no torn file ever bears a chunk's name
        assert temp_files(root) == []
        assert found <= set(expected), "a chunk nobody wrote"
        assert committed <= found, "a chunk reported as stored is gone"
        assert len(chunk_files(root)) == len(found)
        for key in found:
            await CHUNKS.assert_reads_back(tier, arena, key, expected[key])
            verified += 1
        assert tier.stats().hits == verified
    finally:
        await tier.aclose()
        assert arena.close() == 0
    assert report.committed >= KILLS  # the kills did land among writes
    print(
        f"\nL2 crash: {KILLS} SIGKILLs ({report.killed_while_opening} while opening), "
        f"{report.committed} chunks reported stored, {len(found)} found, {verified} verified "
        f"bit-exact, {report.temp_files_left} temp files left by the kills "
        f"({temp_before_open} by the last), none after open; {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    _helper(sys.argv[1])
