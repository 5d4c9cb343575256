"""`DirectoryLock`: the flock on ``root/.lock`` that keeps a second tier out of an L2 directory.

`ensure_held` runs on write threads, several at once; the other methods on the loop. Must not
touch chunk files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from pathlib import Path

from tiered_kv.errors import EngineStateError, L2DirectoryInUseError
from tiered_kv.tiers.l2.files import LOCK_NAME, FileOps

logger = logging.getLogger(__name__)


class DirectoryLock:
    """An exclusive, non-blocking flock on ``root/.lock``, held from acquire to release.

    `ensure_held` runs in write threads, several at once; the other methods on the loop.
    """

    def __init__(self, root: Path, file_ops: FileOps) -> None:
        self.path = root / LOCK_NAME
        self._file_ops = file_ops
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the locked file
        self._mutex = threading.Lock()
        # Set for good when another tier took the directory after ours was removed.
        self.lost = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, identity = self._lock_new_file()
        with self._mutex:
            self._fd, self._identity = fd, identity

    def _lock_new_file(self) -> tuple[int, tuple[int, int]]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stat = os.fstat(fd)
            # A directory we may lock but not write to would fail every put; say so at open.
            if not os.access(self.path.parent, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.path.parent))
        except BlockingIOError:
            holder = "unknown"
            with contextlib.suppress(OSError):
                holder = os.read(fd, 64).decode(errors="replace").strip() or holder
            os.close(fd)
            raise L2DirectoryInUseError(
                f"L2 directory {self.path.parent} is in use: {self.path} is locked "
                f"(holder pid {holder}); give each process its own l2 directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # Best effort: name the holder for the error message above.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd, (stat.st_dev, stat.st_ino)

    def ensure_held(self, fsync: bool) -> bool:
        """Check that ``root/.lock`` is still the file we lock; True when it had to be retaken.

        When the lock file is gone (the directory was removed), recreate the directory and lock
        a new file. If another tier holds that one, raise `L2DirectoryInUseError`, now and on
        every later call: the directory is theirs.
        """
        with self._mutex:
            if self.lost:
                raise L2DirectoryInUseError(
                    f"L2 directory {self.path.parent} was removed and is now another tier's"
                )
            if self._fd is None:
                raise EngineStateError(f"L2 directory {self.path.parent}: the tier is closed")
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                pass
            else:
                if (stat.st_dev, stat.st_ino) == self._identity:
                    return False
            root = self.path.parent
            if not root.is_dir():
                root.mkdir(parents=True, exist_ok=True)
                if fsync:
                    self._file_ops.fsync_directory(root.parent)
            try:
                fd, identity = self._lock_new_file()
            except L2DirectoryInUseError:
                self.lost = True
                raise
            os.close(self._fd)  # the old file is unlinked; its lock protects nothing now
            self._fd, self._identity = fd, identity
            logger.warning("L2: %s was removed; recreated it and locked it again", root)
            return True

    def release(self) -> None:
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock
