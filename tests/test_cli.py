"""`tiered-kv demo` and `tiered-kv inspect` as a user runs them: subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_demo_verifies_hits_from_l1_and_l2_and_after_restart(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    result = _run("demo", "--users", "3", "--turns", "3", "--l2-dir", str(l2), "--cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "mismatches -> OK" in out
    assert " 0 mismatches" in out
    hits = {
        line.split()[0]: [int(x) for x in line.split()[1:]]
        for line in out.splitlines()
        if line.strip().startswith(("L1 ", "L2 ")) and line.split()[1].isdigit()
    }
    assert hits["L1"][0] > 0
    assert hits["L2"][0] > 0, "the small L1 should force some hits from disk"
    assert hits["L2"][1] > 0, "after the restart, hits come from the L2 directory"
    assert "demo:" in result.stderr  # progress

    listing = _run("inspect", str(l2))
    assert listing.returncode == 0, listing.stderr
    assert "demo-model" in listing.stdout
    assert "0 corrupt or foreign files" in listing.stdout


def test_inspect_reports_corrupt_files_and_missing_directory(tmp_path: Path) -> None:
    shard = tmp_path / "ab"
    shard.mkdir()
    (shard / ("ab" + "0" * 30)).write_bytes(b"not a chunk")
    listing = _run("inspect", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert "CORRUPT" in listing.stdout
    assert "1 corrupt or foreign files" in listing.stdout
    missing = _run("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "not a directory" in missing.stderr
