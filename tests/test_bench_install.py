"""`tiered-kv bench workload` from a plain install of the built wheel, not from the clone: the
benchmarks, their defaults and the CLI entry point ship in the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.test_bench_cli import SMALL_WORKLOAD, png_size, table_rows

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_bench_workload_runs_from_a_wheel_installed_outside_the_clone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # Build the wheel from a copy of what the sdist holds, so the clone gets no build/ or
    # egg-info and nothing else in it can leak in.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("tiered_kv", "cuda_src"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(source)],
        tmp_path,
        env,
    )  # fmt: skip
    (wheel,) = wheels.glob("tiered_kv-*.whl")

    # A fresh venv; its dependencies (torch, matplotlib, ...) come from the test's own
    # environment through a .pth line placed after its own site-packages, so the wheel's
    # tiered_kv is the one found (the clone's editable hook in that environment is not run).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            tmp_path,
            env,
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(wheel)],
        tmp_path,
        env,
    )  # fmt: skip

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(
        [str(python), "-c", "import tiered_kv.benchmarks.workload as m; print(m.__file__)"],
        elsewhere,
        env,
    ).stdout.strip()
    assert Path(where).is_relative_to(site), where

    result = _run(
        [str(venv / "bin" / "tiered-kv"), "bench", "workload", *SMALL_WORKLOAD], elsewhere, env
    )
    assert len(table_rows(result.stdout)) == 4
    # The default output directory is relative to where the command runs.
    width, _ = png_size(elsewhere / "tiered-kv-bench" / "workload_ttft.png")
    assert width > 300
    assert (elsewhere / "tiered-kv-bench" / "workload.md").is_file()
