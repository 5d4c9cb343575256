"""The package's import graph: no cycles and no upward imports, lazy ones included.

Every ``import`` and ``from ... import`` in every module counts: at the top, inside functions
and under ``TYPE_CHECKING``. Layers go bottom up as in DESIGN.md's module table; a module may
import its own layer (without a cycle) or any below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiered_kv"

# Bottom up; a module's layer is that of the longest prefix listed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "snapshot", "threads", "cost"),
    ("eviction",),
    ("config", "keys", "codec"),
    ("layout",),
    ("request",),
    ("memory",),
    ("io",),  # the I/O plane: worker processes over the shared arena
    ("tiers", "gpu.base", "gpu.kernels", "gpu.completion"),
    ("gpu.plan", "gpu.events", "gpu.reference"),
    ("gpu.staging",),
    ("gpu.device",),
    ("gpu.calls", "gpu.dma"),
    ("gpu.launch",),
    ("gpu.layerwise",),
    ("gpu.mover",),
    ("gpu", "gpu.dispatch"),  # "gpu": the package's __init__ (DeviceMover, the reference)
    ("storage",),
    ("prefetch", "layerwise_store"),
    ("retrieval", "metrics"),
    ("runtime",),
    ("engine",),
    ("sync",),
    # The engine host's parts, below its facade (integrations.engine_host).
    ("integrations.host_stats", "integrations.tier_watch", "integrations.lookup_channel"),
    ("integrations.layer_groups",),
    ("integrations.host_lookups",),
    ("", "integrations", "benchmarks"),  # "": the package's __init__ (the public names)
    # The vLLM connector: what both halves share, the two halves, the class vLLM loads.
    ("integrations.vllm.config", "integrations.vllm.metadata", "integrations.vllm.stats"),
    ("integrations.vllm.scheduler", "integrations.vllm.worker"),
    ("integrations.vllm.connector",),
    ("integrations.vllm",),  # its __init__: `TieredKVConnector` for vLLM's loader
    ("cli",),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["tiered_kv", *filter(None, package.split("."))]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import name``: the submodule when the name is one, else pkg itself.
            # (A parent package is imported with any of its submodules: that edge is implied.)
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                targets.append(submodule if _relative(submodule) in modules else module)
        for target in targets:
            relative = _relative(target)
            if relative is not None and relative in modules:
                found.add(relative)
    found.discard(name)
    return found


def _relative(module: str) -> str | None:
    """``tiered_kv.a.b`` as ``a.b`` (the package itself as ""); None outside the package."""
    if module == "tiered_kv":
        return ""
    if module.startswith("tiered_kv."):
        return module.removeprefix("tiered_kv.")
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or (prefix and name.startswith(f"{prefix}."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"tiered_kv.{name} is in no layer of tests/test_imports.py"
    return best


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        _layer(name)


def test_no_module_imports_one_above_its_layer() -> None:
    upward = [
        f"tiered_kv.{a} (layer {_layer(a)}) imports tiered_kv.{b} (layer {_layer(b)})"
        for a, deps in sorted(_graph().items())
        for b in sorted(deps)
        if _layer(b) > _layer(a)
    ]
    assert upward == []


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == [], " ; ".join(" -> ".join(f"tiered_kv.{m}" for m in c) for c in cycles)


def test_the_vllm_connectors_halves_never_import_each_other() -> None:
    """The scheduler's and the workers' halves live in different processes: neither may reach
    the other's state, so neither imports the other."""
    graph = _graph()
    scheduler, worker = "integrations.vllm.scheduler", "integrations.vllm.worker"
    assert worker not in graph[scheduler] and scheduler not in graph[worker]
