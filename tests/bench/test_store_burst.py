"""bench/store_burst.py on CPU, small: every chunk of every prompt reaches L2 (the stores wait
for the writes rather than dropping them), the table has its rows, and its files are gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("plane", ["processes", "threads"])
def test_small_chunks_stored_back_to_back_all_reach_l2(tmp_path: Path, plane: str) -> None:
    command = [sys.executable, "bench/store_burst.py", "--prompts", "40", "--chunks", "6"]
    done = subprocess.run(
        [*command, "--l1-size", "1MiB", "--io-plane", plane, "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines()}
    assert rows["raw whole-file writes"][0] == "240"
    assert rows["engine stores (L1)"][0] == "240"  # a 1 MiB L1 (64 chunks): streamed through
    assert rows["engine L2 writes done"][0] == "240"
    assert "L2 writes dropped: 0 of 240 (0.00%)" in done.stdout
    assert list(tmp_path.iterdir()) == []
