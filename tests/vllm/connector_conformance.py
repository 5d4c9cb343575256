"""Checks a KV connector class against the `KVConnectorBase_V1` of the vLLM that imports here.

Run as ``python -m tests.vllm.connector_conformance [--expect-version V] CLASS...`` (CLASS as
``module:QualName``); prints one JSON object: the vLLM version and file it checked against, the
problems of each class (an empty list: conforms), the `vllm` imports of tiered_kv's
integration modules that do not resolve, and what vLLM's factory-loaded `TieredKVConnector`
answers to ``supports_sleep_mode``. `tests/vllm/test_connector_conformance.py` runs it in
a subprocess per vLLM version (0.33's tree first on ``sys.path``), so each check sees only that
version's real classes.

What a problem is, for each hook vLLM may call:
- an abstract method of the base (or of `SupportsHMA`, when the class is one) left abstract;
- a method we define over one of the base's whose parameters vLLM's calls do not fit: every
  parameter of the base's must be ours with the same name, kind and (when positional) position;
  a parameter we add must have a default; ``*args`` / ``**kwargs`` must be kept; and a
  classmethod, staticmethod or property must stay one;
- a public name we define that is neither a hook of this vLLM nor in ``OWN_API`` (a hook vLLM
  renamed or dropped would never be called again, silently).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import pathlib
import sys
from typing import Any

# Public names of `TieredKVConnector` that are ours, not vLLM hooks.
OWN_API = frozenset(
    {"settings", "options", "engine_config", "failures", "scheduler_half", "worker_half"}
    | {"engine_stats"}
)
# Hooks of a newer vLLM than some supported one: on the older vLLM they are ours, uncalled.
LATER_HOOKS = {"supports_sleep_mode": "0.33"}

_REPO = pathlib.Path(__file__).resolve().parents[2]
# The modules that import vLLM: the connector package and the KV events translation.
INTEGRATION_SOURCES = (
    *sorted((_REPO / "tiered_kv" / "integrations" / "vllm").glob("*.py")),
    _REPO / "tiered_kv" / "integrations" / "kv_events.py",
)


def _binding(cls: type, name: str) -> str:
    raw = inspect.getattr_static(cls, name)
    for kind in (classmethod, staticmethod, property):
        if isinstance(raw, kind):
            return kind.__name__
    return "method" if callable(raw) else type(raw).__name__


def _parameters(fn: Any) -> list[inspect.Parameter]:
    """The parameters vLLM passes (``self`` / ``cls`` dropped: bound via the class)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


