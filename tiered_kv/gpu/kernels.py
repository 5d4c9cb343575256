"""NVRTC compilation of `cuda_src/` kernels, the on-disk cubin cache, and per-device loading.

Owns: reading kernel sources (package data ``tiered_kv.cuda_src``), compiling them with NVRTC
through cuda-python for one architecture, a cubin cache keyed by (source hash, options, arch,
NVRTC version, schema) with atomic writes and verified reads, and loading the module once per
device into the device's primary context (the one torch uses). Compile failures raise
`KernelCompileError` with the NVRTC log. Never launches anything itself (`launch.py` does).

Compiling needs only the NVRTC library, not a GPU: CI compiles every kernel for sm_80 and sm_90.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import os
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import xxhash

from tiered_kv.errors import KernelCompileError, TieredKVError

SOURCE_NAME = "tkv_copy.cu"
COPY_WIDTHS = (16, 8, 4, 2, 1)
KERNEL_NAMES = tuple(
    f"tkv_{direction}_w{width}" for direction in ("gather", "scatter") for width in COPY_WIDTHS
)
SCHEMA_VERSION = 1  # bump when the cache entry format or the key's meaning changes
_ENTRY_MAGIC = b"TKVCUBIN"
_ENTRY_HEADER = struct.Struct("<8sIQQ")  # magic, schema, payload length, xxh3-64 of payload
CI_ARCHS = ("sm_80", "sm_90")


def kernel_source(name: str = SOURCE_NAME) -> str:
    """The text of ``cuda_src/<name>``: package data in an installed wheel, else the source
    tree's top-level ``cuda_src/`` (editable installs and ``PYTHONPATH=.`` runs)."""
    try:
        resource = importlib.resources.files("tiered_kv.cuda_src") / name
        return resource.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        tree = Path(__file__).resolve().parents[2] / "cuda_src" / name
        if not tree.is_file():
            raise KernelCompileError(f"kernel source {name} not found (looked in {tree})") from None
        return tree.read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True, slots=True)
class CompileOptions:
    """What, besides the source, determines the cubin. ``arch`` is ``sm_<major><minor>``."""

    arch: str
    std: str = "c++17"
    extra: tuple[str, ...] = ("--use_fast_math", "-default-device")

    def __post_init__(self) -> None:
        digits = self.arch.removeprefix("sm_")
        if not self.arch.startswith("sm_") or not digits[:2].isdigit():
            raise ValueError(
                f"CompileOptions.arch: expected 'sm_<NN>' like 'sm_90', got {self.arch!r}"
            )
        if self.std not in ("c++17", "c++20"):
            raise ValueError(f"CompileOptions.std: expected 'c++17' or 'c++20', got {self.std!r}")

    def nvrtc_args(self) -> list[bytes]:
        return [f"--gpu-architecture={self.arch}".encode(), f"--std={self.std}".encode()] + [
            opt.encode() for opt in self.extra
        ]


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - a dependency; broken installs only
        raise KernelCompileError(f"cuda-bindings NVRTC is not importable: {exc}", log="") from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return int(major), int(minor)


def _check_nvrtc(err: Any, what: str, log: str = "") -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelCompileError(f"{what} failed: {err}", log=log)


