"""NVRTC compilation and the cubin cache (CPU: NVRTC needs no GPU); the mover's planning is in
test_gpu_planning.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tiered_kv.errors import KernelCompileError
from tiered_kv.gpu import kernels
from tiered_kv.gpu.events import INLINE_IDS
from tiered_kv.gpu.plan import MAX_JOBS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cubins() -> dict[str, bytes]:
    source = kernels.kernel_source()
    return {
        arch: kernels.compile_cubin(source, kernels.CompileOptions(arch))
        for arch in kernels.CI_ARCHS
    }


@pytest.mark.parametrize("arch", kernels.CI_ARCHS)
def test_every_instantiation_compiles_for_ci_archs(cubins: dict[str, bytes], arch: str) -> None:
    cubin = cubins[arch]
    assert cubin[:4] == b"\x7fELF"
    for name in kernels.KERNEL_NAMES:
        assert name.encode() + b"\x00" in cubin, f"{name} missing from the {arch} cubin"


def test_kernel_names_match_the_source_instantiations() -> None:
    source = kernels.kernel_source()
    widths = {int(w) for w in re.findall(r"^TKV_INSTANTIATE\((\d+),", source, re.M)}
    assert widths == set(kernels.COPY_WIDTHS)
    assert f"#define TKV_MAX_JOBS {MAX_JOBS}" in source
    assert f"#define TKV_INLINE_IDS {INLINE_IDS}" in source


def test_compile_error_carries_the_nvrtc_log() -> None:
    bad = 'extern "C" __global__ void broken() { this_is_not_declared = 1; }'
    with pytest.raises(KernelCompileError) as info:
        kernels.compile_cubin(bad, kernels.CompileOptions("sm_90"), name="broken.cu")
    assert "this_is_not_declared" in info.value.log
    assert "broken.cu" in info.value.log
    assert "sm_90" in str(info.value)


def test_compile_options_validate() -> None:
    with pytest.raises(ValueError, match="sm_<NN>"):
        kernels.CompileOptions("compute_90")
    with pytest.raises(ValueError, match="c\\+\\+17"):
        kernels.CompileOptions("sm_90", std="c++03")


class _CountingCompile:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, source: str, options: kernels.CompileOptions) -> bytes:
        self.calls += 1
        return b"\x7fELF-fake-cubin-" + options.arch.encode() + source[:16].encode()


def test_cache_miss_then_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compile_ = _CountingCompile()
    monkeypatch.setattr(kernels, "compile_cubin", compile_)
    cache = kernels.KernelCache(tmp_path / "k")
    options = kernels.CompileOptions("sm_90")
    first = cache.get_or_compile("source-a", options)
    assert compile_.calls == 1 and cache.misses == 1
    again = kernels.KernelCache(tmp_path / "k").get_or_compile("source-a", options)
    assert again == first and compile_.calls == 1  # a new process reads the entry
    assert [p.suffix for p in (tmp_path / "k").iterdir()] == [".cubin"]  # no temp files left


def test_cache_key_covers_source_options_arch_and_nvrtc_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_ = _CountingCompile()
    monkeypatch.setattr(kernels, "compile_cubin", compile_)
    cache = kernels.KernelCache(tmp_path)
    cache.get_or_compile("src", kernels.CompileOptions("sm_90"))
    cache.get_or_compile("src", kernels.CompileOptions("sm_80"))
    cache.get_or_compile("src2", kernels.CompileOptions("sm_90"))
    cache.get_or_compile("src", kernels.CompileOptions("sm_90", extra=()))
    assert compile_.calls == 4
    cache.get_or_compile("src", kernels.CompileOptions("sm_90"))
    assert compile_.calls == 4
    major, minor = kernels.nvrtc_version()
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: (major, minor + 1))
    cache.get_or_compile("src", kernels.CompileOptions("sm_90"))
    assert compile_.calls == 5  # a new NVRTC never reuses an old cubin


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "schema"])
def test_corrupt_entry_is_removed_and_recompiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    compile_ = _CountingCompile()
    monkeypatch.setattr(kernels, "compile_cubin", compile_)
    cache = kernels.KernelCache(tmp_path)
    options = kernels.CompileOptions("sm_90")
    good = cache.get_or_compile("src", options)
    (entry,) = tmp_path.iterdir()
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[-1] ^= 0x40
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "empty":
        data = bytearray()
    else:
        data[8] ^= 0xFF  # schema field
    entry.write_bytes(bytes(data))
    assert cache.get_or_compile("src", options) == good
    assert compile_.calls == 2 and cache.corrupt == 1
    assert kernels.KernelCache(tmp_path).get_or_compile("src", options) == good
    assert compile_.calls == 2  # the rewritten entry is whole again


def test_unwritable_cache_dir_still_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_ = _CountingCompile()
    monkeypatch.setattr(kernels, "compile_cubin", compile_)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    cache = kernels.KernelCache(blocker / "kernels")
    assert cache.get_or_compile("src", kernels.CompileOptions("sm_90")).startswith(b"\x7fELF")


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERED_KV_KERNEL_CACHE", str(tmp_path / "kc"))
    assert kernels.default_cache_dir() == tmp_path / "kc"
    monkeypatch.delenv("TIERED_KV_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.default_cache_dir() == tmp_path / "xdg" / "tiered_kv" / "kernels"


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "tiered_kv").rglob("__init__.py")
    }
    assert found | {"tiered_kv.cuda_src"} == listed
    assert (ROOT / "cuda_src" / kernels.SOURCE_NAME).read_text() == kernels.kernel_source()
