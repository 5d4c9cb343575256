"""Reading an L2 directory's headers: `scan_directory` (for ``tiered-kv inspect``) and the index
rebuilt at start-up (`rebuild_index`, which removes torn, corrupt and temp files).

Blocking: runs on an I/O thread at `open`, or in the CLI. `Entry` is what the index keeps per
chunk. Must not take the directory lock (`scan_directory` is safe beside a running tier).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tiered_kv.codec import DEFAULT_LIMITS, ChunkHeader, CodecLimits, GroupSpec
from tiered_kv.errors import CodecError
from tiered_kv.keys import ChunkKey
from tiered_kv.tiers.l2.files import is_shard_name, is_temp_name, read_header, unlink_quietly

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ScannedFile:
    """One file found under an L2 directory, as `scan_directory` read it."""

    path: Path
    size: int
    key: ChunkKey | None
    num_tokens: int | None
    groups: tuple[GroupSpec, ...]
    error: str | None
    mtime_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """What a read checks before touching the file; the file's own header is checked again."""

    path: Path
    size: int
    num_tokens: int
    groups: tuple[GroupSpec, ...]

    @property
    def payload_len(self) -> int:
        return sum(group.nbytes for group in self.groups)


def inspect_file(path: Path, limits: CodecLimits) -> tuple[ScannedFile, bool] | None:
    """Read one file's header. Returns (result, removable) or None when the file vanished.

    ``removable`` is True when the file is certainly not a valid chunk (torn, corrupt, misnamed,
    a leftover temp file); False when it is valid or could not be read (then it is left alone).
    """
    try:
        stat = path.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ScannedFile(path, 0, None, None, (), f"unreadable: {exc}", 0), False

    def result(
        error: str | None, key: ChunkKey | None = None, header: ChunkHeader | None = None
    ) -> ScannedFile:
        num_tokens = None if header is None else header.num_tokens
        groups = () if header is None else header.groups
        return ScannedFile(path, stat.st_size, key, num_tokens, groups, error, stat.st_mtime_ns)

    if is_temp_name(path.name):
        return result("temporary file of an unfinished write"), True
    try:
        with open(path, "rb", buffering=0) as file:
            header = read_header(file, limits)
    except FileNotFoundError:
        return None
    except CodecError as exc:
        return result(f"bad header: {exc}"), True
    except OSError as exc:
        return result(f"unreadable: {exc}"), False
    try:
        key = ChunkKey.from_bytes(header.key_bytes)
    except CodecError as exc:
        return result(f"bad key in header: {exc}", None, header), True
    if stat.st_size != header.total_len:
        error = f"file is {stat.st_size} bytes, header says {header.total_len}"
        return result(error, key, header), True
    if path.name != key.hex or path.parent.name != key.hex[:2]:
        error = f"misnamed: the header's key belongs at {key.hex[:2]}/{key.hex}"
        return result(error, key, header), True
    return result(None, key, header), False


def iter_files(root: Path, limits: CodecLimits) -> Iterator[tuple[ScannedFile, bool]]:
    """Every regular file in ``root``'s shard directories, with its removability."""
    with os.scandir(root) as top:
        shards = sorted(
            entry.name
            for entry in top
            if is_shard_name(entry.name) and entry.is_dir(follow_symlinks=False)
        )
    for shard in shards:
        try:
            with os.scandir(root / shard) as listing:
                names = sorted(
                    entry.name for entry in listing if entry.is_file(follow_symlinks=False)
                )
        except FileNotFoundError:
            continue
        for name in names:
            found = inspect_file(root / shard / name, limits)
            if found is not None:
                yield found


def scan_directory(
    root: str | os.PathLike[str], limits: CodecLimits = DEFAULT_LIMITS
) -> list[ScannedFile]:
    """Read the header of every file under an L2 directory (for ``tiered-kv inspect``).

    Takes no lock and removes nothing, so it is safe next to a running tier (files may vanish
    or appear meanwhile). Only shard directories (two hex digits) are looked at.
    """
    return [scanned for scanned, _ in iter_files(Path(root), limits)]


@dataclasses.dataclass(slots=True)
class Rebuilt:
    entries: list[tuple[ChunkKey, Entry, int]]
    corrupt_removed: int
    temp_removed: int


def rebuild_index(root: Path, limits: CodecLimits) -> Rebuilt:
    rebuilt = Rebuilt([], 0, 0)
    for scanned, removable in iter_files(root, limits):
        if scanned.error is None and scanned.key is not None and scanned.num_tokens is not None:
            entry = Entry(scanned.path, scanned.size, scanned.num_tokens, scanned.groups)
            rebuilt.entries.append((scanned.key, entry, scanned.mtime_ns))
            continue
        if not removable:
            logger.warning("L2: skipping %s: %s", scanned.path, scanned.error)
            continue
        if is_temp_name(scanned.path.name):
            rebuilt.temp_removed += 1
        else:
            logger.warning("L2: removing %s: %s", scanned.path, scanned.error)
            rebuilt.corrupt_removed += 1
        unlink_quietly(scanned.path)
    rebuilt.entries.sort(key=lambda item: item[2])
    return rebuilt
