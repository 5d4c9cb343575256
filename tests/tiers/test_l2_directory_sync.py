"""`DirectorySyncer`: writers renaming into one directory share its fsyncs, and each returns only
after an fsync that began after its call (so its rename is durable), errors reaching every caller
of the failed fsync."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest

from tiered_kv.tiers.l2.files import DirectorySyncer, FileOps


class TimedSyncs(FileOps):
    """Directory fsyncs that take ``delay_s`` and are recorded as (directory, start, end);
    ``fail_calls`` lists which calls (0-based, in start order) raise EIO."""

    def __init__(self, delay_s: float, fail_calls: tuple[int, ...] = ()) -> None:
        self.delay_s = delay_s
        self.fail_calls = fail_calls
        self.calls: list[tuple[Path, float, float]] = []
        self._lock = threading.Lock()
        self._started = 0

    def fsync_directory(self, directory: Path) -> None:
        with self._lock:
            number = self._started
            self._started += 1
        start = time.perf_counter()
        time.sleep(self.delay_s)
        with self._lock:
            self.calls.append((directory, start, time.perf_counter()))
        if number in self.fail_calls:
            raise OSError(errno.EIO, "injected directory fsync failure", str(directory))


def _sync_together(
    syncer: DirectorySyncer, directories: list[Path]
) -> list[tuple[float, float, BaseException | None]]:
    """One thread per directory, released together: (called, returned, error) for each."""
    barrier = threading.Barrier(len(directories))
    results: list[tuple[float, float, BaseException | None]] = [(0.0, 0.0, None)] * len(directories)

    def writer(index: int) -> None:
        barrier.wait()
        called = time.perf_counter()
        try:
            syncer.sync(directories[index])
            error = None
        except OSError as exc:
            error = exc
        results[index] = (called, time.perf_counter(), error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(directories))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_writers_share_fsyncs_and_each_is_covered_by_one_begun_after_its_call(
    tmp_path: Path,
) -> None:
    ops = TimedSyncs(delay_s=0.05)
    syncer = DirectorySyncer(ops)
    results = _sync_together(syncer, [tmp_path] * 8)

    assert all(error is None for _, _, error in results)
    # Eight callers, one running fsync and one batch of the others after it (a late thread
    # may start one more): never one each.
    assert 1 <= len(ops.calls) <= 3
    assert syncer.calls == len(ops.calls)
    for called, returned, _ in results:
        assert any(called <= start and end <= returned for _, start, end in ops.calls), (
            "a caller returned without an fsync that began after its call"
        )


def test_an_fsync_error_reaches_every_caller_of_its_batch_and_no_other(tmp_path: Path) -> None:
    # Call 0 (a lone caller) succeeds, slowly; callers arriving meanwhile share call 1, which fails.
    ops = TimedSyncs(delay_s=0.2, fail_calls=(1,))
    syncer = DirectorySyncer(ops)
    first: list[BaseException | None] = []

    def lone() -> None:
        try:
            syncer.sync(tmp_path)
            first.append(None)
        except OSError as exc:
            first.append(exc)

    runner = threading.Thread(target=lone)
    runner.start()
    while not ops._started:
        time.sleep(0.001)
    joined = _sync_together(syncer, [tmp_path] * 3)
    runner.join(timeout=30)

    assert first == [None]
    assert len(ops.calls) == 2
    errors = [error for _, _, error in joined]
    assert all(isinstance(error, OSError) and error.errno == errno.EIO for error in errors)
    assert len({id(error) for error in errors}) == 3  # a copy each, not one shared object
    # The directory is usable again: the next caller gets an fsync of its own, and no error.
    syncer.sync(tmp_path)
    assert len(ops.calls) == 3


def test_directories_do_not_wait_for_each_other(tmp_path: Path) -> None:
    release = threading.Event()
    blocked = tmp_path / "blocked"

    class OneSlowDirectory(FileOps):
        def fsync_directory(self, directory: Path) -> None:
            if directory == blocked:
                assert release.wait(timeout=30)

    syncer = DirectorySyncer(OneSlowDirectory())
    waiter = threading.Thread(target=syncer.sync, args=(blocked,))
    waiter.start()
    try:
        syncer.sync(tmp_path / "other")  # returns while the other directory's fsync hangs
        assert waiter.is_alive()
    finally:
        release.set()
        waiter.join(timeout=30)
    assert not waiter.is_alive()


@pytest.mark.parametrize("callers", [1, 4])
def test_state_is_dropped_once_no_caller_is_inside(tmp_path: Path, callers: int) -> None:
    syncer = DirectorySyncer(TimedSyncs(delay_s=0.01))
    _sync_together(syncer, [tmp_path] * callers)
    assert syncer.busy_directories == 0
