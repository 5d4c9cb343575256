"""L2: chunks in files under a local directory (`DiskTier`), one module per concern.

`files` (names, the `FileOps` seam, blocking helpers) < `lock` (the directory's flock) <
`scan` (headers, the index rebuilt at start-up) < `chunk_io` (one chunk written or read on an
I/O thread) < `tier` (`DiskTier`: the index, LRU, the disk-full policy, the thread pools).
"""

from tiered_kv.tiers.l2.files import LOCK_NAME, FileOps
from tiered_kv.tiers.l2.scan import ScannedFile, scan_directory
from tiered_kv.tiers.l2.tier import DiskStats, DiskTier

__all__ = ["LOCK_NAME", "DiskStats", "DiskTier", "FileOps", "ScannedFile", "scan_directory"]
