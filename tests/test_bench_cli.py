"""`tiered-kv bench` as a user runs it (subprocesses), and the progress display it shares with the
demo. Figures are not asserted (no timed assertions in tests): the table's shape, the files
written and the errors are."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import run_cli
from tiered_kv.benchmarks.progress import Progress

REPO = Path(__file__).resolve().parents[1]
# Small enough for seconds (4 users x 3 turns, two lead times), with an L1 of four chunks so
# that some hits come from L2.
SMALL_WORKLOAD = (
    "--users", "4", "--turns", "3", "--lead-ms", "0", "5", "--system-tokens", "256",
    "--user-tokens", "256", "512", "--reply-tokens", "32", "64", "--l1-size", "1MiB",
    "--l2-read-delay-ms", "1",
)  # fmt: skip


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; raises if the file is not a PNG."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise AssertionError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def table_rows(stdout: str) -> list[list[str]]:
    """The markdown table printed last: its rows as cells (header and rule excluded)."""
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| prefetch |"))
    assert lines[start + 1].startswith("|---"), lines[start : start + 2]
    body = lines[start + 2 :]
    assert body and all(line.startswith("| ") for line in body), body
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body]


@pytest.mark.slow
def test_bench_workload_prints_the_table_last_and_writes_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    figures = tmp_path / "figures.json"
    result = run_cli(
        "bench", "workload", *SMALL_WORKLOAD, "--out", str(out), "--json", str(figures)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    # Prefetch off and on at each lead time, in that order; L1 and L2 both served chunks.
    assert [(row[0], row[1]) for row in rows] == [
        ("off", "0"),
        ("on", "0"),
        ("off", "5"),
        ("on", "5"),
    ]
    assert all(row[4].endswith("%") and float(row[4][:-1]) > 0 for row in rows)  # hit rate
    assert all(int(row[5]) > 0 for row in rows)  # L1 chunks
    assert sum(int(row[6]) for row in rows) > 0  # L2 chunks
    assert "ceiling (this run): host memcpy" in result.stdout
    width, height = png_size(out / "workload_ttft.png")
    assert width > 300 and height > 200
    assert f"plot: {out / 'workload_ttft.png'}" in result.stdout
    written = (out / "workload.md").read_text()
    assert "| prefetch | lead ms |" in written and "(workload_ttft.png)" in written
    data = json.loads(figures.read_text())
    assert data["ceilings"]["memcpy_gbps"] > 0
    assert [(r["prefetch"], r["lead_ms"]) for r in data["rows"]] == [
        (False, 0),
        (True, 0),
        (False, 5),
        (True, 5),
    ]
    # Not a terminal: one plain progress line per step (the ceiling, then each scenario).
    progress = [line for line in result.stderr.splitlines() if line.startswith("workload: ")]
    assert progress[0] == "workload: 1/5 ceiling measured"
    assert progress[-1] == "workload: 5/5 prefetch on, lead 5 ms done"


def _without_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import matplotlib` fails (fault injection: a shadowing package)."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    return {**os.environ, "PYTHONPATH": str(shadow.parent)}


@pytest.mark.slow
def test_bench_without_matplotlib_names_the_extra_before_running(tmp_path: Path) -> None:
    env = _without_matplotlib(tmp_path)
    out = tmp_path / "out"
    refused = run_cli("bench", "workload", *SMALL_WORKLOAD, "--out", str(out), env=env)
    assert refused.returncode == 2
    assert "pip install 'tiered-kv[bench]'" in refused.stderr
    assert "--no-plot" in refused.stderr
    assert "workload: 1/" not in refused.stderr  # refused before measuring anything
    assert not out.exists()

    table_only = run_cli(
        "bench", "workload", *SMALL_WORKLOAD, "--out", str(out), "--no-plot", env=env
    )
    assert table_only.returncode == 0, table_only.stderr
    assert len(table_rows(table_only.stdout)) == 4
    assert not (out / "workload_ttft.png").exists()
    assert "workload_ttft.png" not in (out / "workload.md").read_text()


@pytest.mark.slow
def test_bench_transfer_without_cuda_says_so_and_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, also on a GPU machine
    result = run_cli("bench", "transfer", "--quick", "--out", str(tmp_path), env=env)
    assert result.returncode == 2
    assert "tiered-kv bench transfer: needs a CUDA device" in result.stderr
    assert "tiered-kv bench workload" in result.stderr  # where to go instead
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_prefetch_measures_each_lower_tier_against_its_own_ceiling(tmp_path: Path) -> None:
    result = run_cli(
        "bench", "prefetch", "--chunks", "4", "--chunk-mib", "1", "--reps", "1",
        "--dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.rstrip().splitlines()
    rows = {line[:34].strip(): line[34:].split() for line in lines[-3:]}
    assert set(rows) == {
        "L2 warm (page cache)",
        "L2 cold (fadvise-dropped)",
        "L3 (tiered-kv serve, loopback)",
    }
    for path, cells in rows.items():
        ours = float(cells[0])
        assert ours > 0, path
        if cells[1] != "-":
            # Printed to two decimals: the ratio of the rounded figures is near, not equal.
            assert float(cells[1]) > 0 and float(cells[2]) == pytest.approx(
                ours / float(cells[1]), rel=0.05, abs=0.02
            )
    assert "page cache -> memory, readinto: 1 threads" in result.stderr
    assert "loopback TCP, a process per end: 1 streams" in result.stderr
    assert list(tmp_path.iterdir()) == [], "the benchmark's files are removed"


@pytest.mark.slow
def test_bench_names_and_options_are_checked() -> None:
    unknown = run_cli("bench", "nope")
    assert unknown.returncode == 2 and "invalid choice: 'nope'" in unknown.stderr
    bad = run_cli("bench", "workload", "--lead-ms", "soon")
    assert bad.returncode == 2 and "--lead-ms" in bad.stderr
    helped = run_cli("bench", "remote", "--help")
    assert helped.returncode == 0 and "usage: tiered-kv bench remote" in helped.stdout


@pytest.mark.slow
def test_bench_scripts_in_a_clone_run_the_packaged_benchmarks() -> None:
    for name in ("workload", "transfer", "remote", "prefetch", "trace"):
        result = subprocess.run(
            [sys.executable, str(REPO / "bench" / f"{name}.py"), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert f"usage: bench/{name}.py" in result.stdout
        assert "--no-plot" in result.stdout


def _drain(fd: int) -> bytes:
    """Everything written to a pty's other side so far: the kernel hands it over
    asynchronously, so one read may return only its start."""
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def test_progress_draws_on_a_terminal_that_reports_no_size() -> None:
    # A pty whose size was never set reports 0 x 0 (as under `script` or `docker exec -t`);
    # tqdm alone would draw nothing there.
    main_fd, side_fd = pty.openpty()
    try:
        with open(side_fd, "w", closefd=False) as terminal:
            assert os.get_terminal_size(side_fd) == os.terminal_size((0, 0))
            bar = Progress(4, "bench", stream=terminal)
            for step in range(4):
                bar.advance(f"step {step}")
        shown = _drain(main_fd).decode()
    finally:
        os.close(main_fd)
        os.close(side_fd)
    assert "100%" in shown and "4/4" in shown and "step 3" in shown


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_detail_lines_print_above_the_bar(tmp_path: Path) -> None:
    terminal = _Terminal()
    bar = Progress(2, "bench", stream=terminal)
    bar.advance("one")
    bar.write("a detail line")
    bar.advance("two")
    text = terminal.getvalue()
    # The bar's line is cleared, the detail line printed whole, and the bar drawn again after.
    assert "\ra detail line\n" in text
    assert "2/2" in text[text.index("a detail line") :]
    plain = Progress(2, "bench", stream=open(tmp_path / "log", "w"))  # noqa: SIM115
    plain.write("a detail line")
    plain.advance()
    plain.stream.close()
    assert (tmp_path / "log").read_text() == "a detail line\nbench: 1/2\n"


def test_transfer_plot_draws_every_measured_row_without_a_gpu(tmp_path: Path) -> None:
    # The plotting half of `bench transfer` needs no device: rows as bench_case returns them
    # (a row with an error and a baseline with only some figures among them).
    from tiered_kv.benchmarks import transfer
    from tiered_kv.benchmarks.common import load_pyplot

    ceilings = {"d2h": 55.0, "h2d": 55.0, "both": 100.0, "d2d": 4000.0}
    rows = [
        {
            "case": "llama_nhd",
            "path": "staging",
            "store_32": 54.0,
            "retrieve_32": 53.0,
            "both": 97.0,
        },
        {"case": "llama_nhd", "path": "mapped", "error": "CUDA_ERROR_OUT_OF_MEMORY"},
        {"case": "llama_nhd", "path": "naive torch", "store_32": 16.0},
    ]
    png = tmp_path / "plots" / "transfer.png"
    transfer.plot(load_pyplot(), ceilings, rows, 32, png)
    width, height = png_size(png)
    assert width > 300 and height > 200
