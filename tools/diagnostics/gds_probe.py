"""Does GPUDirect Storage work on this machine, and how fast is it beside the threaded path?

    PYTHONPATH=. python3 tools/diagnostics/gds_probe.py [--dir D] [--files 32] [--file-mib 32]

Reports: whether `kvikio` imports; whether cuFile (`cuda.bindings.cufile`) opens its driver and
in which mode (compatibility mode reads through a host bounce buffer, not DMA from the drive);
the filesystem of ``--dir``; then, with the files' cached pages dropped before each pass,
cuFile reads straight into GPU memory by 1 and 8 threads against O_DIRECT reads into pinned
host memory plus a host-to-device copy (the threaded path), and each pass's bytes checked
against the files. A diagnostic: what it prints goes into the notes, no targets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiered_kv.benchmarks import ceilings

MIB = 1 << 20


def _drop(paths: list[Path]) -> None:
    for path in paths:
        ceilings.drop_cached_pages(path)


def _threads(jobs, threads: int) -> float:
    return ceilings._parallel(jobs, threads)


def _cufile_pass(cufile, paths, gpu: torch.Tensor, size: int, threads: int) -> float:
    def job(index: int, slot: int) -> None:
        torch.cuda.set_device(gpu.device)  # cuFile works in the thread's current context
        fd = os.open(paths[index], os.O_RDONLY | os.O_DIRECT)
        try:
            descr = cufile.Descr()
            descr.type = cufile.FileHandleType.OPAQUE_FD
            descr.handle.fd = fd
            descr.fs_ops = 0
            if descr.handle.fd != fd:
                raise RuntimeError(f"Descr kept fd {descr.handle.fd}, not {fd}")
            handle = cufile.handle_register(descr.ptr)
            if slot == 0 and index == 0:
                print(f"  registered fd {fd} as handle {handle:#x}", flush=True)
            try:
                got = cufile.read(handle, gpu.data_ptr(), size, 0, index * size)
                if got != size:
                    raise RuntimeError(f"cuFile read {got} of {size} bytes")
            finally:
                cufile.handle_deregister(handle)
        finally:
            os.close(fd)

    torch.cuda.synchronize()
    jobs = [(lambda slot, i=i: job(i, slot)) for i in range(len(paths))]
    return len(paths) * size / _threads(jobs, threads) / 1e9


def _posix_pass(
    paths, gpu: torch.Tensor, pinned: list[torch.Tensor], size: int, threads: int
) -> float:
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def job(index: int, slot: int) -> None:
        buffer = memoryview(pinned[slot].numpy())
        fd = os.open(paths[index], os.O_RDONLY | os.O_DIRECT)
        try:
            filled = 0
            while filled < size:
                got = os.preadv(fd, [buffer[filled:]], filled)
                if got <= 0:
                    raise RuntimeError("short read")
                filled += got
        finally:
            os.close(fd)
        with torch.cuda.stream(streams[slot]):
            gpu[index * size : (index + 1) * size].copy_(pinned[slot], non_blocking=True)
        streams[slot].synchronize()

    jobs = [(lambda slot, i=i: job(i, slot)) for i in range(len(paths))]
    return len(paths) * size / _threads(jobs, threads) / 1e9


def _can_register(cufile, path: Path) -> bool:
    """Try `handle_register` on ``path`` opened with and without O_DIRECT; print each outcome."""
    works = False
    for label, flags in (("O_DIRECT", os.O_DIRECT), ("buffered", 0)):
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            descr = cufile.Descr()
            descr.type = cufile.FileHandleType.OPAQUE_FD
            descr.handle.fd = fd
            descr.fs_ops = 0
            handle = cufile.handle_register(descr.ptr)
            cufile.handle_deregister(handle)
            print(f"  handle_register ({label} fd): ok", flush=True)
            works = True
        except Exception as exc:
            print(f"  handle_register ({label} fd): {type(exc).__name__}: {exc}", flush=True)
        finally:
            os.close(fd)
    return works


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--file-mib", type=int, default=32)
    args = parser.parse_args()
    try:
        import kvikio

        print(f"kvikio {kvikio.__version__} imports", flush=True)
    except ImportError as exc:
        print(f"kvikio: not importable ({exc})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-gds-", dir=args.dir))
    fs = subprocess.run(
        ["findmnt", "-no", "FSTYPE,SOURCE", "-T", str(workdir)], capture_output=True, text=True
    ).stdout.strip()
    print(f"directory {workdir}: filesystem {fs or '?'}", flush=True)
    size = args.file_mib * MIB
    paths = []
    expected = []
    for i in range(args.files):
        data = os.urandom(size)
        path = workdir / f"{i:03d}"
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
        expected.append(torch.frombuffer(bytearray(data[:4096]), dtype=torch.uint8))
    gpu = torch.empty(args.files * size, dtype=torch.uint8, device="cuda")
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(8)]

    def check(label: str) -> None:
        torch.cuda.synchronize()
        for i in range(args.files):
            got = gpu[i * size : i * size + 4096].cpu()
            if not torch.equal(got, expected[i]):
                raise RuntimeError(f"{label}: file {i}'s bytes differ on the GPU")

    for threads in (1, 8):
        gpu.zero_()
        _drop(paths)
        gbps = _posix_pass(paths, gpu, pinned, size, threads)
        check("posix")
        print(
            f"O_DIRECT pread -> pinned -> H2D, {threads} threads, cold: {gbps:.2f} GB/s", flush=True
        )

    try:
        from cuda.bindings import cufile
    except ImportError as exc:
        print(f"cuda.bindings.cufile: not importable ({exc})", flush=True)
        return 0
    try:
        cufile.driver_open()
    except Exception as exc:
        print(f"cuFile driver_open failed: {type(exc).__name__}: {exc}", flush=True)
        return 0
    try:
        print(f"cuFile version {cufile.get_version()}", flush=True)
        for name in dir(cufile.BoolConfigParameter):
            if not name.isupper():
                continue
            try:
                value = cufile.get_parameter_bool(getattr(cufile.BoolConfigParameter, name))
                print(f"  {name} = {value}", flush=True)
            except Exception as exc:
                print(f"  {name}: {exc}", flush=True)
        if not _can_register(cufile, paths[0]):
            print("retrying with FORCE_COMPAT_MODE set before the driver opens", flush=True)
            cufile.driver_close()
            cufile.set_parameter_bool(cufile.BoolConfigParameter.FORCE_COMPAT_MODE, True)
            cufile.driver_open()
            _can_register(cufile, paths[0])
        log = Path("cufile.log")
        if log.exists():
            print("cufile.log (last lines):\n" + "\n".join(log.read_text().splitlines()[-15:]))
        try:
            cufile.buf_register(gpu.data_ptr(), gpu.numel(), 0)
            registered = True
        except Exception as exc:
            print(f"cuFile buf_register failed: {exc}", flush=True)
            registered = False
        for threads in (1, 8):
            gpu.zero_()
            _drop(paths)
            started = time.perf_counter()
            try:
                gbps = _cufile_pass(cufile, paths, gpu, size, threads)
            except Exception as exc:
                print(
                    f"cuFile read failed after {time.perf_counter() - started:.2f} s: "
                    f"{type(exc).__name__}: {exc}",
                    flush=True,
                )
                break
            check("cufile")
            print(
                f"cuFile read -> GPU, {threads} threads, cold: {gbps:.2f} GB/s (bytes checked)",
                flush=True,
            )
        if registered:
            cufile.buf_deregister(gpu.data_ptr())
    finally:
        cufile.driver_close()
    for path in paths:
        path.unlink()
    workdir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
