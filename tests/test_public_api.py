"""`tiered_kv.__all__` names every type a user passes in or gets back.

Walks the type hints of the public surface: the verbs and constructors of the classes users make
(the engines, the config, the salt), the public methods of every exported class, and the fields
of every dataclass met on the way (statistics snapshots, keys, results, layouts). Every class
defined in tiered_kv that shows up must be exported from the package itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterator

import tiered_kv

CONSTRUCTED = {
    tiered_kv.TieredKVEngine,
    tiered_kv.SyncTieredKVEngine,
    tiered_kv.EngineConfig,
    tiered_kv.KeySalt,
}
# Inspection and fault-injection hooks that hand out the engine's internals on purpose.
INTERNALS = {(tiered_kv.TieredKVEngine, "storage")}


def _types_in(hint: object) -> Iterator[type]:
    if isinstance(hint, type):
        yield hint
    origin = typing.get_origin(hint)
    if isinstance(origin, type):
        yield origin
    for arg in typing.get_args(hint):
        yield from _types_in(arg)


def _hints(cls: type) -> Iterator[tuple[str, object]]:
    if dataclasses.is_dataclass(cls):
        yield from (("field", h) for h in typing.get_type_hints(cls).values())
    for name, member in inspect.getmembers(cls):
        if (cls, name) in INTERNALS:
            continue
        if name.startswith("_") and not (name == "__init__" and cls in CONSTRUCTED):
            continue
        fn = member.fget if isinstance(member, property) else member
        if callable(fn) and not isinstance(fn, type):
            yield from ((name, h) for h in typing.get_type_hints(fn).values())


def test_every_type_of_the_public_surface_is_exported() -> None:
    exported = {getattr(tiered_kv, name) for name in tiered_kv.__all__}
    todo = [c for c in exported if isinstance(c, type)]
    seen: set[type] = set()
    missing: dict[str, str] = {}
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for where, hint in _hints(cls):
            for found in _types_in(hint):
                if not found.__module__.startswith("tiered_kv") or found in seen:
                    continue
                if found not in exported:
                    name = f"{found.__module__}.{found.__qualname__}"
                    missing.setdefault(name, f"{cls.__qualname__}.{where}")
                todo.append(found)
    assert not missing, "\n".join(f"{n} (from {w})" for n, w in sorted(missing.items()))


def test_every_exported_name_exists_once() -> None:
    assert len(set(tiered_kv.__all__)) == len(tiered_kv.__all__)
    for name in tiered_kv.__all__:
        assert getattr(tiered_kv, name) is not None, name