def signature_problems(name: str, ours: Any, base: Any) -> list[str]:
    """Why vLLM's calls of the base's ``name`` would not fit ours (empty: they fit)."""
    problems: list[str] = []
    mine = _parameters(ours)
    theirs = _parameters(base)
    by_name = {p.name: p for p in mine}
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_kinds = {p.kind for p in mine if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    base_positional = [p for p in theirs if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for param in theirs:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if param.kind not in var_kinds:
                star = "*" if param.kind == param.VAR_POSITIONAL else "**"
                problems.append(f"{name}: drops the base's {star}{param.name}")
            continue
        own = by_name.get(param.name)
        if own is None:
            if param.kind == param.KEYWORD_ONLY and inspect.Parameter.VAR_KEYWORD in var_kinds:
                continue
            problems.append(f"{name}: has no parameter {param.name!r} (vLLM passes it)")
            continue
        if param.kind == param.POSITIONAL_OR_KEYWORD:
            if own.kind != own.POSITIONAL_OR_KEYWORD:
                problems.append(
                    f"{name}: {param.name!r} is {own.kind.description}, the base's is "
                    "positional or keyword"
                )
            elif positional.index(own) != base_positional.index(param):
                problems.append(
                    f"{name}: {param.name!r} is at position {positional.index(own)}, the "
                    f"base's at {base_positional.index(param)}"
                )
        elif param.kind == param.KEYWORD_ONLY and own.kind not in (
            own.KEYWORD_ONLY,
            own.POSITIONAL_OR_KEYWORD,
        ):
            problems.append(f"{name}: {param.name!r} is {own.kind.description}, not keyword")
        elif param.kind == param.POSITIONAL_ONLY and own.kind == own.KEYWORD_ONLY:
            problems.append(f"{name}: {param.name!r} is keyword-only, the base's positional")
        if param.default is not param.empty and own.default is own.empty:
            problems.append(f"{name}: {param.name!r} has no default, the base's has one")
    known = {p.name for p in theirs}
    for param in mine:
        if param.name in known or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            problems.append(f"{name}: adds {param.name!r} without a default (vLLM never passes it)")
    return problems


def class_problems(cls: type, vllm_version: str) -> list[str]:
    """Everything about ``cls`` that vLLM's use of a `KVConnectorBase_V1` would trip on."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    problems: list[str] = []
    if not issubclass(cls, KVConnectorBase_V1):
        return [f"{cls.__qualname__} is not a KVConnectorBase_V1 of this vLLM"]
    bases: list[type] = [KVConnectorBase_V1]
    if issubclass(cls, SupportsHMA):
        bases.append(SupportsHMA)
    for base in bases:
        for name in sorted(getattr(base, "__abstractmethods__", ())):
            if getattr(getattr(cls, name, None), "__isabstractmethod__", False):
                problems.append(f"{name}: abstract in {base.__name__}, not implemented")
    hooks = {name for base in bases for name in dir(base)}
    ours = [
        klass
        for klass in cls.__mro__
        if klass not in bases and klass.__module__.split(".")[0] not in ("vllm", "abc", "builtins")
    ]
    defined = {name for klass in ours for name in vars(klass)}
    for name in sorted(defined):
        if name.startswith("__") and name != "__init__":
            continue
        if name not in hooks:
            if name.startswith("_") or name in OWN_API:
                continue
            if name in LATER_HOOKS and _older(vllm_version, LATER_HOOKS[name]):
                continue
            problems.append(f"{name}: defined here but not a hook of vLLM {vllm_version}")
            continue
        base = next(b for b in bases if name in dir(b))
        mine, theirs = _binding(cls, name), _binding(base, name)
        if mine != theirs:
            problems.append(f"{name}: a {mine} here, a {theirs} in {base.__name__}")
            continue
        if mine == "property" or not callable(getattr(base, name)):
            continue
        problems.extend(signature_problems(name, getattr(cls, name), getattr(base, name)))
    return problems


def _older(version: str, than: str) -> bool:
    def parts(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])

    return parts(version) < parts(than)


def vllm_imports(paths: tuple[pathlib.Path, ...]) -> list[tuple[str, str, str | None]]:
    """Every ``import vllm...`` / ``from vllm... import name`` in ``paths`` (type-checking and
    function-local ones included): (where, module, name or None)."""
    found: list[tuple[str, str, str | None]] = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    found.extend((where, node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.extend(
                    (where, alias.name, None)
                    for alias in node.names
                    if alias.name == "vllm" or alias.name.startswith("vllm.")
                )
    return found


def unresolved_imports(paths: tuple[pathlib.Path, ...]) -> list[str]:
    """The `vllm_imports` of ``paths`` that this vLLM does not have."""
    missing: list[str] = []
    for where, module_name, name in vllm_imports(paths):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{where}: {module_name}: {exc}")
            continue
        if name is None or hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{where}: {module_name} has no {name!r}")
    return missing


def sleep_mode_answer() -> bool | None:
    """`TieredKVConnector.supports_sleep_mode` asked as vLLM asks it when ``enable_sleep_mode``
    is set (the class loaded by vLLM's factory from a KV transfer config); None where this vLLM
    has no such question (0.32)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        return None
    config = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tiered_kv.integrations.vllm",
        kv_role="kv_both",
    )
    return bool(KVConnectorFactory.get_connector_class(config).supports_sleep_mode(config))


def _load(spec: str) -> type:
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{spec} is not a class")
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("classes", nargs="+", help="module:QualName of each connector class")
    parser.add_argument("--expect-version", help="fail unless this vLLM version imports")
    parser.add_argument("--sources", nargs="*", type=pathlib.Path, help="files for the imports")
    args = parser.parse_args(argv)
    import vllm

    version = str(vllm.__version__)
    if args.expect_version and version.split("+")[0] != args.expect_version:
        print(
            f"expected vLLM {args.expect_version}, imported {version} from {vllm.__file__}",
            file=sys.stderr,
        )
        return 2
    sources = tuple(args.sources) if args.sources is not None else INTEGRATION_SOURCES
    report = {
        "version": version,
        "vllm_file": vllm.__file__,
        "classes": {spec: class_problems(_load(spec), version) for spec in args.classes},
        "unresolved_imports": unresolved_imports(sources),
        "supports_sleep_mode": sleep_mode_answer(),
    }
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
