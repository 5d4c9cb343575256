"""bench/l2_write.py on CPU, small: every durability stores the whole prompt into L2 and the
table has a row per path, each ratio against its own ceiling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_l2_write_bench_runs_every_durability(tmp_path: Path) -> None:
    command = [sys.executable, "bench/l2_write.py", "--tokens", "512", "--l1-size", "32MiB"]
    done = subprocess.run(
        [*command, "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("  ")[0].strip(): line.split() for line in done.stdout.splitlines()}
    for path in ("engine, none", "engine, batched", "engine, per_write"):
        assert path in rows, done.stdout
        assert float(rows[path][-1]) > 0  # seconds over its ceiling's
    # Each durability wrote every byte of the prompt (64 MiB: 512 tokens x 128 KiB).
    assert done.stderr.count(f"{512 * 128 * 1024} bytes") == 3, done.stderr
    assert list(tmp_path.iterdir()) == []  # its files are gone