def compile_cubin(source: str, options: CompileOptions, *, name: str = SOURCE_NAME) -> bytes:
    """Compile ``source`` to a cubin for ``options.arch``; `KernelCompileError` carries the log."""
    nvrtc = _nvrtc()
    err, program = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        args = options.nvrtc_args()
        (status,) = nvrtc.nvrtcCompileProgram(program, len(args), args)
        log = _program_log(nvrtc, program)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(
                f"NVRTC could not compile {name} for {options.arch}: {status}", log=log
            )
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check_nvrtc(err, "nvrtcGetCUBINSize", log)
        cubin = b" " * int(size)
        (err,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN", log)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _program_log(nvrtc: Any, program: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(program)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * int(size)
    nvrtc.nvrtcGetProgramLog(program, buf)
    return buf.rstrip(b"\x00 ").decode(errors="replace")


def default_cache_dir() -> Path:
    env = os.environ.get("TIERED_KV_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiered_kv" / "kernels"


class KernelCache:
    """Cubins on disk, one file per key. Reads verify magic, schema, length and checksum; a bad
    entry is deleted and reported as a miss. Writes go to a temp file, are fsynced, then renamed,
    so concurrent processes see a whole entry or none (get-or-miss, never check-then-read)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.hits = 0
        self.misses = 0
        self.corrupt = 0

    @staticmethod
    def key(source: str, options: CompileOptions, version: tuple[int, int]) -> str:
        text = "\x00".join(
            [
                f"schema={SCHEMA_VERSION}",
                f"source={hashlib.sha256(source.encode()).hexdigest()}",
                f"arch={options.arch}",
                f"std={options.std}",
                "extra=" + " ".join(options.extra),
                f"nvrtc={version[0]}.{version[1]}",
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.cubin"

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:  # absent, or an unusable cache directory: compile instead
            self.misses += 1
            return None
        payload = _unpack_entry(data)
        if payload is None:
            self.corrupt += 1
            self.misses += 1
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        self.hits += 1
        return payload

    def put(self, key: str, cubin: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        entry = _ENTRY_HEADER.pack(
            _ENTRY_MAGIC, SCHEMA_VERSION, len(cubin), xxhash.xxh3_64_intdigest(cubin)
        )
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(entry)
                f.write(cubin)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get_or_compile(self, source: str, options: CompileOptions) -> bytes:
        """The cubin for ``source`` and ``options``, compiled and stored on a miss. A cache
        directory that cannot be written only costs the next process a compile."""
        key = self.key(source, options, nvrtc_version())
        cubin = self.get(key)
        if cubin is not None:
            return cubin
        cubin = compile_cubin(source, options)
        with contextlib.suppress(OSError):  # read-only or full cache dir: only slower next time
            self.put(key, cubin)
        return cubin


def _unpack_entry(data: bytes) -> bytes | None:
    if len(data) < _ENTRY_HEADER.size:
        return None
    magic, schema, length, checksum = _ENTRY_HEADER.unpack_from(data)
    payload = data[_ENTRY_HEADER.size :]
    if magic != _ENTRY_MAGIC or schema != SCHEMA_VERSION or length != len(payload):
        return None
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload


# -- loading on a device -------------------------------------------------------------------------
_DRIVER: Any = None  # cuda.bindings.driver, imported on first use (importing us needs no CUDA)
_SUCCESS: Any = None


def cuda_driver() -> Any:
    """``cuda.bindings.driver``, imported once (hot paths call this instead of importing)."""
    global _DRIVER, _SUCCESS
    if _DRIVER is None:
        from cuda.bindings import driver

        _SUCCESS = driver.CUresult.CUDA_SUCCESS
        _DRIVER = driver
    return _DRIVER


def check_driver(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings driver call's ``(err, *values)``; raise `TieredKVError` on error."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err is not _SUCCESS:  # enum members are singletons: the common case costs no comparison
        driver = cuda_driver()
        if err != _SUCCESS:
            _, name = driver.cuGetErrorName(err)
            raise TieredKVError(f"{what} failed: {name.decode() if name else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DeviceKernels:
    """The loaded module of one device: kernel handles by name, and the primary context."""

    device_index: int
    arch: str
    context: Any
    module: Any
    functions: Mapping[str, Any]
    _by_key: dict[tuple[bool, int], Any] = dataclasses.field(default_factory=dict, init=False)

    def make_current(self) -> None:
        """Make the device's primary context current on this thread (a no-op when it is)."""
        driver = cuda_driver()
        current = check_driver(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or int(current) != int(self.context):
            check_driver(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def function(self, direction: Literal["gather", "scatter"], width: int) -> Any:
        return self.functions[f"tkv_{direction}_w{width}"]

    def copy_function(self, to_host: bool, width: int) -> Any:
        """The gather (``to_host``) or scatter kernel of ``width`` (a tuple lookup per launch)."""
        by_key = self._by_key
        if not by_key:
            for w in COPY_WIDTHS:
                by_key[True, w] = self.function("gather", w)
                by_key[False, w] = self.function("scatter", w)
        return by_key[to_host, width]


_loaded: dict[int, DeviceKernels] = {}
_users: dict[int, int] = {}  # device → movers holding its module (load_kernels / release_kernels)
_load_lock = threading.Lock()


def device_arch(device_index: int) -> str:
    driver = cuda_driver()
    check_driver(driver.cuInit(0), "cuInit")
    dev = check_driver(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = check_driver(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "arch"
    )
    minor = check_driver(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "arch"
    )
    return f"sm_{major}{minor}"


def load_kernels(device_index: int, cache: KernelCache | None = None) -> DeviceKernels:
    """Compile (or fetch from the cache) and load the copy kernels on a device, once per process
    while anyone uses them; each call must be paired with `release_kernels`."""
    with _load_lock:
        loaded = _loaded.get(device_index)
        if loaded is not None:
            _users[device_index] += 1
            return loaded
        driver = cuda_driver()
        arch = device_arch(device_index)
        cubin = (cache or KernelCache()).get_or_compile(kernel_source(), CompileOptions(arch))
        dev = check_driver(driver.cuDeviceGet(device_index), "cuDeviceGet")
        context = check_driver(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check_driver(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        module = check_driver(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        functions = {
            name: check_driver(driver.cuModuleGetFunction(module, name.encode()), name)
            for name in KERNEL_NAMES
        }
        loaded = DeviceKernels(device_index, arch, context, module, functions)
        _loaded[device_index] = loaded
        _users[device_index] = 1
        return loaded


def kernel_users(device_index: int) -> int:
    """How many holders (`load_kernels` calls not yet released) keep the device's module
    loaded: 0 once the last released it (for leak checks)."""
    with _load_lock:
        return _users.get(device_index, 0)


def release_kernels(device_index: int) -> None:
    """The pair of `load_kernels`: the last user unloads the module and releases the primary
    context it retained (torch keeps its own reference to that context)."""
    with _load_lock:
        users = _users.get(device_index, 0) - 1
        if users > 0:
            _users[device_index] = users
            return
        loaded = _loaded.pop(device_index, None)
        _users.pop(device_index, None)
        if loaded is None:
            return
        driver = cuda_driver()
        loaded.make_current()
        check_driver(driver.cuModuleUnload(loaded.module), "cuModuleUnload")
        dev = check_driver(driver.cuDeviceGet(device_index), "cuDeviceGet")
        check_driver(driver.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
